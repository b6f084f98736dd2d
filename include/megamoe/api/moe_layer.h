// The device-resident MoE layer (CUDA backend): owns or borrows the weights in
// the kernel layout (weights/layout.h: one buffer, or separate regions), owns a workspace sized once for
// max_tokens, validates everything a caller hands it, and enqueues a forward
// that is CUDA-graph capturable (no allocation, no host synchronization; the
// token count may live in device memory).
#pragma once

#include <cstdint>
#include <memory>

#include "megamoe/model/shape.h"
#include "megamoe/numerics/fp8.h"
#include "megamoe/weights/host_weights.h"

namespace megamoe {
class WeightStore;  // weights/store.h (C++20: the .cu files that include this header are C++17)
}

namespace megamoe::api {

using Stream = void*;  // cudaStream_t, kept opaque so CPU-only code can include this header

struct MoeLayerOptions {
  int max_tokens = 4096;  // workspace capacity; a forward with more tokens is an error
  // The forward's scratch memory, when the caller provides it: device memory of the
  // current device, 256-byte aligned, at least CudaMoeLayer::workspace_bytes_for(shape,
  // max_tokens) bytes. One buffer can serve every MoE layer of a model (a GLM-5 layer
  // needs 0.83 GB at 4096 tokens: 62 GB for its 75 layers, each with its own). Layers
  // that share it must run one after another (one stream, or ordered by events), and
  // the routing outputs and check()'s record are then those of whichever ran last.
  // Null: the layer allocates its own.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Routing the caller computed, in device memory of the layer's device, row-major [T][K]
// (T = the forward's token count, K = shape().topk).
struct RoutingInput {
  const void* ids = nullptr;  // expert ids in [0, E): int32 (id_bytes 4) or int64 (8)
  int id_bytes = 4;
  const float* weights = nullptr;  // float32, used as given (no renormalization, no scaling)
};

class CudaMoeLayer {
 public:
  // Uploads the host weights into a device allocation the layer owns.
  CudaMoeLayer(const HostMoeWeights& w, const MoeLayerOptions& opt);
  // Borrows weights already in device memory at `device_base`, laid out by
  // MoeWeightLayout::compute(shape) (e.g. a WeightStore's buffer). The
  // pointer must be 256-byte aligned device memory of the current device.
  CudaMoeLayer(const MoeShape& shape, const void* device_base, const MoeLayerOptions& opt);
  // Borrows weights already in device memory as separate regions (a MoeWeightsView of device
  // pointers, each region laid out as weights/layout.h says, 16-byte aligned; shared_* null
  // when S = 0, bias null when the shape has no correction bias). The caller keeps them alive
  // and may rewrite them in place between forwards. Throws std::invalid_argument naming the
  // region that is null (or given where the shape has none), not device memory of the
  // current device, or misaligned.
  CudaMoeLayer(const MoeShape& shape, const MoeWeightsView& device_weights, const MoeLayerOptions& opt);
  // Borrows layer `layer` of a WeightStore in device memory (the usual way: the store
  // loads and reloads in place, the layer object and its graphs keep working). Throws
  // std::invalid_argument if the store does not hold the layer, holds it in host memory,
  // or has not loaded it yet (ready() false: its weights would be zeros).
  CudaMoeLayer(const WeightStore& store, int layer, const MoeLayerOptions& opt);
  ~CudaMoeLayer();
  CudaMoeLayer(const CudaMoeLayer&) = delete;
  CudaMoeLayer& operator=(const CudaMoeLayer&) = delete;

  // x: bf16 [T][H], y: bf16 [T][H], device memory (16-byte aligned).
  // num_tokens_dev: device int holding T; tokens_hint: a host upper bound of
  // T (<= max_tokens) that sizes the launch (capture a graph at the largest
  // hint you need). If num_tokens_dev is null the layer uses its own device
  // counter set to tokens_hint (an async copy, capturable).
  // NOTE: *num_tokens_dev must lie in [0, tokens_hint]. A count outside it is a bug
  // the device cannot throw for: the kernels clamp it into that range (never reading
  // past x or writing past y; rows past the hint are not written) and record it,
  // and check() reports it.
  void forward(const num::bf16_t* x, num::bf16_t* y, int tokens_hint, const int* num_tokens_dev,
               Stream stream);

  // forward on the caller's routing instead of the layer's router (same x, y, tokens_hint,
  // num_tokens_dev, stream rules as forward; capturable). The rows computed are those the
  // layer's own forward computes for the same ids and weights, byte for byte. Throws
  // std::invalid_argument for null ids or weights (tokens_hint > 0), id_bytes not 4 or 8,
  // or pointers that are not device memory of the layer's device (or misaligned).
  // NOTE: an id outside [0, E) is a caller's bug the device cannot throw for: that slot is
  // computed as expert 0 with weight 0 (it adds nothing), and check() reports it.
  void forward(const num::bf16_t* x, num::bf16_t* y, int tokens_hint, const int* num_tokens_dev,
               Stream stream, const RoutingInput& routing);

  // After the forwards so far completed (synchronizes the device): throws
  // std::runtime_error if any of them read a device token count outside
  // [0, tokens_hint] (how many, the last count and its hint), or external routing ids
  // outside [0, E) ("topk_ids: 3 ids outside [0, 256) (the first: token 5 slot 2 = 300)"),
  // then clears the records, so the next check() reports only what happened after it.
  void check();

  // Only the routing part of forward (router GEMM + top-k), for benchmarks.
  void route(const num::bf16_t* x, int tokens_hint, const int* num_tokens_dev, Stream stream);

  // Routing outputs of the last forward (device pointers, [T][K]; after a forward on the
  // caller's routing, its ids and weights, a bad id as 0 with weight 0).
  const int32_t* topk_ids() const;
  const float* topk_weights() const;

  const MoeShape& shape() const;
  int max_tokens() const;
  // The base of the layout in device memory (for a layer over a MoeWeightsView of separate
  // regions: its w13 pointer).
  const void* device_weights() const;
  size_t workspace_bytes() const;
  // The workspace a layer of shape `s` needs for max_tokens tokens (MoeLayerOptions::workspace).
  static size_t workspace_bytes_for(const MoeShape& s, int max_tokens);
  std::string config_for(int tokens) const;  // tile configuration, for reports

  struct Impl;  // implementation detail (src/api/moe_layer.cu)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace megamoe::api
