// WeightStore: every MoE layer's weights of a model in the kernel layout
// (weights/layout.h), in host memory (CPU backend) or device memory (CUDA),
// and their lifecycle (docs/numerics.md §9): cold load, split and out-of-order updates,
// in-place reload.
//
// Lifecycle: begin(mode) opens a load session; update() brings one checkpoint
// tensor by name (any order; a weight and its block scale may come in
// separate calls); finish() closes the session and throws, listing every
// tensor name, when a (weight, scale) pair is incomplete or a layer never got
// all of its tensors. The name -> region mapping is moe_layer_slots
// (checkpoint_layout.h), the same table load_moe_layer and the checkpoint writers use.
//
// NOTE: buffers never move. Each layer is one allocation made by the
// constructor (256-byte aligned; device memory: one cudaMalloc per layer);
// base(layer) is stable for the store's lifetime, so a CudaMoeLayer or a
// captured CUDA graph that borrowed it stays valid across reloads. An update
// that would not fit the live layout (dtype or shape differ, e.g. a router
// stored in another dtype) is an error, never a reallocation.
//
// Reload modes:
//   kLayerwise  a layer is marked not ready at its first update of the
//               session and processed (derived tensors computed, marked
//               ready) as soon as all of its checkpoint tensors have arrived;
//               derived tensors do not count towards "all". finish() fails if
//               a touched layer is incomplete.
//   kDirect     checkpoint tensors are written straight into the live layout;
//               derived tensors of a pair are recomputed as soon as both of
//               its parts are in; readiness is not withdrawn while the session
//               is open. A session that closes (finish(), or a load() that
//               throws) with a pair half written leaves that layer not ready
//               until a later session brings both halves (or the whole layer).
//
// NOTE: the store does not order its writes after work already queued on the
// caller's streams. Before begin() (and before zero_experts), let every forward
// or graph replay that reads the store's layers complete (synchronize their
// streams); enqueue the next one after finish() returns. A forward that runs
// during a session reads bytes in flux (a direct session's, too).
//
// Kernel formats: kBlockFp8Hopper uses the checkpoint's bytes as they are
// (nothing derived). kMxfp8Blackwell also keeps, per layer, an MXFP8 copy of
// every expert weight (E4M3 + one UE8M0 byte per 1x32 along K, docs/numerics.md §5),
// computed once both parts of a pair are in; non-power-of-two source scales
// trigger num::warn_non_pow2_once with the measured relative L2 error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "megamoe/io/safetensors.h"
#include "megamoe/model/config.h"
#include "megamoe/numerics/quant.h"
#include "megamoe/weights/checkpoint_layout.h"
#include "megamoe/weights/host_weights.h"
#include "megamoe/weights/layout.h"

namespace megamoe {

enum class StoreMemory { kHost, kDevice };
enum class KernelFormat { kBlockFp8Hopper, kMxfp8Blackwell };
enum class ReloadMode { kLayerwise, kDirect };

std::string_view to_string(StoreMemory m);
std::string_view to_string(KernelFormat f);
std::string_view to_string(ReloadMode m);
// "layerwise" | "direct"; throws std::invalid_argument otherwise.
ReloadMode parse_reload_mode(std::string_view s);

// The derived MXFP8 copy of one layer (kMxfp8Blackwell), row-major like the
// block-FP8 regions it comes from:
//   w13 E4M3 [E][2I][H], w13_sf UE8M0 [E][2I][H/32], w2 [E][H][I], w2_sf [E][H][I/32],
//   shared_* the same with Is. Needs H % 32 == 0 and I % 32 == 0.
struct Mxfp8Layout {
  Region w13, w13_sf, w2, w2_sf;
  Region shared_w13, shared_w13_sf, shared_w2, shared_w2_sf;
  size_t total_bytes = 0;

  static Mxfp8Layout compute(const MoeShape& s);
  static Mxfp8Layout compute(const MoeShape& s, int experts);  // that many routed experts
};

struct WeightStoreOptions {
  StoreMemory memory = StoreMemory::kHost;
  KernelFormat kernel_format = KernelFormat::kBlockFp8Hopper;
  std::vector<int> layers;  // decoder layer indices to hold; empty = every MoE layer
  // The routed experts to hold ({0, 0}: all). An expert-parallel rank holds its own
  // E/R (with the shared expert and the whole router): update() and load() pass over
  // the other experts' tensors as not held, finish() asks only for these, and
  // layout(layer).experts says which they are. Such a layer is not a whole layer:
  // the single-device layer and the CPU forward refuse it; CudaEpMoeLayer takes it.
  ExpertRange experts;
};

// What one session did.
struct FinishReport {
  int layers_processed = 0;  // layers that became ready (layerwise) or were completed (direct)
  size_t tensors = 0;        // update() calls that landed
  size_t bytes = 0;
  num::RequantReport mxfp8;  // over every pair requantized in the session
};

// How load() walks a checkpoint.
struct LoadOptions {
  ReloadMode mode = ReloadMode::kLayerwise;
  // false: stream each shard once, in file order, straight into the buffers
  // (pread into host memory, no intermediate copy). true: every tensor in a
  // random order (seeded), a weight and its scale never adjacent by design.
  bool shuffle = false;
  uint64_t seed = 1;
  // Called after each tensor with (bytes done, bytes total); may be empty.
  std::function<void(size_t, size_t)> progress;
};

class WeightStore {
 public:
  // Layers and shapes from the description (router dtype as the config claims).
  WeightStore(const ModelDesc& desc, const WeightStoreOptions& opt = {});
  ~WeightStore();
  WeightStore(WeightStore&&) noexcept;
  WeightStore& operator=(WeightStore&&) noexcept;
  WeightStore(const WeightStore&) = delete;
  WeightStore& operator=(const WeightStore&) = delete;

  // As the constructor, with each layer's router dtype taken from the dtype
  // gate.weight has in `ckpt` (BF16 or F32), as load_moe_layer does.
  static WeightStore for_checkpoint(const io::Checkpoint& ckpt, const ModelDesc& desc,
                                    const WeightStoreOptions& opt = {});

  // ---- load sessions ----
  // Throws std::logic_error if a session is already open.
  void begin(ReloadMode mode);
  // One checkpoint tensor. Returns false (and copies nothing) for a name that
  // belongs to no held MoE layer (attention, norms, dense layers, ...) or to a routed
  // expert outside WeightStoreOptions::experts; a name
  // inside a held layer's experts./shared_experts./gate. namespace that the
  // layout does not have is an io::FormatError, as is a dtype, shape or byte
  // size that differs from the layout (message: tensor, expected vs found).
  // `data` is host memory, or for a device store also device memory (e.g. a trainer's
  // tensor on the GPU: copied device to device, its block scales, router and bias read
  // back for the value check, ~0.1 % of the bytes); device data must be complete (its
  // producing stream synchronized) before the call. Either way the bytes are in place
  // when update returns, and `data` may be reused.
  bool update(std::string_view name, io::Dtype dtype, std::span<const int64_t> shape, const void* data,
              size_t bytes);
  bool update(const io::TensorView& v) { return update(v.name, v.dtype, v.shape, v.data, v.bytes); }
  // Checks what update() checks (the name, dtype, shape, size and the values of a scale,
  // router or bias tensor) without writing: throws as update() would; false for a name the
  // store does not hold.
  bool validate(std::string_view name, io::Dtype dtype, std::span<const int64_t> shape, const void* data,
                size_t bytes) const;
  // Several tensors as one step: every one validated before any is written, so a refused
  // call (a bad scale beside its weight, a name given twice) leaves the store's bytes as they
  // were. Returns whether any landed (names the store does not hold are passed over, as
  // update()'s).
  bool update(std::span<const io::TensorView> tensors);
  // Closes the session. Throws io::NotFoundError listing every incomplete pair
  // ("... arrived without its block scale '...'") and every missing tensor of a
  // layer that is not complete; the session is closed either way.
  FinishReport finish();
  bool in_session() const;

  // begin + every held tensor of `ckpt` + finish.
  FinishReport load(const io::Checkpoint& ckpt, const LoadOptions& opt = {});

  // ---- the buffers ----
  const std::vector<int>& layers() const;  // decoder layer indices, ascending
  bool holds(int layer) const;
  const MoeShape& shape(int layer) const;
  const MoeWeightLayout& layout(int layer) const;
  StoreMemory memory() const;
  KernelFormat kernel_format() const;
  // Base of the layer's kernel layout (host or device address); never changes.
  const void* base(int layer) const;
  // The layer's derived MXFP8 copy (kMxfp8Blackwell only, else null), inside
  // the same allocation, 256-byte aligned.
  const void* mxfp8_base(int layer) const;
  const Mxfp8Layout& mxfp8_layout(int layer) const;
  // Requantization error of the layer's MXFP8 copy (zeros for Hopper).
  num::RequantReport mxfp8_report(int layer) const;
  // All of the layer's tensors are loaded, no pair is left half written by a session,
  // and its derived tensors are current.
  bool ready(int layer) const;
  // Host view for the CPU backend; throws for device memory.
  MoeWeightsView host_view(int layer) const;
  // A host reader's hold on every layer's bytes (the CPU backend's forward over a host
  // store, on any thread): while one lives, the writers (begin, update, finish, load's
  // tensors, zero_experts) wait for it, so the reader sees each update() call whole (a
  // weight with the scale that came in the same call) and no layer's readiness changes
  // under it; readers hold it together. Take it before asking ready() or host_view() for
  // the read. A device store's readers are kernels on the caller's streams, which a host
  // lock cannot hold: for them the NOTE above stands.
  [[nodiscard]] std::shared_lock<std::shared_mutex> read_lock() const;

  // A host copy (device -> host for device memory), e.g. for api::forward.
  HostMoeWeights to_host(int layer) const;
  // Copies `bytes` bytes at byte `offset` of the layer's allocation (kernel
  // layout, then the MXFP8 copy) into `dst`; host or device alike.
  void read_bytes(int layer, size_t offset, size_t bytes, void* dst) const;
  // Bytes of the layer's allocation (kernel layout rounded to 256, plus the MXFP8 copy).
  size_t allocation_bytes(int layer) const;
  size_t total_bytes() const;  // all layers

  // Zeroes every routed and shared expert weight and scale (and the MXFP8
  // copy) of `layer` in place and marks it not ready; the router and bias stay.
  void zero_experts(int layer);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  explicit WeightStore(std::unique_ptr<Impl> impl);
};

// One MoE layer of a checkpoint read through a host WeightStore (streamed,
// split-pair bookkeeping and finish() checks included) and returned as
// HostMoeWeights for api::forward. Throws std::invalid_argument if `layer` is
// not a MoE layer of `desc`.
HostMoeWeights load_layer_via_store(const io::Checkpoint& ckpt, const ModelDesc& desc, int layer);

// 64-bit content hash of a byte range (not cryptographic): what reload checks
// compare before and after.
uint64_t hash_bytes(const void* data, size_t bytes);

}  // namespace megamoe
