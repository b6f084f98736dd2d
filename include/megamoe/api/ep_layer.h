// Expert-parallel MoE layer over R ranks, of which this process drives some or all
// (docs/numerics.md §8). Every rank routes its own batch, owns E/R experts, and the
// fused kernel moves tokens and results between the ranks (kernels/ep_layout.h has
// the flow). The bytes of every rank's output equal those of the single-device
// layer on the same tokens. Transports:
//   - virtual: R ranks on the current GPU, each with its own symmetric buffer,
//     workspace, stream, weights and 1/R of the SMs;
//   - nccl: ranks on their own GPUs in NCCL symmetric windows, one process for all
//     GPUs or one per GPU (local_ranks, rendezvous).
// Either way a rank's device holds only that rank's E/R routed experts, with the
// shared expert and the whole router (weight_bytes).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megamoe/api/moe_layer.h"
#include "megamoe/model/shape.h"
#include "megamoe/numerics/fp8.h"
#include "megamoe/weights/host_weights.h"

namespace megamoe {
class WeightStore;
}

namespace megamoe::api {

enum class EpTransport { kVirtual, kNccl };

class CudaEpMoeLayer;

struct EpLayerOptions {
  int ranks = 2;           // R: divides the expert count, at most 16
  int max_tokens = 1024;   // per rank (sizes the symmetric buffers); more is an error
  double timeout_s = 5.0;  // a peer that does not arrive within this is an error, never a hang
  EpTransport transport = EpTransport::kVirtual;
  // nccl: the ranks this process drives and their devices (empty: all, rank r on
  // device r), and the rendezvous file when a process drives only some of them.
  std::vector<int> local_ranks;
  std::vector<int> devices;
  std::string rendezvous;
  // Another layer of the model whose transport, symmetric buffers, workspaces and
  // streams this one uses instead of its own (the layers run one after another on a
  // stream, as a model's do): a layer then costs its weights only. Same shape and
  // options as that layer (else std::invalid_argument); it need only be alive while
  // this one is made (the shared part lives while any of its layers does).
  // Routing outputs (topk_ids) are then those of the group's last forward.
  const CudaEpMoeLayer* share = nullptr;
};

EpTransport parse_ep_transport(const std::string& name);  // virtual | nccl

class CudaEpMoeLayer {
 public:
  // Uploads each local rank's part of the host weights to its device (w stays the
  // caller's; it may be freed after construction). w may hold only some experts
  // (HostMoeWeights(shape, ExpertRange)): those of every local rank.
  CudaEpMoeLayer(const HostMoeWeights& w, const EpLayerOptions& opt);
  // From a loaded layer of WeightStores (moe_layer_store.cpp): one store for every
  // local rank, or one each (stores[i] for local rank i, e.g. each on its rank's GPU
  // holding its experts: WeightStoreOptions::experts). A device store that holds
  // exactly its rank's experts on that rank's device is borrowed, so its in-place
  // reloads reach the next forward (keep it alive while the layer is used); any other
  // (host memory, another device, more experts) is copied from, once.
  CudaEpMoeLayer(const WeightStore& store, int layer, const EpLayerOptions& opt);
  CudaEpMoeLayer(const std::vector<const WeightStore*>& stores, int layer, const EpLayerOptions& opt);
  ~CudaEpMoeLayer();
  CudaEpMoeLayer(const CudaEpMoeLayer&) = delete;
  CudaEpMoeLayer& operator=(const CudaEpMoeLayer&) = delete;

  // One forward of every local rank (index i = local_ranks()[i]): x[i], y[i] are its
  // bf16 [T][H] arrays on its device, tokens[i] = T (host; over max_tokens is an
  // error naming the rank). If num_tokens_dev is given, num_tokens_dev[i] is a device
  // int holding T in [0, tokens[i]] (capture a graph at the largest counts you need;
  // a count outside it runs clamped into it and check() reports it).
  // Enqueued on `stream`: the ranks fork onto their own streams and join back
  // (capturable). launch_mask (by local index): the ranks that run (tests leave one
  // out to see the timeout).
  void forward(const std::vector<const num::bf16_t*>& x, const std::vector<num::bf16_t*>& y,
               const std::vector<int>& tokens, Stream stream,
               const std::vector<const int*>& num_tokens_dev = {}, uint32_t launch_mask = ~0u);

  // After the forwards completed (synchronizes the device): throws
  // std::runtime_error naming the rank, the phase and the peer if a rank timed out,
  // and naming the rank and the count if a rank read a device token count outside
  // [0, tokens[i]] (CudaMoeLayer::check; that record is cleared once reported),
  // after resetting every rank, so the layer stays usable. Call it after every forward
  // (or graph replay) whose output you use: after a timeout the ranks' epochs disagree
  // and outputs are undefined until check() has reported the error and reset them
  // (the status is sticky until then: the forwards in between may end early, never hang).
  void check();

  int ranks() const;
  std::vector<int> local_ranks() const;
  int device(int local_index) const;
  // Device bytes of local rank i's weights: its experts' share of the layer, the
  // shared expert and the router.
  size_t weight_bytes(int local_index) const;
  // Whether local rank i reads a WeightStore's buffer in place (see the constructor).
  bool borrows_weights(int local_index) const;
  int max_tokens() const;
  const MoeShape& shape() const;
  // Routing outputs of local rank i's last forward (device pointers, [T][K], global ids).
  const int32_t* topk_ids(int r) const;
  const float* topk_weights(int r) const;
  std::string config_for(int tokens_per_rank) const;

  struct Impl;

 private:
  // A layer's weights in host or device memory laid out by `layout`; borrow: a
  // device buffer a rank may read in place (a WeightStore's).
  struct WeightSource {
    MoeShape shape;
    MoeWeightLayout layout;
    const void* base = nullptr;
    bool borrow = false;
  };
  // One source for every local rank, or one each.
  CudaEpMoeLayer(const std::vector<WeightSource>& src, const EpLayerOptions& opt);
  std::unique_ptr<Impl> impl_;
};

// A self-check every process of an expert-parallel group can run (`megamoe ep-check`,
// scripts/ep_launch.sh): random weights from `seed` (the same in every process), each
// local rank its own random batch (tokens - rank % 3 tokens: uneven), the forward
// twice (the second timed), and each rank's output bytes against the single-device
// layer on the same tokens on the same GPU.
struct EpCheckRank {
  int rank = 0, device = 0, tokens = 0;
  bool bytes_equal = false;
  double us = 0;  // the timed forward of the whole local group
};
std::vector<EpCheckRank> ep_self_check(const MoeShape& shape, int tokens, const EpLayerOptions& opt,
                                       uint64_t seed = 7);

}  // namespace megamoe::api
