// Expert-parallel MoE layer over R ranks driven by this process (issue 5, SPEC §8).
// Today: R virtual ranks on the current GPU, each with its own symmetric buffer,
// workspace, stream and 1/R of the SMs, sharing one copy of the weights; every rank
// routes its own batch, owns E/R experts, and the fused kernel moves tokens and
// results between the ranks (kernels/ep_layout.h has the flow). The bytes of every
// rank's output equal those of the single-device layer on the same tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megamoe/api/moe_layer.h"
#include "megamoe/model/shape.h"
#include "megamoe/numerics/fp8.h"
#include "megamoe/weights/host_weights.h"

namespace megamoe::api {

struct EpLayerOptions {
  int ranks = 2;           // R: divides the expert count, at most 16
  int max_tokens = 1024;   // per rank (sizes the symmetric buffers); more is an error
  double timeout_s = 5.0;  // a peer that does not arrive within this is an error, never a hang
};

class CudaEpMoeLayer {
 public:
  // Uploads the host weights once (all ranks read their experts from that copy).
  CudaEpMoeLayer(const HostMoeWeights& w, const EpLayerOptions& opt);
  ~CudaEpMoeLayer();
  CudaEpMoeLayer(const CudaEpMoeLayer&) = delete;
  CudaEpMoeLayer& operator=(const CudaEpMoeLayer&) = delete;

  // One forward of every rank: x[r], y[r] are rank r's bf16 [T_r][H] device arrays,
  // tokens[r] = T_r (host; over max_tokens is an error naming the rank). If
  // num_tokens_dev is given, num_tokens_dev[r] is a device int holding T_r <=
  // tokens[r] (capture a graph at the largest counts you need). Enqueued on
  // `stream`: the ranks fork onto their own streams and join back (capturable).
  // launch_mask: the ranks that run (tests leave one out to see the timeout).
  void forward(const std::vector<const num::bf16_t*>& x, const std::vector<num::bf16_t*>& y,
               const std::vector<int>& tokens, Stream stream, const std::vector<const int*>& num_tokens_dev = {},
               uint32_t launch_mask = ~0u);

  // After the forwards completed (synchronizes the device): throws
  // std::runtime_error naming the rank, the phase and the peer if a rank timed out,
  // after resetting every rank, so the layer stays usable.
  void check();

  int ranks() const;
  int max_tokens() const;
  const MoeShape& shape() const;
  // Routing outputs of rank r's last forward (device pointers, [T_r][K], global ids).
  const int32_t* topk_ids(int r) const;
  const float* topk_weights(int r) const;
  std::string config_for(int tokens_per_rank) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace megamoe::api
