// The MoE layer objects, one per backend, built and called alike:
//   CudaMoeLayer (CUDA backend): owns or borrows the weights in the kernel layout
//     (weights/layout.h: one buffer, or separate regions) in device memory, owns a workspace
//     sized once for max_tokens, validates everything a caller hands it, and enqueues a
//     forward that is CUDA-graph capturable (no allocation, no host synchronization; the
//     token count may live in device memory).
//   CpuMoeLayer (CPU backend): the same weights in host memory, the kernel-faithful
//     reference (reference/moe.h) as its forward: the bytes the CUDA layer computes.
// What a forward takes and refuses is decided here once, for both, and for the tools and
// the Python binding above them:
//   - T in [0, max_tokens]; T = 0 is an empty batch (nothing read, nothing written);
//   - non-finite activations are not an error (scanning x would cost a pass over it): a
//     token holding NaN or inf changes only its own output row (and its own routing);
//   - external routing: ids in [0, E) (CPU: checked, an error; CUDA: recorded, check()),
//     weights used as given.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

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

// The ten weight tensors of a layer as an engine stacks them (MoeWeightsView's members, in
// its order, named as they are): element type and shape of each in the kernel layout
// (weights/layout.h), and whether the shape has it at all.
struct StackedTensor {
  enum class Type { kE4M3, kF32, kRouter };  // kRouter: bf16 or f32 (MoeShape::router_dtype)
  const char* name = "";                     // "w13", "w13_scale", ..., "router", "bias"
  Type type = Type::kE4M3;
  std::vector<int64_t> shape;            // e.g. w13: [E, 2I, H]; w13_scale: [E, 2 ceil(I/128), ceil(H/128)]
  const char* absent_because = nullptr;  // null: the shape has it; else why not
  // Where it lies in the kernel layout (an alias: nvcc's host pass would print the
  // member-pointer declaration with parentheses g++ warns about).
  using LayoutRegion = Region MoeWeightLayout::*;
  LayoutRegion region = nullptr;
};
constexpr int kStackedTensors = 10;
std::vector<StackedTensor> stacked_tensors(const MoeShape& s);
// The view of ten pointers given in stacked_tensors' order.
MoeWeightsView stacked_view(const std::array<const void*, kStackedTensors>& p);

// Throws std::runtime_error naming `op` when layer `layer` of `store` is not ready (never
// loaded, or a reload left a weight without its scale or a layerwise reload without all of
// its tensors): a layer object over the store refuses to run on such weights.
void require_ready(const WeightStore& store, int layer, const char* op);

class CudaMoeLayer {
 public:
  // Uploads the host weights into a device allocation the layer owns.
  CudaMoeLayer(const HostMoeWeights& w, const MoeLayerOptions& opt);
  // Borrows weights already in device memory at `device_base`, laid out by
  // MoeWeightLayout::compute(shape) (e.g. a WeightStore's buffer). The
  // pointer must be 256-byte aligned device memory of the current device.
  CudaMoeLayer(const MoeShape& shape, const void* device_base, const MoeLayerOptions& opt);
  // Borrows weights already in device memory as separate regions (a MoeWeightsView of device
  // pointers, each region laid out as weights/layout.h says, 16-byte aligned (the scales and
  // the bias need only 4); shared_* null when S = 0, bias null when the shape has no
  // correction bias). The caller keeps them alive and may rewrite them in place between
  // forwards. Throws std::invalid_argument naming the region that is null (or given where
  // the shape has none), not device memory of the current device, or misaligned.
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

// The host-memory MoE layer (CPU backend): CudaMoeLayer's constructors, forwards and
// check() on host memory, synchronous (no stream, no device count). Borrowing a
// WeightStore follows its reloads: each forward reads the store's bytes as they are then
// and refuses (std::runtime_error) while the layer is not ready. Forwards of one layer
// from several threads run one at a time; the routing accessors describe the last one.
class CpuMoeLayer {
 public:
  // Copies the host weights into memory the layer owns.
  CpuMoeLayer(const HostMoeWeights& w, const MoeLayerOptions& opt);
  // Borrows host weights laid out by MoeWeightLayout::compute(shape) at `host_base`.
  CpuMoeLayer(const MoeShape& shape, const void* host_base, const MoeLayerOptions& opt);
  // Borrows host weights as separate regions (the caller keeps them alive and may rewrite
  // them between forwards). Throws std::invalid_argument naming a region that is null, or
  // given where the shape has none.
  CpuMoeLayer(const MoeShape& shape, const MoeWeightsView& host_weights, const MoeLayerOptions& opt);
  // Borrows layer `layer` of a WeightStore in host memory (it may be not yet loaded: the
  // forwards refuse until it is ready).
  CpuMoeLayer(const WeightStore& store, int layer, const MoeLayerOptions& opt);
  ~CpuMoeLayer();
  CpuMoeLayer(const CpuMoeLayer&) = delete;
  CpuMoeLayer& operator=(const CpuMoeLayer&) = delete;

  // x: bf16 [T][H], y: bf16 [T][H], host memory; T in [0, max_tokens] (0: nothing is read
  // or written). Throws std::invalid_argument for T outside that range or null x / y.
  void forward(const num::bf16_t* x, num::bf16_t* y, int tokens);
  // forward on the caller's routing, host memory [T][K]: the rows the layer's own forward
  // computes for the same ids and weights. Throws std::invalid_argument for null ids or
  // weights (T > 0), id_bytes not 4 or 8, an id outside [0, E) or a weight that is not
  // finite (naming the first: "topk_ids: expected expert ids in [0, 16), found 16 at [2, 1]").
  void forward(const num::bf16_t* x, num::bf16_t* y, int tokens, const RoutingInput& routing);
  // y as float32 [T][H] (every value is exactly a BF16); routing null: the layer's own.
  void forward(const num::bf16_t* x, float* y, int tokens, const RoutingInput* routing);

  // Nothing is recorded for later: the CPU forward throws at the call (CudaMoeLayer::check's
  // counterpart, so callers treat both alike).
  void check();

  // Routing of the last forward ([last_tokens()][K], host memory; valid until the next forward).
  const int32_t* topk_ids() const;
  const float* topk_weights() const;
  int last_tokens() const;

  const MoeShape& shape() const;
  int max_tokens() const;
  // The weights the forwards read (throws while a borrowed store's layer is not ready).
  MoeWeightsView host_weights() const;

  struct Impl;  // implementation detail (src/api/cpu_layer.cpp)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace megamoe::api
