// megamoe._megamoe: the native half of the Python package (python/megamoe/*.py is the
// public half). Tensors cross as DLPack views (nb::ndarray): torch tensors, numpy arrays,
// anything with __dlpack__; nothing here links libtorch or copies an activation.
//
// One _Layer holds one MoE layer:
//   - its weights in a WeightStore of that one layer (host memory for the CPU backend,
//     device memory for CUDA), loaded from a checkpoint or by tensor name, reloaded in
//     place (addresses never move), or borrowed: a caller's stacked tensors read in place;
//   - CPU: an api::CpuMoeLayer over the store (or the borrowed view), the bytes of
//     `megamoe forward --backend cpu`;
//   - CUDA: an api::CudaMoeLayer over the store (or the borrowed view), enqueued on the
//     caller's stream (an integer cudaStream_t), capturable.
// This file is glue: DLPack arrays in and out (their dtype, shape, device and layout
// checked here, as only this file sees them), the stream, and the translation of C++
// errors (std::invalid_argument -> ValueError, std::runtime_error -> RuntimeError). What a
// forward or a reload accepts is decided by the C++ API (api/moe_layer.h, weights/store.h)
// with its messages. The Python wrapper adds only what needs Python (torch, names,
// dataclasses).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megamoe/api/forward.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/io/safetensors.h"
#include "megamoe/model/config.h"
#include "megamoe/model/shape.h"
#include "megamoe/numerics/fp8.h"
#include "megamoe/numerics/quant.h"
#include "megamoe/weights/checkpoint_layout.h"
#include "megamoe/weights/device_memory.h"
#include "megamoe/weights/layout.h"
#include "megamoe/weights/store.h"

#if MEGAMOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#ifndef MEGAMOE_VERSION
#define MEGAMOE_VERSION "0.0.0"
#endif

namespace nb = nanobind;
using namespace megamoe;

namespace {

using In = nb::ndarray<nb::ro>;  // any dtype, device, layout: checked here, with our messages
using Out = nb::ndarray<>;

constexpr int kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;

// ---------------------------------------------------------------- describing arrays

std::string dtype_name(nb::dlpack::dtype d) {
  using C = nb::dlpack::dtype_code;
  switch (C(d.code)) {
    case C::Int: return fmt::format("int{}", d.bits);
    case C::UInt: return fmt::format("uint{}", d.bits);
    case C::Float: return fmt::format("float{}", d.bits);
    case C::Bfloat: return fmt::format("bfloat{}", d.bits);
    case C::Bool: return "bool";
    case C::Float8_E4M3FN: return "float8_e4m3fn";
    case C::Float8_E5M2: return "float8_e5m2";
    default: return fmt::format("dtype(code {}, {} bits)", d.code, d.bits);
  }
}

template <class A>
std::string shape_text(const A& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

std::string device_text(int type, int id) {
  if (type == kDLCPU) return "cpu";
  if (type == kDLCUDA) return fmt::format("cuda:{}", id);
  if (type == kDLCUDAHost) return "cuda pinned host";
  if (type == kDLCUDAManaged) return fmt::format("cuda managed:{}", id);
  return fmt::format("device type {}", type);
}

template <class A>
std::string describe(const A& a) {
  return fmt::format("{} {} on {}", dtype_name(a.dtype()), shape_text(a),
                     device_text(a.device_type(), a.device_id()));
}

bool is(nb::dlpack::dtype d, nb::dlpack::dtype_code c, int bits) {
  return d.code == uint8_t(c) && d.bits == bits;
}
bool is_bf16(nb::dlpack::dtype d) {
  // uint16: BF16 bits (ml_dtypes bfloat16 numpy arrays have no DLPack code; the wrapper
  // views them as uint16).
  return is(d, nb::dlpack::dtype_code::Bfloat, 16) || is(d, nb::dlpack::dtype_code::UInt, 16);
}
bool is_f32(nb::dlpack::dtype d) { return is(d, nb::dlpack::dtype_code::Float, 32); }
bool is_fp8(nb::dlpack::dtype d) {
  return is(d, nb::dlpack::dtype_code::Float8_E4M3FN, 8) || is(d, nb::dlpack::dtype_code::UInt, 8);
}

template <class A>
bool contiguous(const A& a) {
  for (size_t i = 0; i < a.ndim(); ++i)
    if (a.shape(i) == 0) return true;  // (an empty tensor: any strides describe it)
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) return false;
    expect *= int64_t(a.shape(i));
  }
  return true;
}

[[noreturn]] void type_error(const std::string& s) { throw nb::type_error(s.c_str()); }
[[noreturn]] void value_error(const std::string& s) { throw nb::value_error(s.c_str()); }

template <class A>
void require_shape(const char* arg, const A& a, std::initializer_list<int64_t> shape) {
  bool ok = a.ndim() == shape.size();
  size_t i = 0;
  for (int64_t v : shape) ok = ok && int64_t(a.shape(i++)) == v;
  if (!ok) {
    std::string want = "[";
    i = 0;
    for (int64_t v : shape) want += (i++ ? ", " : "") + std::to_string(v);
    value_error(fmt::format("{}: expected shape {}, found {}", arg, want + "]", describe(a)));
  }
  if (!contiguous(a))
    value_error(fmt::format("{}: expected a contiguous (row-major) tensor, found strides of a view ({})", arg,
                            describe(a)));
}

// ---------------------------------------------------------------- shapes and configs

ScoreFunc parse_score(const std::string& s) {
  if (s == "sigmoid") return ScoreFunc::kSigmoid;
  if (s == "softmax") return ScoreFunc::kSoftmax;
  if (s == "sqrtsoftplus") return ScoreFunc::kSqrtSoftplus;
  value_error(fmt::format("score: expected 'sigmoid', 'softmax' or 'sqrtsoftplus', found '{}'", s));
}

RouterDtype parse_router_dtype(const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return RouterDtype::kBF16;
  if (s == "f32" || s == "float32") return RouterDtype::kF32;
  value_error(fmt::format("router_dtype: expected 'bf16' or 'f32', found '{}'", s));
}

// A one-layer model description for a layer that comes from tensors, not a checkpoint:
// its tensors are named as DeepSeek-V3's ("model.layers.{L}.mlp.").
ModelDesc synthetic_desc(const MoeShape& s, int layer) {
  ModelDesc d;
  d.model_type = "deepseek_v3";
  d.family = "deepseek-v3";
  d.shape = s;
  d.num_layers = layer + 1;
  d.moe_layers = {layer};
  d.layer_prefix_format = "model.layers.{}.mlp.";
  return d;
}

io::Dtype io_dtype(const char* arg, nb::dlpack::dtype d) {
  if (is_fp8(d)) return io::Dtype::kF8_E4M3;
  if (is_bf16(d)) return io::Dtype::kBF16;  // (uint16: BF16 bits, see is_bf16)
  if (is_f32(d)) return io::Dtype::kF32;
  type_error(fmt::format("{}: expected float8_e4m3fn (or uint8 E4M3 codes), bfloat16 or float32, found {}",
                         arg, dtype_name(d)));
}

// "cuda" (the current device's ordinal, checked usable) or "cpu" (-1); `who` prefixes the
// messages ("Workspace: " or "").
int open_device(const std::string& dev, const std::string& who) {
  if (dev == "cpu") return -1;
  if (dev != "cuda") value_error(fmt::format("{}device: expected 'cuda' or 'cpu', found '{}'", who, dev));
#if MEGAMOE_HAVE_CUDA
  std::string why;
  if (!api::cuda_available(&why)) throw std::runtime_error(who + "device 'cuda' unavailable: " + why);
  int device = 0;
  cudaGetDevice(&device);
  return device;
#else
  throw std::runtime_error(who +
                           "device 'cuda': this build of megamoe has no CUDA backend (built without nvcc)");
#endif
}

// ---------------------------------------------------------------- workspace

struct Workspace {
  bool cuda = false;
  int device = -1;
  int max_tokens = 0;
  size_t bytes = 0;
  void* ptr = nullptr;
  std::vector<MoeShape> shapes;

  Workspace(const std::vector<MoeShape>& s, int max_tok, const std::string& dev)
      : max_tokens(max_tok), shapes(s) {
    if (s.empty()) value_error("Workspace: config_or_configs: expected at least one MoEConfig, found none");
    if (max_tok < 1) value_error(fmt::format("Workspace: max_tokens: expected >= 1, found {}", max_tok));
    for (const MoeShape& x : s) x.validate();
    device = open_device(dev, "Workspace: ");
    cuda = device >= 0;
    if (!cuda) return;  // the CPU backend needs no scratch memory
#if MEGAMOE_HAVE_CUDA
    for (const MoeShape& x : s) bytes = std::max(bytes, api::CudaMoeLayer::workspace_bytes_for(x, max_tok));
    ptr = dev::device_alloc(bytes);
#endif
  }
  ~Workspace() { dev::device_free(ptr); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
};

// ---------------------------------------------------------------- the layer

struct Layer {
  MoeShape shape;
  bool cuda = false;
  int device = -1;  // CUDA ordinal
  int max_tokens = 0;
  int layer = 0;  // the decoder layer the tensor names use
  ModelDesc desc;
  std::unique_ptr<WeightStore> store;  // null when borrowed
  MoeWeightsView borrowed{};           // the caller's tensors (borrow); kept alive by the wrapper
  std::shared_ptr<Workspace> workspace;
  int last_tokens = 0;
  std::unique_ptr<api::CpuMoeLayer> cpu_layer;
#if MEGAMOE_HAVE_CUDA
  std::unique_ptr<api::CudaMoeLayer> cuda_layer;
#endif

  Layer(const MoeShape& s, const std::string& dev, int max_tok, std::shared_ptr<Workspace> ws)
      : shape(s), max_tokens(max_tok), workspace(std::move(ws)) {
    shape.validate();
    if (max_tok < 1) value_error(fmt::format("max_tokens: expected >= 1, found {}", max_tok));
    device = open_device(dev, "");
    cuda = device >= 0;
  }

  // The shared workspace must be on this layer's device and sized for its shape (checked
  // once the shape is final: a checkpoint's router dtype comes from its file).
  void check_workspace() const {
    if (workspace) {
      if (workspace->cuda != cuda)
        value_error(fmt::format("workspace: expected a Workspace on '{}', found one on '{}'",
                                cuda ? "cuda" : "cpu", workspace->cuda ? "cuda" : "cpu"));
      if (cuda && workspace->device != device)
        value_error(fmt::format("workspace: expected a Workspace on cuda:{}, found one on cuda:{}", device,
                                workspace->device));
      if (workspace->max_tokens < max_tokens)
        value_error(fmt::format("workspace: sized for max_tokens {}, the layer asks for {}",
                                workspace->max_tokens, max_tokens));
#if MEGAMOE_HAVE_CUDA
      const size_t need = cuda ? api::CudaMoeLayer::workspace_bytes_for(shape, max_tokens) : 0;
      if (workspace->bytes < need)
        value_error(
            fmt::format("workspace: {} bytes, this layer ({}) needs {} at max_tokens {}; list its config "
                        "in Workspace()",
                        workspace->bytes, shape.describe(), need, max_tokens));
#endif
    }
  }

  void make_store(const ModelDesc& d, int L, const io::Checkpoint* ckpt) {
    desc = d;
    layer = L;
    desc.require_moe_layer(L, "layer");
    WeightStoreOptions so;
    so.memory = cuda ? StoreMemory::kDevice : StoreMemory::kHost;
    so.layers = {L};
    store = std::make_unique<WeightStore>(ckpt ? WeightStore::for_checkpoint(*ckpt, desc, so)
                                               : WeightStore(desc, so));
    shape = store->shape(L);
    if (!cuda) attach();  // (the CPU layer follows the store: it refuses forwards until ready)
  }

  api::MoeLayerOptions layer_options() const {
    api::MoeLayerOptions o;
    o.max_tokens = max_tokens;
    if (workspace) o.workspace = workspace->ptr, o.workspace_bytes = workspace->bytes;
    return o;
  }

  // The layer object over the store's buffer (CUDA: after the first complete load) or the
  // borrowed view.
  void attach() {
    if (!cuda && !cpu_layer) {
      if (store)
        cpu_layer = std::make_unique<api::CpuMoeLayer>(*store, layer, layer_options());
      else
        cpu_layer = std::make_unique<api::CpuMoeLayer>(shape, borrowed, layer_options());
    }
#if MEGAMOE_HAVE_CUDA
    if (cuda && !cuda_layer) {
      if (store)
        cuda_layer = std::make_unique<api::CudaMoeLayer>(*store, layer, layer_options());
      else
        cuda_layer = std::make_unique<api::CudaMoeLayer>(shape, borrowed, layer_options());
    }
#endif
  }

  bool ready() const { return !store || store->ready(layer); }

  // ---- loading
  void sync_device() const {
#if MEGAMOE_HAVE_CUDA
    // The store writes synchronously but is not ordered after queued forwards (store.h).
    if (cuda) cudaDeviceSynchronize();
#endif
  }
  void require_store(const char* what) const {
    if (!store)
      value_error(
          fmt::format("{}: this layer borrows the caller's tensors (from_stacked(borrow=True)); write "
                      "new weights into those tensors instead",
                      what));
  }
  void begin(const std::string& mode) {
    require_store("load_weights");
    ReloadMode m;
    try {
      m = parse_reload_mode(mode);
    } catch (const std::invalid_argument&) {
      value_error(fmt::format("mode: expected 'direct' or 'layerwise', found '{}'", mode));
    }
    sync_device();
    store->begin(m);
  }
  bool in_session() const { return store && store->in_session(); }
  // `name` relative to the layer's mlp ("experts.3.gate_proj.weight"). All the tensors of
  // one call are validated by the store before any is written (WeightStore::update of a
  // span), so a refused call leaves the weights as they were.
  void update(const std::vector<std::pair<std::string, In>>& tensors) {
    require_store("load_weights");
    std::vector<std::string> names;
    std::vector<std::vector<int64_t>> shapes;
    std::vector<io::TensorView> views;
    names.reserve(tensors.size()), shapes.reserve(tensors.size()), views.reserve(tensors.size());
    for (const auto& [name, t] : tensors) {
      const std::string arg = "tensor '" + name + "'";
      if (!contiguous(t))
        value_error(
            fmt::format("{}: expected a contiguous tensor, found a strided view ({})", arg, describe(t)));
      const bool on_device = t.device_type() == kDLCUDA || t.device_type() == kDLCUDAManaged;
      if (on_device && !cuda)
        value_error(fmt::format("{}: expected a cpu tensor for a cpu layer, found {}", arg, describe(t)));
      if (!on_device && t.device_type() != kDLCPU && t.device_type() != kDLCUDAHost)
        value_error(fmt::format("{}: expected a cpu or cuda tensor, found {}", arg, describe(t)));
      io::TensorView v;
      v.dtype = io_dtype(arg.c_str(), t.dtype());
      names.push_back(desc.layer_prefix(layer) + name);
      shapes.emplace_back(t.ndim());
      for (size_t i = 0; i < t.ndim(); ++i) shapes.back()[i] = int64_t(t.shape(i));
      v.name = names.back(), v.shape = shapes.back();
      v.data = static_cast<const uint8_t*>(t.data()), v.bytes = t.nbytes();
      if (!store->validate(v.name, v.dtype, v.shape, v.data, v.bytes))
        value_error(fmt::format(
            "{}: not a tensor of this MoE layer (expected experts.{{e}}.{{gate,up,down}}_proj.weight / "
            ".weight_scale_inv with e in [0, {}), shared_experts.*, gate.weight, "
            "gate.e_score_correction_bias)",
            arg, shape.experts));
      views.push_back(v);
    }
    // (without the GIL: a CPU forward on another thread may hold the store's bytes)
    nb::gil_scoped_release release;
    store->update(views);
  }
  void finish() {
    require_store("load_weights");
    store->finish();
    if (store->ready(layer)) attach();
  }
  void zero_experts() {
    require_store("zero_experts");
    sync_device();
    store->zero_experts(layer);
  }
  nb::bytes weight_bytes() const {
    if (!store) value_error("weight_bytes: a borrowed layer's weights are the caller's tensors");
    const size_t n = store->layout(layer).total_bytes;
    std::string b(n, '\0');
    sync_device();
    store->read_bytes(layer, 0, n, b.data());
    return nb::bytes(b.data(), b.size());
  }
  uintptr_t weights_address() const {
    if (store) return uintptr_t(store->base(layer));
    return uintptr_t(borrowed.w13);
  }

  // ---- stacked tensors (the kernel layout: api::stacked_tensors' order and shapes)
  using Stacked = std::vector<std::optional<In>>;
  void check_stacked(const Stacked& st, bool borrow) {
    using T = api::StackedTensor::Type;
    const std::vector<api::StackedTensor> specs = api::stacked_tensors(shape);
    if (st.size() != specs.size())
      throw std::logic_error(fmt::format("stacked: {} tensors, expected {}", st.size(), specs.size()));
    for (size_t i = 0; i < specs.size(); ++i) {
      const api::StackedTensor& spec = specs[i];
      const char* arg = spec.name;
      const std::optional<In>& t = st[i];
      if (spec.absent_because) {
        if (t)
          value_error(
              fmt::format("{}: expected None ({}), found {}", arg, spec.absent_because, describe(*t)));
        continue;
      }
      if (!t) value_error(fmt::format("{}: required, found None", arg));
      const auto d = t->dtype();
      if (spec.type == T::kE4M3 && !is_fp8(d))
        type_error(
            fmt::format("{}: expected float8_e4m3fn (or uint8 E4M3 codes), found {}", arg, describe(*t)));
      if (spec.type == T::kF32 && !is_f32(d))
        type_error(fmt::format("{}: expected float32, found {}", arg, describe(*t)));
      if (spec.type == T::kRouter && !is_bf16(d) && !is_f32(d))
        type_error(fmt::format("{}: expected bfloat16 or float32, found {}", arg, describe(*t)));
      bool ok = t->ndim() == spec.shape.size();
      for (size_t k = 0; ok && k < spec.shape.size(); ++k) ok = int64_t(t->shape(k)) == spec.shape[k];
      if (!ok)
        value_error(
            fmt::format("{}: expected shape [{}], found {}", arg, fmt::join(spec.shape, ", "), describe(*t)));
      if (!contiguous(*t))
        value_error(fmt::format("{}: expected a contiguous (row-major) tensor, found strides of a view ({})",
                                arg, describe(*t)));
      if (borrow) {
        const int want = cuda ? kDLCUDA : kDLCPU;
        if (t->device_type() != want || (cuda && t->device_id() != device))
          value_error(fmt::format("{}: borrow=True reads the tensor in place: expected it on {}, found {}",
                                  arg, cuda ? fmt::format("cuda:{}", device) : std::string("cpu"),
                                  describe(*t)));
        if (uintptr_t(t->data()) % 16 != 0)
          value_error(fmt::format("{}: borrow=True needs a 16-byte aligned tensor, found address {:#x}", arg,
                                  uintptr_t(t->data())));
      }
    }
  }
  // Copies the stacked tensors in through the store, checkpoint tensor by checkpoint tensor:
  // each slot of moe_layer_slots is a contiguous slice of its region's stacked tensor.
  void load_stacked(const Stacked& st, const std::string& mode) {
    const std::vector<api::StackedTensor> specs = api::stacked_tensors(shape);
    const std::vector<TensorSlot> slots = moe_layer_slots(shape, desc.layer_prefix(layer));
    std::vector<io::TensorView> views;
    for (const TensorSlot& slot : slots) {
      size_t i = 0;
      while (i < specs.size() && specs[i].region != slot.region) ++i;
      if (i == specs.size() || !st[i])
        throw std::logic_error("load_stacked: no stacked tensor for " + slot.name);
      io::TensorView v;
      v.name = slot.name, v.dtype = slot.dtype, v.shape = slot.shape, v.bytes = slot.bytes();
      v.data = static_cast<const uint8_t*>(st[i]->data()) + slot.offset;
      views.push_back(v);
    }
    begin(mode);
    try {
      store->update(views);
    } catch (...) {
      try {
        store->finish();
      } catch (...) {
      }
      throw;
    }
    finish();
  }
  void set_borrowed(const Stacked& st) {
    std::array<const void*, api::kStackedTensors> p{};
    for (size_t i = 0; i < p.size(); ++i) p[i] = st[i] ? st[i]->data() : nullptr;
    borrowed = api::stacked_view(p);
    attach();
  }

  // ---- forward of a CPU layer (a CUDA layer's eager calls go through forward_raw)
  // x: [T, H] bf16 (uint16 bits) or float32; y: the same shape, bf16 or float32. ids,
  // weights: [T, K] external routing. num_tokens: -1 or a count in [0, T].
  void forward(const In& x, Out& y, const std::optional<In>& ids_in, const std::optional<In>& w_in,
               int64_t num_tokens) {
    if (cuda) throw std::logic_error("forward: a CUDA layer (its calls go through forward_raw)");
    const int64_t H = shape.hidden, K = shape.topk;
    if (x.ndim() != 2 || int64_t(x.shape(1)) != H)
      value_error(fmt::format("x: expected shape [T, {}], found {}", H, describe(x)));
    const int64_t T = int64_t(x.shape(0));
    if (T > std::numeric_limits<int>::max())
      value_error(fmt::format("x: {} tokens, more than one forward takes", T));
    require_shape("x", x, {T, H});
    require_shape("out", y, {T, H});
    if (ids_in.has_value() != w_in.has_value())
      value_error(fmt::format("topk_ids / topk_weights: external routing needs both, found only {}",
                              ids_in ? "topk_ids" : "topk_weights"));
    if (ids_in) {
      require_shape("topk_ids", *ids_in, {T, K});
      require_shape("topk_weights", *w_in, {T, K});
      const auto d = ids_in->dtype();
      if (!is(d, nb::dlpack::dtype_code::Int, 32) && !is(d, nb::dlpack::dtype_code::Int, 64))
        type_error(fmt::format("topk_ids: expected int32 or int64, found {}", describe(*ids_in)));
      if (!is_f32(w_in->dtype()))
        type_error(fmt::format("topk_weights: expected float32, found {}", describe(*w_in)));
      require_device("topk_ids", ids_in->device_type(), ids_in->device_id());
      require_device("topk_weights", w_in->device_type(), w_in->device_id());
    }
    require_device("x", x.device_type(), x.device_id());
    require_device("out", y.device_type(), y.device_id());
    if (num_tokens > T)
      value_error(fmt::format("num_tokens: expected a count in [0, {}] (x's rows), found {}", T, num_tokens));
    const int n = num_tokens < 0 ? int(T) : int(num_tokens);
    const bool x_f32 = is_f32(x.dtype()), y_f32 = is_f32(y.dtype());
    if (!x_f32 && !is_bf16(x.dtype()))
      type_error(fmt::format("x: expected bfloat16 or float32 (cpu), found {}", describe(x)));
    if (!y_f32 && !is_bf16(y.dtype()))
      type_error(fmt::format("out: expected bfloat16 or float32 (cpu), found {}", describe(y)));
    std::vector<num::bf16_t> xb;
    const auto* xp = static_cast<const num::bf16_t*>(x.data());
    if (x_f32) {
      // float32 x is rounded to BF16 (the layer's input type), as the engines' cast does.
      xb.resize(size_t(n) * size_t(H));
      const float* xf = static_cast<const float*>(x.data());
      for (size_t i = 0; i < xb.size(); ++i) xb[i] = num::bf16_encode(xf[i]);
      xp = xb.data();
    }
    api::RoutingInput r;
    if (ids_in)
      r.ids = ids_in->data(), r.id_bytes = int(ids_in->dtype().bits / 8),
      r.weights = static_cast<const float*>(w_in->data());
    {
      nb::gil_scoped_release release;
      if (y_f32)
        cpu_layer->forward(xp, static_cast<float*>(y.data()), n, ids_in ? &r : nullptr);
      else if (ids_in)
        cpu_layer->forward(xp, static_cast<num::bf16_t*>(y.data()), n, r);
      else
        cpu_layer->forward(xp, static_cast<num::bf16_t*>(y.data()), n);
    }
    last_tokens = n;
  }

  void require_device(const char* arg, int type, int id) const {
    if (cuda) {
      if (type != kDLCUDA || id != device)
        value_error(
            fmt::format("{}: expected a tensor on cuda:{} (the layer's device; never copied), found {}", arg,
                        device, device_text(type, id)));
    } else if (type != kDLCPU) {
      value_error(
          fmt::format("{}: expected a cpu tensor (a cpu layer), found {}", arg, device_text(type, id)));
    }
  }

  // The eager torch path (the wrapper checked dtype, shape, device and contiguity from the
  // tensors' attributes: importing a torch tensor through DLPack costs microseconds).
  void forward_raw(uintptr_t x, uintptr_t y, int T, uintptr_t ids, int id_bytes, uintptr_t w, uintptr_t nt,
                   uintptr_t stream) {
#if MEGAMOE_HAVE_CUDA
    if (!cuda) throw std::logic_error("forward_raw: a cpu layer");
    if (store) api::require_ready(*store, layer, "forward");
    const auto* xp = reinterpret_cast<const num::bf16_t*>(x);
    auto* yp = reinterpret_cast<num::bf16_t*>(y);
    const int* ntp = reinterpret_cast<const int*>(nt);
    if (ids) {
      api::RoutingInput r;
      r.ids = reinterpret_cast<const void*>(ids);
      r.id_bytes = id_bytes;
      r.weights = reinterpret_cast<const float*>(w);
      cuda_layer->forward(xp, yp, T, ntp, reinterpret_cast<api::Stream>(stream), r);
    } else {
      cuda_layer->forward(xp, yp, T, ntp, reinterpret_cast<api::Stream>(stream));
    }
    last_tokens = T;
#else
    throw std::logic_error("forward_raw without CUDA");
#endif
  }

  void check() {
    if (cpu_layer) cpu_layer->check();
#if MEGAMOE_HAVE_CUDA
    if (cuda_layer) cuda_layer->check();
#endif
  }

  // Routing of the last forward: CPU, numpy copies; CUDA, views of the layer's device
  // buffers (valid until the next forward).
  nb::object topk(bool want_ids) {
    const size_t shp[2] = {size_t(cuda ? last_tokens : cpu_layer->last_tokens()), size_t(shape.topk)};
    if (!cuda) {
      if (want_ids) {
        auto* v = new std::vector<int32_t>(cpu_layer->topk_ids(), cpu_layer->topk_ids() + shp[0] * shp[1]);
        nb::capsule own(v, [](void* p) noexcept { delete static_cast<std::vector<int32_t>*>(p); });
        return nb::cast(nb::ndarray<nb::numpy, int32_t>(v->data(), 2, shp, own));
      }
      auto* v =
          new std::vector<float>(cpu_layer->topk_weights(), cpu_layer->topk_weights() + shp[0] * shp[1]);
      nb::capsule own(v, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
      return nb::cast(nb::ndarray<nb::numpy, float>(v->data(), 2, shp, own));
    }
#if MEGAMOE_HAVE_CUDA
    if (!cuda_layer) return nb::none();
    nb::handle owner = nb::find(this);
    if (want_ids)
      return nb::cast(nb::ndarray<nb::pytorch, int32_t>(const_cast<int32_t*>(cuda_layer->topk_ids()), 2, shp,
                                                        owner, nullptr, nb::dtype<int32_t>(), kDLCUDA,
                                                        device));
    return nb::cast(nb::ndarray<nb::pytorch, float>(const_cast<float*>(cuda_layer->topk_weights()), 2, shp,
                                                    owner, nullptr, nb::dtype<float>(), kDLCUDA, device));
#else
    return nb::none();
#endif
  }

  nb::dict properties() const {
    nb::dict d;
    d["backend"] = cuda ? "cuda" : "cpu";
    d["device_ordinal"] = device;
    d["max_tokens"] = max_tokens;
    d["borrowed"] = !store;
    d["layer"] = layer;
    d["weight_bytes"] =
        store ? store->layout(layer).total_bytes : MoeWeightLayout::compute(shape).total_bytes;
    d["shape"] = shape.describe();
    d["shared_workspace"] = bool(workspace);
#if MEGAMOE_HAVE_CUDA
    if (cuda_layer) {
      d["workspace_bytes"] = cuda_layer->workspace_bytes();
      d["tile_config"] = cuda_layer->config_for(max_tokens);
    }
#endif
    return d;
  }
};

// ---------------------------------------------------------------- quantization

// w float32 [..., N, K] (host) -> E4M3 codes (uint8, same shape) and float32
// [..., ceil(N/128), ceil(K/128)] scales, by num::quantize_block_fp8.
std::pair<nb::ndarray<nb::numpy, uint8_t>, nb::ndarray<nb::numpy, float>> quantize_block_fp8(const In& w) {
  if (w.device_type() != kDLCPU)
    value_error(fmt::format("w: expected a cpu array here, found {}", describe(w)));
  if (!is_f32(w.dtype())) type_error(fmt::format("w: expected float32, found {}", describe(w)));
  if (w.ndim() < 2) value_error(fmt::format("w: expected [..., N, K], found {}", describe(w)));
  if (!contiguous(w)) value_error(fmt::format("w: expected a contiguous array, found {}", describe(w)));
  const size_t nd = w.ndim(), N = w.shape(nd - 2), K = w.shape(nd - 1);
  if (N > size_t(std::numeric_limits<int>::max()) || K > size_t(std::numeric_limits<int>::max()))
    value_error(fmt::format("w: expected N, K < 2^31, found {}", describe(w)));
  size_t batch = 1;
  for (size_t i = 0; i + 2 < nd; ++i) batch *= w.shape(i);
  auto q = std::make_unique<std::vector<uint8_t>>(batch * N * K);
  auto s = std::make_unique<std::vector<float>>(batch * ((N + 127) / 128) * ((K + 127) / 128));
  num::quantize_block_fp8(static_cast<const float*>(w.data()), int64_t(batch), int(N), int(K), q->data(),
                          s->data());
  std::vector<size_t> qs(nd), ss(nd);
  for (size_t i = 0; i < nd; ++i) qs[i] = ss[i] = w.shape(i);
  ss[nd - 2] = (N + 127) / 128, ss[nd - 1] = (K + 127) / 128;
  auto* qv = q.release();
  auto* sv = s.release();
  nb::capsule oq(qv, [](void* p) noexcept { delete static_cast<std::vector<uint8_t>*>(p); });
  nb::capsule os(sv, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
  return {nb::ndarray<nb::numpy, uint8_t>(qv->data(), nd, qs.data(), oq),
          nb::ndarray<nb::numpy, float>(sv->data(), nd, ss.data(), os)};
}

}  // namespace

NB_MODULE(_megamoe, m) {
  m.doc() = "megamoe's native extension (use the megamoe package, not this module)";
  m.attr("__version__") = MEGAMOE_VERSION;
#if MEGAMOE_HAVE_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const io::FormatError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const io::NotFoundError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const ConfigError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def("cuda_available", [] {
    std::string why;
    const bool ok = api::cuda_available(&why);
    return std::make_pair(ok, why);
  });

  nb::class_<MoeShape>(m, "_Shape")
      .def(nb::init<>())
      .def_rw("hidden", &MoeShape::hidden)
      .def_rw("inter", &MoeShape::inter)
      .def_rw("experts", &MoeShape::experts)
      .def_rw("topk", &MoeShape::topk)
      .def_rw("shared_experts", &MoeShape::shared_experts)
      .def_rw("n_group", &MoeShape::n_group)
      .def_rw("topk_group", &MoeShape::topk_group)
      .def_prop_rw(
          "score", [](const MoeShape& s) { return std::string(to_string(s.score)); },
          [](MoeShape& s, const std::string& v) { s.score = parse_score(v); })
      .def_rw("norm_topk_prob", &MoeShape::norm_topk_prob)
      .def_rw("routed_scaling", &MoeShape::routed_scaling)
      .def_rw("swiglu_limit", &MoeShape::swiglu_limit)
      .def_prop_rw(
          "router_dtype", [](const MoeShape& s) { return std::string(to_string(s.router_dtype)); },
          [](MoeShape& s, const std::string& v) { s.router_dtype = parse_router_dtype(v); })
      .def_rw("correction_bias", &MoeShape::correction_bias)
      .def("validate", [](const MoeShape& s) { s.validate(); })
      .def("describe", &MoeShape::describe);

  // The model families' shapes (model/shape.h presets()): [(name, shape)].
  m.def("presets", [] {
    std::vector<std::pair<std::string, MoeShape>> out;
    for (const Preset& p : presets()) out.emplace_back(p.name, p.shape);
    return out;
  });

  // config.json text -> (shape, moe layers, mtp layers, family, model_type)
  m.def("parse_config", [](const std::string& text, const std::string& label) {
    const ModelDesc d = parse_config(text, label);
    return nb::make_tuple(d.shape, d.moe_layers, d.mtp_layers, d.family, d.model_type);
  });
  m.def("load_config", [](const std::string& path) {
    const ModelDesc d = load_config(path);
    return nb::make_tuple(d.shape, d.moe_layers, d.mtp_layers, d.family, d.model_type);
  });

  nb::class_<Workspace>(m, "_Workspace")
      .def(nb::init<const std::vector<MoeShape>&, int, const std::string&>())
      .def_ro("bytes", &Workspace::bytes)
      .def_ro("max_tokens", &Workspace::max_tokens)
      .def_ro("cuda", &Workspace::cuda);

  nb::class_<Layer>(m, "_Layer")
      .def_static(
          "from_checkpoint",
          [](const std::string& path, int layer, const std::string& dev, int max_tokens,
             std::shared_ptr<Workspace> ws) {
            const ModelDesc desc = load_config(path);
            desc.require_moe_layer(layer, "layer");
            const io::Checkpoint ckpt(path);
            auto l = std::make_unique<Layer>(desc.shape, dev, max_tokens, std::move(ws));
            l->make_store(desc, layer, &ckpt);
            l->check_workspace();
            {
              nb::gil_scoped_release release;
              l->store->load(ckpt);
            }
            l->attach();
            return l.release();
          },
          nb::arg("path"), nb::arg("layer"), nb::arg("device"), nb::arg("max_tokens"),
          nb::arg("workspace").none(), nb::rv_policy::take_ownership)
      .def_static(
          "empty",
          [](const MoeShape& s, int layer, const std::string& dev, int max_tokens,
             std::shared_ptr<Workspace> ws) {
            auto l = std::make_unique<Layer>(s, dev, max_tokens, std::move(ws));
            l->make_store(synthetic_desc(l->shape, layer), layer, nullptr);
            l->check_workspace();
            return l.release();
          },
          nb::arg("shape"), nb::arg("layer"), nb::arg("device"), nb::arg("max_tokens"),
          nb::arg("workspace").none(), nb::rv_policy::take_ownership)
      .def_static(
          "stacked",
          [](const MoeShape& s, const std::string& dev, int max_tokens, std::shared_ptr<Workspace> ws,
             bool borrow, const std::string& mode, const Layer::Stacked& st) {
            MoeShape shape = s;
            const std::optional<In>& router = st.size() > 8 ? st[8] : std::nullopt;
            if (router && is_f32(router->dtype())) shape.router_dtype = RouterDtype::kF32;
            if (router && is_bf16(router->dtype())) shape.router_dtype = RouterDtype::kBF16;
            auto l = std::make_unique<Layer>(shape, dev, max_tokens, std::move(ws));
            l->check_workspace();
            l->check_stacked(st, borrow);
            if (borrow) {
              l->set_borrowed(st);
            } else {
              l->make_store(synthetic_desc(l->shape, 0), 0, nullptr);
              l->load_stacked(st, mode);
            }
            return l.release();
          },
          nb::arg("shape"), nb::arg("device"), nb::arg("max_tokens"), nb::arg("workspace").none(),
          nb::arg("borrow"), nb::arg("mode"), nb::arg("tensors"), nb::rv_policy::take_ownership)
      .def("forward", &Layer::forward, nb::arg("x").noconvert(), nb::arg("out").noconvert(),
           nb::arg("topk_ids").noconvert().none(), nb::arg("topk_weights").noconvert().none(),
           nb::arg("num_tokens"))
      .def("forward_raw", &Layer::forward_raw, nb::arg("x"), nb::arg("y"), nb::arg("tokens"), nb::arg("ids"),
           nb::arg("id_bytes"), nb::arg("weights"), nb::arg("num_tokens"), nb::arg("stream"))
      .def("begin", &Layer::begin, nb::arg("mode"))
      .def("update", &Layer::update, nb::arg("tensors"))
      .def("finish", &Layer::finish)
      .def("in_session", &Layer::in_session)
      .def("zero_experts", &Layer::zero_experts)
      .def("weight_bytes", &Layer::weight_bytes)
      .def("weights_address", &Layer::weights_address)
      .def("ready", &Layer::ready)
      .def("check", &Layer::check)
      .def("topk", &Layer::topk, nb::arg("ids"))
      .def("properties", &Layer::properties)
      .def_ro("shape", &Layer::shape)
      .def_ro("cuda", &Layer::cuda)
      .def_ro("device_ordinal", &Layer::device)
      .def_ro("max_tokens", &Layer::max_tokens)
      .def_ro("layer", &Layer::layer)
      .def_ro("last_tokens", &Layer::last_tokens);

  m.def("quantize_block_fp8", &quantize_block_fp8, nb::arg("w").noconvert());
}
