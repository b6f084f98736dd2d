// `megamoe soak`: a randomized differential run of the layer under an engine's traffic. Each
// step draws one thing an engine does (a forward of 0..max_tokens tokens, eager or a replay of
// one CUDA graph, on the layer's routing or the caller's, skewed or invalid; an in-place reload;
// layers sharing a workspace; two streams; extreme inputs) and compares every output with the
// kernel-faithful CPU reference (docs/numerics.md §10) on the same weights, byte for byte; it
// counts the errors it provokes against the errors it expects, and watches device memory and
// host RSS. Test and measurement code: nothing here is part of the library.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <vector>

#include "commands.h"
#include "megamoe/api/forward.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/io/safetensors.h"
#include "megamoe/model/config.h"
#include "megamoe/numerics/fp8.h"
#include "megamoe/reference/moe.h"
#include "megamoe/weights/checkpoint_layout.h"
#include "megamoe/weights/host_weights.h"
#include "megamoe/weights/store.h"
#include "megamoe_git_commit.h"
#include "soak_routing.h"

#if defined(MEGAMOE_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace megamoe::tools {

namespace {

using Clock = std::chrono::steady_clock;
using Rng = std::mt19937_64;
using num::bf16_t;

constexpr bf16_t kPoison = 0xFFFF;  // what an output row holds before the layer writes it

int uniform_int(Rng& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
double uniform01(Rng& rng) { return std::uniform_real_distribution<double>(0.0, 1.0)(rng); }

// An empty vector with room for n, its pages touched: host RSS is measured after the
// warm-up, and a reserved page counts only once written.
template <class V>
void presize(V& v, size_t n) {
  v.resize(n);
  v.clear();  // (keeps the capacity)
}

// ---------------------------------------------------------------- options
struct SoakArgs {
  std::string preset = "glm-5.3-flash", backend = "cpu", json;
  double seconds = 10;
  long steps = 0;  // 0: until --seconds
  uint64_t seed = 0;
  bool seed_given = false;
  int max_tokens = 0;    // 0: 16 on the CPU, 4096 on CUDA
  int check_tokens = 0;  // 0: every token where the shape is small, else 2 a forward
  int hidden = 0, inter = 0, experts = 0, topk = 0;
  long inject_mismatch = 0;  // > 0: that step's first compared row gets one reference bit flipped
  std::string command;
};

// ---------------------------------------------------------------- one forward's request
// The caller's routing in host memory, [T][K] (ids as int64: the int32 form is derived).
struct HostRouting {
  std::vector<int64_t> ids;
  std::vector<float> weights;
};

struct Call {
  const bf16_t* x = nullptr;             // host [T][H]
  int tokens = 0;                        // T, the hint
  const HostRouting* routing = nullptr;  // null: the layer's own
  int id_bytes = 4;
  bool graph = false;         // a replay of the graph captured at max_tokens (CUDA)
  bool device_count = false;  // the token count read from device memory (else the layer's own)
  int count = 0;              // the device count's value (device_count): T, or a bad one
};

// What a forward gave back, in host memory owned by the layer under test.
struct Output {
  const bf16_t* y = nullptr;  // [rows][H]: rows = the hint (max_tokens for a replay)
  int rows = 0;
  const int32_t* ids = nullptr;  // the routing the forward used, [T][K] (own routing only)
  const float* weights = nullptr;
};

// ---------------------------------------------------------------- the layer under test
// One layer object of a backend, over one layer of the soak's WeightStore. The soak drives it
// only through this interface: a new backend (or a new layer class of one) is one subclass.
class LayerUnderTest {
 public:
  virtual ~LayerUnderTest() = default;
  // Enqueues (CUDA) or runs (CPU) a forward; throws what the layer throws for a bad call.
  virtual void start(const Call& c) = 0;
  // Waits for the forward and returns its output.
  virtual const Output& finish() = 0;
  // The layer's check(): throws what the forwards since the last check() recorded.
  virtual void check() = 0;
  virtual bool has_graphs() const { return false; }
};

// The CPU backend: api::CpuMoeLayer over the store's layer (it follows reloads by itself).
// It refuses what it documents: more than max_tokens tokens, ids outside [0, E) and routing
// weights that are not finite (invalid_argument at the call; nothing is left for check()).
class CpuLayer final : public LayerUnderTest {
 public:
  CpuLayer(const WeightStore& st, int layer, int max_tokens)
      : layer_(st, layer, {.max_tokens = max_tokens}),
        y_(size_t(max_tokens) * st.shape(layer).hidden),
        ids32_(size_t(max_tokens) * st.shape(layer).topk) {}

  void start(const Call& c) override {
    out_ = {y_.data(), c.tokens, nullptr, nullptr};
    if (!c.routing) {
      layer_.forward(c.x, y_.data(), c.tokens);
      out_.ids = layer_.topk_ids(), out_.weights = layer_.topk_weights();
      return;
    }
    const void* ids = c.routing->ids.data();
    if (c.id_bytes == 4) {
      const size_t n = std::min(c.routing->ids.size(), ids32_.size());
      for (size_t i = 0; i < n; ++i) ids32_[i] = int32_t(c.routing->ids[i]);
      ids = ids32_.data();
    }
    layer_.forward(c.x, y_.data(), c.tokens, api::RoutingInput{ids, c.id_bytes, c.routing->weights.data()});
  }
  const Output& finish() override { return out_; }
  void check() override { layer_.check(); }

 private:
  api::CpuMoeLayer layer_;
  std::vector<bf16_t> y_;
  std::vector<int32_t> ids32_;  // the int32 form of the caller's ids (sized once)
  Output out_;
};

#if defined(MEGAMOE_HAVE_CUDA)
void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(
        fmt::format("soak: {}: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e)));
}
#define SOAK_CUDA(call) cuda_ok((call), #call)

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) { SOAK_CUDA(cudaMalloc(&p, std::max<size_t>(bytes, 256))); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};
struct PinnedBuffer {
  void* p = nullptr;
  // Touched once here: the driver maps pinned pages into the process on their first CPU
  // access, so pages first read later (the rows past a replay's count) would count as RSS
  // growth after the warm-up.
  explicit PinnedBuffer(size_t bytes) {
    bytes = std::max<size_t>(bytes, 256);
    SOAK_CUDA(cudaMallocHost(&p, bytes));
    std::memset(p, 0, bytes);
  }
  ~PinnedBuffer() { cudaFreeHost(p); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
};

// The CUDA backend: a CudaMoeLayer borrowing the store's layer, on its own stream, with device
// buffers for x, y, the caller's routing and the token count at fixed addresses (what a
// captured graph reads), and two graphs captured at max_tokens on first use (the layer's
// routing, the caller's int32 routing), replayed with the count written to device memory.
class CudaLayer final : public LayerUnderTest {
 public:
  CudaLayer(const WeightStore& st, int layer, const api::MoeLayerOptions& opt, cudaStream_t stream)
      : layer_(st, layer, opt),
        s_(stream),
        H_(st.shape(layer).hidden),
        K_(st.shape(layer).topk),
        M_(opt.max_tokens),
        dx_(size_t(M_) * H_ * 2),
        dy_(size_t(M_) * H_ * 2),
        dids_(size_t(M_) * K_ * 8),
        dw_(size_t(M_) * K_ * 4),
        dcount_(sizeof(int)),
        hy_(size_t(M_) * H_ * 2),
        hids_(size_t(M_) * K_ * 4),
        hw_(size_t(M_) * K_ * 4) {
    presize(ids32_, size_t(M_) * K_);
  }
  ~CudaLayer() override {
    for (cudaGraphExec_t g : {own_graph_, ext_graph_})
      if (g) cudaGraphExecDestroy(g);
  }

  void start(const Call& c) override {
    const int T = c.tokens;
    auto* x = static_cast<bf16_t*>(dx_.p);
    auto* y = static_cast<bf16_t*>(dy_.p);
    if (T < 0 || T > M_) {  // (the layer refuses it before touching memory: nothing to stage)
      layer_.forward(x, y, T, nullptr, s_);
      throw std::logic_error("soak: the layer took a forward over its max_tokens");
    }
    const int hint = c.graph ? M_ : T;
    out_ = {static_cast<const bf16_t*>(hy_.p), hint, nullptr, nullptr};
    if (T > 0) SOAK_CUDA(cudaMemcpyAsync(x, c.x, size_t(T) * H_ * 2, cudaMemcpyHostToDevice, s_));
    if (hint > 0) SOAK_CUDA(cudaMemsetAsync(y, 0xFF, size_t(hint) * H_ * 2, s_));
    api::RoutingInput r;
    if (c.routing) {
      const size_t n = size_t(T) * K_;
      if (c.id_bytes == 4) {
        ids32_.resize(n);
        for (size_t i = 0; i < n; ++i) ids32_[i] = int32_t(c.routing->ids[i]);
        if (n) SOAK_CUDA(cudaMemcpyAsync(dids_.p, ids32_.data(), n * 4, cudaMemcpyHostToDevice, s_));
      } else if (n) {
        SOAK_CUDA(cudaMemcpyAsync(dids_.p, c.routing->ids.data(), n * 8, cudaMemcpyHostToDevice, s_));
      }
      if (n) SOAK_CUDA(cudaMemcpyAsync(dw_.p, c.routing->weights.data(), n * 4, cudaMemcpyHostToDevice, s_));
      r.ids = dids_.p, r.id_bytes = c.id_bytes, r.weights = static_cast<const float*>(dw_.p);
      // (the host staging buffers must outlive the copies: ordered by the next start's sync)
      SOAK_CUDA(cudaStreamSynchronize(s_));
    }
    const int* count = static_cast<const int*>(dcount_.p);
    if (c.graph || c.device_count) {
      count_value_ = c.count;
      SOAK_CUDA(cudaMemcpyAsync(dcount_.p, &count_value_, sizeof(int), cudaMemcpyHostToDevice, s_));
    }
    if (c.graph) {
      if (c.routing && c.id_bytes != 4)
        throw std::logic_error("soak: the external-routing graph takes int32 ids");
      cudaGraphExec_t& g = c.routing ? ext_graph_ : own_graph_;
      if (!g) g = capture(c.routing ? &r : nullptr);
      SOAK_CUDA(cudaGraphLaunch(g, s_));
    } else if (c.routing) {
      layer_.forward(x, y, T, c.device_count ? count : nullptr, s_, r);
    } else {
      layer_.forward(x, y, T, c.device_count ? count : nullptr, s_);
    }
    if (hint > 0) SOAK_CUDA(cudaMemcpyAsync(hy_.p, y, size_t(hint) * H_ * 2, cudaMemcpyDeviceToHost, s_));
    if (!c.routing && T > 0) {
      // (now, before another layer sharing the workspace overwrites the routing outputs)
      SOAK_CUDA(cudaMemcpyAsync(hids_.p, layer_.topk_ids(), size_t(T) * K_ * 4, cudaMemcpyDeviceToHost, s_));
      SOAK_CUDA(
          cudaMemcpyAsync(hw_.p, layer_.topk_weights(), size_t(T) * K_ * 4, cudaMemcpyDeviceToHost, s_));
      out_.ids = static_cast<const int32_t*>(hids_.p), out_.weights = static_cast<const float*>(hw_.p);
    }
  }
  const Output& finish() override {
    SOAK_CUDA(cudaStreamSynchronize(s_));
    return out_;
  }
  void check() override { layer_.check(); }
  bool has_graphs() const override { return true; }

 private:
  cudaGraphExec_t capture(const api::RoutingInput* r) {
    auto* x = static_cast<const bf16_t*>(dx_.p);
    auto* y = static_cast<bf16_t*>(dy_.p);
    const int* count = static_cast<const int*>(dcount_.p);
    cudaGraph_t graph;
    SOAK_CUDA(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
    try {
      if (r)
        layer_.forward(x, y, M_, count, s_, *r);
      else
        layer_.forward(x, y, M_, count, s_);
    } catch (...) {
      cudaStreamEndCapture(s_, &graph);
      throw;
    }
    SOAK_CUDA(cudaStreamEndCapture(s_, &graph));
    cudaGraphExec_t exec;
    SOAK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    SOAK_CUDA(cudaGraphDestroy(graph));
    return exec;
  }

  api::CudaMoeLayer layer_;
  cudaStream_t s_;
  int H_, K_, M_;
  DeviceBuffer dx_, dy_, dids_, dw_, dcount_;
  PinnedBuffer hy_, hids_, hw_;
  std::vector<int32_t> ids32_;
  int count_value_ = 0;
  cudaGraphExec_t own_graph_ = nullptr, ext_graph_ = nullptr;
  Output out_;
};
#endif  // MEGAMOE_HAVE_CUDA

// ---------------------------------------------------------------- weights and reloads
// The source of every tensor the stores receive: one HostMoeWeights per layer, changed in
// place before each reload and sent to every store (the one under test and the reference's)
// by the same calls.
class WeightFeed {
 public:
  WeightFeed(const ModelDesc& desc, const std::vector<int>& layers, uint64_t seed) : desc_(desc) {
    for (size_t i = 0; i < layers.size(); ++i) {
      Layer& l =
          layers_.emplace_back(Layer{layers[i], make_random_weights(desc.shape, seed + 101 * i), {}, {}});
      l.slots = moe_layer_slots(desc.shape, desc.layer_prefix(layers[i]));
      for (size_t k = 0; k < l.slots.size(); ++k) l.by_name[l.slots[k].name] = k;
    }
  }
  void add_store(WeightStore* st) { stores_.push_back(st); }

  size_t layer_count() const { return layers_.size(); }
  int layer_index(size_t i) const { return layers_[i].index; }

  // Every tensor of every layer, one layerwise session (the cold load).
  void cold_load() {
    all_stores([](WeightStore& st) { st.begin(ReloadMode::kLayerwise); });
    for (size_t i = 0; i < layers_.size(); ++i)
      for (size_t k = 0; k < layers_[i].slots.size(); ++k) send(i, k);
    all_stores([](WeightStore& st) { st.finish(); });
  }

  // Changes `n` routed experts of layer i (each takes another expert's weights and its
  // scales times a factor), sometimes the router (two rows swapped) and the bias, and
  // returns the slots that changed.
  std::vector<size_t> perturb(size_t i, Rng& rng, int n) {
    Layer& l = layers_[i];
    const MoeShape& s = desc_.shape;
    std::vector<size_t> changed;
    for (int j = 0; j < n; ++j) {
      const int e = uniform_int(rng, 0, s.experts - 1);
      const int donor = s.experts > 1 ? (e + uniform_int(rng, 1, s.experts - 1)) % s.experts : e;
      static constexpr float kFactors[] = {0.5f, 0.625f, 0.75f, 1.25f, 1.5f, 2.0f};
      const float f = kFactors[uniform_int(rng, 0, 5)];
      for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
        for (const char* part : {"weight", "weight_scale_inv"}) {
          const size_t to = slot(l, fmt::format("experts.{}.{}.{}", e, proj, part));
          const size_t from = slot(l, fmt::format("experts.{}.{}.{}", donor, proj, part));
          if (to != from) std::memcpy(data(l, to), data(l, from), l.slots[to].bytes());
          if (std::string_view(part) == "weight_scale_inv") {
            auto* sc = reinterpret_cast<float*>(data(l, to));
            for (size_t q = 0; q < l.slots[to].bytes() / 4; ++q) sc[q] *= f;
          }
          changed.push_back(to);
        }
      }
    }
    if (uniform01(rng) < 0.3) {  // the router: two experts' rows swapped
      const size_t k = slot(l, "gate.weight");
      const size_t row = l.slots[k].bytes() / s.experts;
      const int a = uniform_int(rng, 0, s.experts - 1), b = uniform_int(rng, 0, s.experts - 1);
      std::vector<uint8_t> tmp(row);
      std::memcpy(tmp.data(), data(l, k) + a * row, row);
      std::memmove(data(l, k) + a * row, data(l, k) + b * row, row);
      std::memcpy(data(l, k) + b * row, tmp.data(), row);
      changed.push_back(k);
    }
    if (s.correction_bias && uniform01(rng) < 0.3) {
      const size_t k = slot(l, "gate.e_score_correction_bias");
      auto* b = reinterpret_cast<float*>(data(l, k));
      b[uniform_int(rng, 0, s.experts - 1)] += float(uniform01(rng) - 0.5) * 0.01f;
      changed.push_back(k);
    }
    if (s.has_shared() && uniform01(rng) < 0.2) {  // the shared expert's down scales
      const size_t k = slot(l, "shared_experts.down_proj.weight_scale_inv");
      auto* sc = reinterpret_cast<float*>(data(l, k));
      for (size_t q = 0; q < l.slots[k].bytes() / 4; ++q) sc[q] *= 0.75f;
      changed.push_back(k);
      changed.push_back(slot(l, "shared_experts.down_proj.weight"));  // (a scale comes with its weight)
    }
    std::sort(changed.begin(), changed.end());
    changed.erase(std::unique(changed.begin(), changed.end()), changed.end());
    return changed;
  }

  std::vector<size_t> all_slots(size_t i) const {
    std::vector<size_t> v(layers_[i].slots.size());
    std::iota(v.begin(), v.end(), size_t(0));
    return v;
  }
  bool is_scale(size_t i, size_t k) const { return layers_[i].slots[k].name.ends_with("_scale_inv"); }
  // The weights of the changed pairs only (a reload left with its scales missing).
  std::vector<size_t> weights_only(size_t i, const std::vector<size_t>& slots) const {
    std::vector<size_t> v;
    for (size_t k : slots)
      if (!is_scale(i, k) && layers_[i].slots[k].name.ends_with(".weight") &&
          layers_[i].slots[k].name.find("_proj.") != std::string::npos)
        v.push_back(k);
    return v;
  }

  void begin(ReloadMode m) {
    all_stores([m](WeightStore& st) { st.begin(m); });
  }
  void send(size_t i, size_t k) {
    const TensorSlot& t = layers_[i].slots[k];
    const void* p = data(layers_[i], k);
    all_stores([&](WeightStore& st) { st.update(t.name, t.dtype, t.shape, p, t.bytes()); });
  }
  // Slot k of layer i with one value made corrupt (a NaN, an infinity or a negative scale):
  // every store must refuse it.
  void send_corrupt_scale(size_t i, size_t k, Rng& rng) {
    const TensorSlot& t = layers_[i].slots[k];
    std::vector<float> bad(t.bytes() / 4);
    std::memcpy(bad.data(), data(layers_[i], k), t.bytes());
    static constexpr float kBad[] = {std::numeric_limits<float>::quiet_NaN(),
                                     std::numeric_limits<float>::infinity(), -1.0f};
    bad[size_t(uniform_int(rng, 0, int(bad.size()) - 1))] = kBad[uniform_int(rng, 0, 2)];
    all_stores([&](WeightStore& st) { st.update(t.name, t.dtype, t.shape, bad.data(), t.bytes()); });
  }
  void finish() {
    all_stores([](WeightStore& st) { st.finish(); });
  }
  // Every store agrees on the layer's readiness; returns it.
  bool ready(size_t i) const {
    const bool r = stores_.front()->ready(layers_[i].index);
    for (const WeightStore* st : stores_)
      if (st->ready(layers_[i].index) != r)
        throw std::runtime_error(
            fmt::format("soak: the stores disagree on whether layer {} is ready", layers_[i].index));
    return r;
  }
  size_t scale_slot_of_expert(size_t i, int e) const {
    return slot(layers_[i], fmt::format("experts.{}.down_proj.weight_scale_inv", e));
  }

 private:
  struct Layer {
    int index;
    HostMoeWeights w;
    std::vector<TensorSlot> slots;
    std::map<std::string, size_t> by_name;
  };
  size_t slot(const Layer& l, const std::string& rel) const {
    return l.by_name.at(desc_.layer_prefix(l.index) + rel);
  }
  uint8_t* data(Layer& l, size_t k) { return l.w.data() + l.slots[k].at(l.w.layout); }
  const uint8_t* data(const Layer& l, size_t k) const { return l.w.data() + l.slots[k].at(l.w.layout); }

  // f on every store; every store must answer alike (all return, or all throw the same
  // kind of error), which is then rethrown.
  template <typename F>
  void all_stores(F f) {
    std::vector<std::string> what(stores_.size());
    std::exception_ptr first;
    int threw = 0;
    for (size_t i = 0; i < stores_.size(); ++i) {
      try {
        f(*stores_[i]);
      } catch (const std::exception& e) {
        what[i] = typeid(e).name();
        if (!first) first = std::current_exception();
        ++threw;
      }
    }
    if (threw && (threw != int(stores_.size()) ||
                  std::adjacent_find(what.begin(), what.end(), std::not_equal_to<>()) != what.end()))
      throw std::runtime_error(
          "soak: the store under test and the reference's store answered one call differently");
    if (first) std::rethrow_exception(first);
  }

  ModelDesc desc_;
  std::vector<Layer> layers_;
  std::vector<WeightStore*> stores_;
};

// ---------------------------------------------------------------- the reference
// ref::route and ref::moe_layer (kernel-faithful) over the reference's host store, on a subset
// of the tokens (rows): buffers sized once for max_tokens.
class Reference {
 public:
  Reference(const WeightStore& st, int max_tokens) : st_(st) {
    const MoeShape& s = st.shape(st.layers().front());
    x_.resize(size_t(max_tokens) * s.hidden);
    y_.resize(x_.size());
    ids_.resize(size_t(max_tokens) * s.topk);
    w_.resize(ids_.size());
    logits_.resize(size_t(max_tokens) * s.experts);
    yb_.resize(x_.size());  // (resized, not reserved: its pages touched before RSS is measured)
  }
  // y (BF16 bytes, [rows][H]) of `rows` of x on the routing ids / weights ([T][K], already
  // in the reference's terms: -1 a padding slot).
  bf16_t* layer(int L, const bf16_t* x, const std::vector<int>& rows, const int32_t* ids, const float* w) {
    const MoeShape& s = st_.shape(L);
    gather(s, x, rows);
    for (size_t r = 0; r < rows.size(); ++r)
      for (int k = 0; k < s.topk; ++k) {
        ids_[r * s.topk + k] = ids[size_t(rows[r]) * s.topk + k];
        w_[r * s.topk + k] = w[size_t(rows[r]) * s.topk + k];
      }
    ref::moe_layer(s, st_.host_view(L), x_.data(), int(rows.size()), ids_.data(), w_.data(),
                   ref::Mode::kKernelFaithful, y_.data());
    yb_.resize(rows.size() * s.hidden);
    for (size_t i = 0; i < yb_.size(); ++i) yb_[i] = num::bf16_encode(y_[i]);
    return yb_.data();
  }
  // The reference's routing of `rows` ([rows][K]) and each row's selection scores
  // ([rows][E]: the score plus the correction bias, what top-k ranks).
  void route(int L, const bf16_t* x, const std::vector<int>& rows) {
    const MoeShape& s = st_.shape(L);
    gather(s, x, rows);
    const MoeWeightsView v = st_.host_view(L);
    ref::route(s, v, x_.data(), int(rows.size()), ids_.data(), w_.data(), logits_.data());
    for (size_t r = 0; r < rows.size(); ++r) {
      float* z = logits_.data() + r * s.experts;
      float m = -INFINITY, sum = 0;
      for (int e = 0; e < s.experts; ++e) m = std::max(m, z[e]);
      for (int e = 0; e < s.experts; ++e) {
        float sc = 0;
        switch (s.score) {
          case ScoreFunc::kSigmoid: sc = 1.0f / (1.0f + std::exp(-z[e])); break;
          case ScoreFunc::kSoftmax: sc = std::exp(z[e] - m), sum += sc; break;
          case ScoreFunc::kSqrtSoftplus: sc = std::sqrt(z[e] > 20 ? z[e] : std::log1p(std::exp(z[e]))); break;
        }
        z[e] = sc;
      }
      for (int e = 0; e < s.experts; ++e) {
        if (s.score == ScoreFunc::kSoftmax) z[e] /= sum;
        if (s.correction_bias && v.bias) z[e] += v.bias[e];
      }
    }
  }
  const int32_t* route_ids() const { return ids_.data(); }
  const float* route_weights() const { return w_.data(); }
  const float* selection() const { return logits_.data(); }

 private:
  void gather(const MoeShape& s, const bf16_t* x, const std::vector<int>& rows) {
    for (size_t r = 0; r < rows.size(); ++r)
      std::memcpy(x_.data() + r * s.hidden, x + size_t(rows[r]) * s.hidden, size_t(s.hidden) * 2);
  }
  const WeightStore& st_;
  std::vector<bf16_t> x_, yb_;
  std::vector<float> y_, w_, logits_;
  std::vector<int32_t> ids_;
};

// ---------------------------------------------------------------- memory
// Under AddressSanitizer freed memory waits in a quarantine: RSS grows by design, so the
// growth is reported but not held against the run.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kRssChecked = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kRssChecked = false;
#else
constexpr bool kRssChecked = true;
#endif
#else
constexpr bool kRssChecked = true;
#endif

size_t host_rss_bytes() {
  std::ifstream f("/proc/self/statm");
  size_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * size_t(sysconf(_SC_PAGESIZE));
}

struct DeviceMemory {
  bool known = false;
  size_t free = 0, total = 0;
};
DeviceMemory device_memory() {
  DeviceMemory m;
#if defined(MEGAMOE_HAVE_CUDA)
  m.known = cudaMemGetInfo(&m.free, &m.total) == cudaSuccess;
#endif
  return m;
}

// ---------------------------------------------------------------- the run
// The errors a step provokes, by class. Each is raised by a documented call: the CPU layer's
// forward (a host layer refuses at the call), the CUDA layer's check() (the device records),
// the store's update() / finish().
enum class ErrorClass {
  kOverMaxTokens,       // forward: T > max_tokens (invalid_argument)
  kBadIdsAtForward,     // CPU forward: an external id outside [0, E) (invalid_argument)
  kBadWeightAtForward,  // CPU forward: a NaN external routing weight (invalid_argument)
  kBadIdsAtCheck,       // CUDA check(): external ids outside [0, E) ("topk_ids: ...")
  kTokenCountAtCheck,   // CUDA check(): a device token count outside [0, hint]
  kReloadIncomplete,    // WeightStore::finish: a pair or a layer left incomplete (NotFoundError)
  kCorruptScale,        // WeightStore::update: a NaN / inf / negative block scale (FormatError)
  // WeightStore::finish of a session on one layer while another layer is left incomplete by
  // an earlier layerwise session: finish() lists every layer that is not complete (store.h).
  kOtherLayerIncomplete,
};
const char* error_name(ErrorClass c) {
  switch (c) {
    case ErrorClass::kOverMaxTokens: return "forward_over_max_tokens";
    case ErrorClass::kBadIdsAtForward: return "forward_ids_out_of_range";
    case ErrorClass::kBadWeightAtForward: return "forward_nonfinite_weight";
    case ErrorClass::kBadIdsAtCheck: return "check_ids_out_of_range";
    case ErrorClass::kTokenCountAtCheck: return "check_token_count";
    case ErrorClass::kReloadIncomplete: return "reload_incomplete";
    case ErrorClass::kCorruptScale: return "update_corrupt_scale";
    case ErrorClass::kOtherLayerIncomplete: return "reload_other_layer_incomplete";
  }
  return "?";
}

struct Stats {
  long steps = 0, forwards = 0, replays = 0, reloads = 0;
  long long tokens = 0;
  long long compared_rows = 0, compared_values = 0;
  long mismatches = 0;  // output rows whose bytes differ, routing that differs, stray writes
  long routing_checked = 0, routing_near_ties = 0;
  long nonfinite_rows_equal = 0, nonfinite_rows_differ = 0;
  std::map<std::string, long> kinds, reload_kinds;
  std::map<std::string, long> expected, raised;
  long unexpected_errors = 0, missing_errors = 0;
  std::vector<std::string> failures;  // the first few, described
};

class Soak {
 public:
  Soak(const SoakArgs& a, const MoeShape& s, bool cuda, uint64_t seed)
      : a_(a), s_(s), cuda_(cuda), seed_(seed), rng_(seed) {
    M_ = a.max_tokens > 0 ? a.max_tokens : (cuda ? 4096 : 16);
    // Every token compared where a forward of max_tokens costs the reference under ~2 GFLOP.
    check_tokens_ = a.check_tokens > 0 ? a.check_tokens : (s.flops_per_token() * M_ <= 2e9 ? M_ : 2);
    desc_ = model_desc(find_preset(a.preset));
    desc_.shape = s;
    const std::vector<int> layers = {desc_.moe_layers[0], desc_.moe_layers[1]};
    WeightStoreOptions so;
    so.layers = layers;
    ref_store_ = std::make_unique<WeightStore>(desc_, so);
    so.memory = cuda ? StoreMemory::kDevice : StoreMemory::kHost;
    store_ = std::make_unique<WeightStore>(desc_, so);
    feed_ = std::make_unique<WeightFeed>(desc_, layers, seed ^ 0x9E3779B97F4A7C15ull);
    feed_->add_store(store_.get());
    feed_->add_store(ref_store_.get());
    feed_->cold_load();
    reference_ = std::make_unique<Reference>(*ref_store_, M_);
    // x comes from windows of a pool of N(0, 1) tokens (fresh windows each step, no per-step
    // generation of T x H normals at real shapes).
    pool_ = make_random_tokens(std::max(size_t(1) << 22, size_t(s.hidden) * 64), seed + 3);
    x_.resize(size_t(M_) * s.hidden);
    // Every per-step buffer at its largest once.
    const size_t slots = size_t(M_) * s.topk;
    presize(routing_.ids, slots), presize(routing_.weights, slots);
    presize(ref_ids_, slots), presize(ref_w_, slots);
    presize(extreme_, size_t(M_)), presize(nonfinite_, size_t(M_)), presize(isolated_, size_t(M_));
    presize(rows_, size_t(M_));
    presize(pair_y_, size_t(M_) * s.hidden), presize(pair_ids_, slots), presize(pair_w_, slots);
    make_layers();
  }
  ~Soak() {
    layers_.clear();
#if defined(MEGAMOE_HAVE_CUDA)
    if (cuda_) {
      cudaFree(shared_ws_);
      for (cudaStream_t st : streams_) cudaStreamDestroy(st);
    }
#endif
  }

  int max_tokens() const { return M_; }
  int check_tokens() const { return check_tokens_; }

  nlohmann::ordered_json run() {
    const auto t0 = Clock::now();
    // Warm-up: every step kind once, in a fixed order (graphs captured, lazy modules and
    // arenas loaded), then the memory baseline.
    for (Kind k : all_kinds())
      if (k != Kind::kTwoStreams || cuda_) step(k);
    if (pending_) complete_reload();
    // ... and forwards at every power-of-two token count (each count range has its own tile
    // configuration, and with it kernels of its own) on both kinds of routing.
    for (int T = 1; T <= M_; T = T == M_ ? M_ + 1 : std::min(2 * T, M_)) {
      for (bool ext : {false, true}) {
        ++stats_.steps;
        step_kind_ = ext ? Kind::kExternal : Kind::kOwn;
        fill_x(T);
        Call c = eager_call(T);
        if (ext) {
          draw_routing(T, Dist::kUniform);
          c.routing = &routing_;
        }
        guarded([&] { forward_and_verify(0, c, std::nullopt); });
      }
    }
    const DeviceMemory dev0 = device_memory();
    const size_t rss0 = host_rss_bytes();
    auto last_print = Clock::now();
    while (true) {
      const double el = std::chrono::duration<double>(Clock::now() - t0).count();
      if (a_.steps > 0 ? stats_.steps >= a_.steps : el >= a_.seconds) break;
      if (stats_.unexpected_errors >= 50) {  // (a broken CUDA context does not come back)
        note("stopped: 50 unexpected errors");
        break;
      }
      step(draw_kind());
      if (std::chrono::duration<double>(Clock::now() - last_print).count() > 10) {
        last_print = Clock::now();
        fmt::print("soak: {:.0f} s, {} steps, {} forwards, {} replays, {} reloads, {} mismatches\n", el,
                   stats_.steps, stats_.forwards, stats_.replays, stats_.reloads, stats_.mismatches);
        std::fflush(stdout);
      }
    }
    if (pending_) complete_reload();
#if defined(MEGAMOE_HAVE_CUDA)
    if (cuda_) SOAK_CUDA(cudaDeviceSynchronize());
#endif
    const DeviceMemory dev1 = device_memory();
    const size_t rss1 = host_rss_bytes();
    const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    return report(elapsed, dev0, dev1, rss0, rss1);
  }

 private:
  enum class Kind {
    kOwn,
    kExternal,
    kReplayOwn,
    kReplayExternal,
    kInvalidRouting,
    kBadCount,
    kOverMax,
    kExtreme,
    kSharedPair,
    kTwoStreams,
    kReloadDirect,
    kReloadLayerwise,
    kReloadUnfinished,
    kCorruptUpdate,
  };
  static const char* name_of(Kind k) {
    static const char* kNames[] = {"eager_own_routing",     "eager_external_routing",
                                   "replay_own_routing",    "replay_external_routing",
                                   "invalid_routing",       "bad_device_count",
                                   "over_max_tokens",       "extreme_inputs",
                                   "shared_workspace_pair", "two_streams",
                                   "reload_direct",         "reload_layerwise",
                                   "reload_unfinished",     "update_corrupt_scale"};
    return kNames[int(k)];
  }
  static std::vector<Kind> all_kinds() {
    std::vector<Kind> v;
    for (int k = 0; k <= int(Kind::kCorruptUpdate); ++k) v.push_back(Kind(k));
    return v;
  }
  Kind draw_kind() {
    // Weights per kind (the CPU backend has no graphs, device counts or streams).
    static constexpr int kWeights[] = {24, 24, 14, 10, 5, 2, 1, 5, 6, 5, 3, 1, 1, 1};
    std::vector<int> w(std::begin(kWeights), std::end(kWeights));
    if (!cuda_)
      for (Kind k : {Kind::kReplayOwn, Kind::kReplayExternal, Kind::kBadCount, Kind::kTwoStreams})
        w[int(k)] = 0;
    return Kind(std::discrete_distribution<int>(w.begin(), w.end())(rng_));
  }

  void make_layers() {
    const int L0 = feed_->layer_index(0), L1 = feed_->layer_index(1);
    if (!cuda_) {
      layer_of_.clear();
      layers_.push_back(std::make_unique<CpuLayer>(*store_, L0, M_));
      layers_.push_back(std::make_unique<CpuLayer>(*store_, L1, M_));
      layers_.push_back(std::make_unique<CpuLayer>(*store_, L1, M_));
      layer_of_ = {0, 1, 1};
      return;
    }
#if defined(MEGAMOE_HAVE_CUDA)
    // Layers 0 and 1 share one workspace on one stream (an engine's layers, one after the
    // other); layer 2 has its own workspace and runs on a second stream beside layer 0.
    for (int i = 0; i < 2; ++i) {
      cudaStream_t st;
      SOAK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      streams_.push_back(st);
    }
    api::MoeLayerOptions o;
    o.max_tokens = M_;
    o.workspace_bytes = api::CudaMoeLayer::workspace_bytes_for(s_, M_);
    SOAK_CUDA(cudaMalloc(&shared_ws_, o.workspace_bytes));
    o.workspace = shared_ws_;
    layers_.push_back(std::make_unique<CudaLayer>(*store_, L0, o, streams_[0]));
    layers_.push_back(std::make_unique<CudaLayer>(*store_, L1, o, streams_[0]));
    api::MoeLayerOptions own;
    own.max_tokens = M_;
    layers_.push_back(std::make_unique<CudaLayer>(*store_, L1, own, streams_[1]));
    layer_of_ = {0, 1, 1};
#endif
  }

  // ---- inputs
  // The tokens of a batch in which every expert is routed to exactly once (K divides E;
  // else the last token's slots wrap around), at most max_tokens.
  int every_expert_once_tokens() const { return std::min(M_, (s_.experts + s_.topk - 1) / s_.topk); }
  int draw_tokens() {
    const int r = uniform_int(rng_, 0, 9);
    if (r == 0) {
      const int special[] = {0, 1, M_};
      return special[uniform_int(rng_, 0, 2)];
    }
    if (r <= 3) return uniform_int(rng_, 1, std::min(M_, 16));
    return uniform_int(rng_, 0, M_);
  }
  // x [T][H] from random windows of the pool; flags per token reset.
  void fill_x(int T) {
    const size_t H = s_.hidden;
    std::uniform_int_distribution<size_t> at(0, pool_.size() - H);
    for (int t = 0; t < T; ++t) std::memcpy(x_.data() + t * H, pool_.data() + at(rng_), H * 2);
    extreme_.assign(size_t(T), 0);
    nonfinite_.assign(size_t(T), 0);
  }
  // A few tokens get extreme values: the largest finite BF16, subnormals, infinities, NaN.
  void add_extremes(int T) {
    if (T == 0) return;
    static constexpr bf16_t kFinite[] = {0x7F7F, 0xFF7F, 0x0001, 0x8001, 0x007F};
    static constexpr bf16_t kNonFinite[] = {0x7F80, 0xFF80, 0x7FC0};
    const int n = uniform_int(rng_, 1, std::min(T, 4));
    for (int j = 0; j < n; ++j) {
      const int t = uniform_int(rng_, 0, T - 1);
      const bool nonfinite = uniform01(rng_) < 0.5;
      const int cols = uniform_int(rng_, 1, 3);
      for (int c = 0; c < cols; ++c) {
        const bf16_t v = nonfinite ? kNonFinite[uniform_int(rng_, 0, 2)] : kFinite[uniform_int(rng_, 0, 4)];
        x_[size_t(t) * s_.hidden + uniform_int(rng_, 0, s_.hidden - 1)] = v;
      }
      if (uniform01(rng_) < 0.3) {  // a whole token of subnormals
        for (int h = 0; h < s_.hidden; ++h)
          x_[size_t(t) * s_.hidden + h] = bf16_t(uniform_int(rng_, 1, 0x7F));
      }
      extreme_[t] = 1;
      nonfinite_[t] |= nonfinite;
    }
  }

  // External routing of T tokens: K distinct experts a token, weights in [0.05, 1.5).
  enum class Dist { kUniform, kZipf, kOneExpert, kEveryExpertOnce };
  void draw_routing(int T, Dist d) {
    const int K = s_.topk, E = s_.experts;
    routing_.ids.assign(size_t(T) * K, 0);
    routing_.weights.assign(size_t(T) * K, 0.0f);
    std::uniform_real_distribution<float> wd(0.05f, 1.5f);
    std::vector<int> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng_);
    std::vector<double> pop(E, 1.0);
    if (d == Dist::kZipf) {
      const double z = 0.5 + 1.5 * uniform01(rng_);
      for (int r = 0; r < E; ++r) pop[perm[r]] = 1.0 / std::pow(double(r + 1), z);
    }
    std::discrete_distribution<int> pick(pop.begin(), pop.end());
    const int hot = perm[0];
    for (int t = 0; t < T; ++t) {
      int64_t* id = routing_.ids.data() + size_t(t) * K;
      if (d == Dist::kEveryExpertOnce) {
        for (int k = 0; k < K; ++k) id[k] = perm[(size_t(t) * K + k) % E];
      } else {
        int n = 0;
        if (d == Dist::kOneExpert) id[n++] = hot;
        while (n < K) {
          const int e = d == Dist::kZipf ? pick(rng_) : uniform_int(rng_, 0, E - 1);
          if (std::find(id, id + n, e) == id + n) id[n++] = e;
        }
        if (d == Dist::kOneExpert) std::swap(id[0], id[uniform_int(rng_, 0, K - 1)]);
      }
      for (int k = 0; k < K; ++k) routing_.weights[size_t(t) * K + k] = wd(rng_);
    }
  }

  // ---- steps
  void step(Kind k) {
    ++stats_.steps;
    ++stats_.kinds[name_of(k)];
    step_kind_ = k;
    guarded([&] { run_step(k); });
  }
  // f, with any error it throws counted as unexpected (what a step expects, it catches).
  template <typename F>
  void guarded(F f) {
    try {
      f();
    } catch (const std::exception& e) {
      ++stats_.unexpected_errors;
      note(fmt::format("unexpected error: {}", e.what()));
    }
  }

  // A layer to run (0, 1: sharing a workspace; 2: its own), among those whose store layer is ready.
  int draw_layer(bool allow_side = true) {
    std::vector<int> ok;
    for (int i = 0; i < (allow_side ? 3 : 2); ++i)
      if (!pending_ || pending_->layer != layer_of_[i]) ok.push_back(i);
    return ok.empty() ? -1 : ok[uniform_int(rng_, 0, int(ok.size()) - 1)];
  }
  bool ready_for(int li) const { return !pending_ || pending_->layer != layer_of_[li]; }

  void run_step(Kind k) {
    if (pending_ && uniform01(rng_) < 0.3) complete_reload();
    switch (k) {
      case Kind::kOwn:
      case Kind::kExternal:
      case Kind::kExtreme: {
        const int li = draw_layer();
        if (li < 0) return;
        const bool ext = k == Kind::kExternal || (k == Kind::kExtreme && uniform01(rng_) < 0.5);
        const Dist d = Dist(uniform_int(rng_, 0, 3));
        const int T = ext && d == Dist::kEveryExpertOnce ? every_expert_once_tokens() : draw_tokens();
        fill_x(T);
        if (k == Kind::kExtreme) add_extremes(T);
        Call c = eager_call(T);
        if (ext) {
          draw_routing(T, d);
          c.routing = &routing_;
          c.id_bytes = uniform01(rng_) < 0.5 ? 4 : 8;
        }
        forward_and_verify(li, c, std::nullopt);
        return;
      }
      case Kind::kReplayOwn:
      case Kind::kReplayExternal: {
        if (!cuda_ || !ready_for(0)) return;
        const Dist d = Dist(uniform_int(rng_, 0, 3));
        const bool once = k == Kind::kReplayExternal && d == Dist::kEveryExpertOnce;
        const int T = once ? every_expert_once_tokens() : draw_tokens();
        fill_x(T);
        Call c;
        c.x = x_.data(), c.tokens = T, c.graph = true, c.count = T;
        if (k == Kind::kReplayExternal) {
          draw_routing(T, d);
          c.routing = &routing_, c.id_bytes = 4;
        }
        ++stats_.replays;
        forward_and_verify(0, c, std::nullopt);
        return;
      }
      case Kind::kInvalidRouting: {
        const int li = draw_layer();
        if (li < 0) return;
        const int T = uniform_int(rng_, 1, M_);
        fill_x(T);
        draw_routing(T, Dist::kUniform);
        Call c = eager_call(T);
        c.routing = &routing_;
        c.id_bytes = uniform01(rng_) < 0.5 ? 4 : 8;
        const int what = uniform_int(rng_, 0, 2);  // bad ids, NaN weights, negative weights
        const int n = uniform_int(rng_, 1, std::min(T * s_.topk, 3));
        for (int j = 0; j < n; ++j) {
          const size_t i = size_t(uniform_int(rng_, 0, T * s_.topk - 1));
          if (what == 0) {
            const int64_t big =
                c.id_bytes == 8 ? (int64_t(1) << 40) : int64_t(std::numeric_limits<int32_t>::max());
            const int64_t bad[] = {s_.experts, s_.experts + 7, -1, -1000, big};
            routing_.ids[i] = bad[uniform_int(rng_, 0, 4)];
          } else if (what == 1) {
            routing_.weights[i] = std::numeric_limits<float>::quiet_NaN();
          } else {
            routing_.weights[i] = -routing_.weights[i];
          }
        }
        std::optional<ErrorClass> expect;
        if (what == 0) expect = cuda_ ? ErrorClass::kBadIdsAtCheck : ErrorClass::kBadIdsAtForward;
        if (what == 1 && !cuda_) expect = ErrorClass::kBadWeightAtForward;
        forward_and_verify(li, c, expect);
        return;
      }
      case Kind::kBadCount: {
        if (!cuda_) return;
        const int li = draw_layer();
        if (li < 0) return;
        const int T = uniform_int(rng_, 1, M_);
        fill_x(T);
        Call c = eager_call(T);
        c.device_count = true;
        c.count = uniform01(rng_) < 0.5 ? -uniform_int(rng_, 1, 5) : T + uniform_int(rng_, 1, 5);
        forward_and_verify(li, c, ErrorClass::kTokenCountAtCheck);
        return;
      }
      case Kind::kOverMax: {
        const int li = draw_layer();
        if (li < 0) return;
        Call c = eager_call(M_ + uniform_int(rng_, 1, 8));
        c.x = x_.data();
        forward_and_verify(li, c, ErrorClass::kOverMaxTokens);
        return;
      }
      case Kind::kSharedPair:
      case Kind::kTwoStreams: {
        // Two forwards enqueued before either is waited for: layers 0 and 1 one after the
        // other on the shared workspace, or layers 0 and 2 on two streams at once.
        const int other = k == Kind::kSharedPair ? 1 : 2;
        if (!ready_for(0) || !ready_for(other)) return;
        const int T0 = draw_tokens(), T1 = draw_tokens();
        fill_x(T0 + T1 > M_ ? M_ : T0 + T1);
        const int t0 = std::min(T0, M_), t1 = std::min(T1, M_ - t0);
        Call c0 = eager_call(t0), c1 = eager_call(t1);
        c1.x = x_.data() + size_t(t0) * s_.hidden;
        layers_[0]->start(c0);
        layers_[other]->start(c1);
        const Output o0 = layers_[0]->finish();
        // (copies in buffers sized once: a fresh max_tokens x H vector a step can stay in the heap)
        pair_y_.assign(o0.y, o0.y + size_t(o0.rows) * s_.hidden);
        pair_ids_.assign(o0.ids, o0.ids ? o0.ids + size_t(t0) * s_.topk : o0.ids);
        pair_w_.assign(o0.weights, o0.weights ? o0.weights + size_t(t0) * s_.topk : o0.weights);
        const Output& o1 = layers_[other]->finish();
        stats_.forwards += 2;
        stats_.tokens += t0 + t1;
        verify(0, c0, Output{pair_y_.data(), o0.rows, pair_ids_.data(), pair_w_.data()}, t0, 0);
        verify(other, c1, o1, t1, t0);
        check_clean(0);
        check_clean(other);
        return;
      }
      case Kind::kReloadDirect:
      case Kind::kReloadLayerwise: {
        const size_t i = size_t(uniform_int(rng_, 0, 1));
        if (pending_ && pending_->layer == int(i)) return;
        const std::vector<size_t> changed = feed_->perturb(i, rng_, uniform_int(rng_, 1, 3));
        const bool direct = k == Kind::kReloadDirect;
        std::vector<size_t> send = direct ? changed : feed_->all_slots(i);
        std::shuffle(send.begin(), send.end(), rng_);  // weights and scales in separate calls, any order
        feed_->begin(direct ? ReloadMode::kDirect : ReloadMode::kLayerwise);
        for (size_t s : send) feed_->send(i, s);
        finish_session(i);
        count_reload(direct ? "direct" : "layerwise");
        if (!feed_->ready(i))
          fail(fmt::format("layer {} not ready after a complete reload", feed_->layer_index(i)));
        return;
      }
      case Kind::kReloadUnfinished: {
        if (pending_) return;
        const size_t i = size_t(uniform_int(rng_, 0, 1));
        const std::vector<size_t> changed = feed_->perturb(i, rng_, 1);
        const bool direct = uniform01(rng_) < 0.5;
        std::vector<size_t> send;
        if (direct) {
          send = feed_->weights_only(i, changed);  // the weights, their scales never sent
        } else {
          send = feed_->all_slots(i);
          std::shuffle(send.begin(), send.end(), rng_);
          send.resize(size_t(uniform_int(rng_, 1, int(send.size()) - 1)));  // a layer never completed
        }
        feed_->begin(direct ? ReloadMode::kDirect : ReloadMode::kLayerwise);
        for (size_t s : send) feed_->send(i, s);
        expect_error(ErrorClass::kReloadIncomplete, [&] { feed_->finish(); });
        count_reload(direct ? "direct_unfinished" : "layerwise_unfinished");
        if (feed_->ready(i))
          fail(fmt::format("layer {} ready after an unfinished reload", feed_->layer_index(i)));
        pending_ = Pending{int(i), changed, !direct};
        return;
      }
      case Kind::kCorruptUpdate: {
        const size_t i = size_t(uniform_int(rng_, 0, 1));
        if (pending_ && pending_->layer == int(i)) return;
        feed_->begin(ReloadMode::kDirect);
        expect_error(ErrorClass::kCorruptScale, [&] {
          feed_->send_corrupt_scale(i, feed_->scale_slot_of_expert(i, uniform_int(rng_, 0, s_.experts - 1)),
                                    rng_);
        });
        finish_session(i);  // (nothing landed: nothing of layer i is incomplete)
        count_reload("refused");
        if (!feed_->ready(i))
          fail(fmt::format("layer {} not ready after a refused update", feed_->layer_index(i)));
        return;
      }
    }
  }

  Call eager_call(int T) {
    Call c;
    c.x = x_.data(), c.tokens = T, c.count = T;
    c.device_count = cuda_ && uniform01(rng_) < 0.5;
    return c;
  }

  void count_reload(const char* kind) {
    ++stats_.reloads;
    ++stats_.reload_kinds[kind];
  }

  // The pending layer brought back: both halves of its pairs (direct) or the whole layer.
  void complete_reload() {
    const size_t i = size_t(pending_->layer);
    const bool direct = uniform01(rng_) < 0.5;
    std::vector<size_t> send = direct && !pending_->whole ? pending_->changed : feed_->all_slots(i);
    std::shuffle(send.begin(), send.end(), rng_);
    feed_->begin(direct ? ReloadMode::kDirect : ReloadMode::kLayerwise);
    for (size_t s : send) feed_->send(i, s);
    feed_->finish();
    count_reload(direct ? "direct_completion" : "layerwise_completion");
    pending_.reset();
    if (!feed_->ready(i)) fail(fmt::format("layer {} not ready after its completion", feed_->layer_index(i)));
  }

  // Closes a session that brought layer i whole pairs (or all of it).
  void finish_session(size_t i) {
    if (pending_ && pending_->whole && pending_->layer != int(i))
      expect_error(ErrorClass::kOtherLayerIncomplete, [&] { feed_->finish(); });
    else
      feed_->finish();
  }

  template <typename F>
  void expect_error(ErrorClass c, F f) {
    ++stats_.expected[error_name(c)];
    try {
      f();
    } catch (const std::exception& e) {
      if (matches(c, e)) {
        ++stats_.raised[error_name(c)];
        return;
      }
      throw;
    }
    ++stats_.missing_errors;
    note(fmt::format("expected {} was not raised", error_name(c)));
  }
  static bool matches(ErrorClass c, const std::exception& e) {
    const std::string m = e.what();
    switch (c) {
      case ErrorClass::kOverMaxTokens:
      case ErrorClass::kBadIdsAtForward:
      case ErrorClass::kBadWeightAtForward: return dynamic_cast<const std::invalid_argument*>(&e) != nullptr;
      case ErrorClass::kBadIdsAtCheck: return m.find("topk_ids") != std::string::npos;
      case ErrorClass::kTokenCountAtCheck: return m.find("token count") != std::string::npos;
      case ErrorClass::kReloadIncomplete: return dynamic_cast<const io::NotFoundError*>(&e) != nullptr;
      case ErrorClass::kCorruptScale: return dynamic_cast<const io::FormatError*>(&e) != nullptr;
      case ErrorClass::kOtherLayerIncomplete: return dynamic_cast<const io::NotFoundError*>(&e) != nullptr;
    }
    return false;
  }

  // check() after a forward that should leave nothing recorded.
  void check_clean(int li) { layers_[li]->check(); }

  void forward_and_verify(int li, const Call& c, std::optional<ErrorClass> expect) {
    const bool at_forward =
        expect && (*expect == ErrorClass::kOverMaxTokens || *expect == ErrorClass::kBadIdsAtForward ||
                   *expect == ErrorClass::kBadWeightAtForward);
    if (at_forward) {
      expect_error(*expect, [&] {
        layers_[li]->start(c);
        layers_[li]->finish();
      });
      check_clean(li);
      return;
    }
    layers_[li]->start(c);
    const Output& o = layers_[li]->finish();
    ++stats_.forwards;
    stats_.tokens += c.tokens;
    verify(li, c, o, c.tokens, 0);
    if (expect)
      expect_error(*expect, [&] { layers_[li]->check(); });
    else
      check_clean(li);
  }

  // Compares a forward's output with the reference. `first` is the call's first token in
  // the step's x / flags (a second forward of one step reads a later part of them).
  void verify(int li, const Call& c, const Output& o, int T, int first) {
    const int H = s_.hidden, K = s_.topk, E = s_.experts;
    const int L = feed_->layer_index(size_t(layer_of_[li]));
    // Rows the forward computed: T, none for a negative device count (a count above the
    // hint is clamped to it).
    const int computed = c.device_count && c.count < 0 ? 0 : T;
    // Rows past the computed ones must hold the poison the output was filled with.
    for (size_t i = size_t(computed) * H; i < size_t(o.rows) * H; ++i)
      if (o.y[i] != kPoison) {
        fail(fmt::format("layer {} wrote row {} past the token count {} (hint {})", li, i / H, computed,
                         o.rows));
        break;
      }
    if (computed == 0) return;
    // The tokens compared: all, or a sample (always the first and the last).
    rows_.clear();
    if (computed <= check_tokens_) {
      rows_.resize(size_t(computed));
      std::iota(rows_.begin(), rows_.end(), 0);
    } else {
      std::set<int> pick = {0, computed - 1};
      while (int(pick.size()) < check_tokens_) pick.insert(uniform_int(rng_, 0, computed - 1));
      rows_.assign(pick.begin(), pick.end());
    }
    // The routing the forward used, in the reference's terms: the caller's with an id outside
    // [0, E) as expert 0 with weight 0 (what the CUDA layer computes for it); the layer's own
    // as it came back.
    ref_ids_.assign(size_t(computed) * K, -1);
    ref_w_.assign(size_t(computed) * K, 0.0f);
    std::vector<uint8_t>& isolated = isolated_;  // rows the contract leaves to their token
    isolated.assign(size_t(computed), 0);
    for (int t = 0; t < computed; ++t) {
      isolated[t] = nonfinite_[first + t];
      for (int k = 0; k < K; ++k) {
        const size_t i = size_t(t) * K + k;
        int64_t id;
        float w;
        if (c.routing) {
          id = c.id_bytes == 4 ? int64_t(int32_t(c.routing->ids[i])) : c.routing->ids[i];
          w = c.routing->weights[i];
          if (id < 0 || id >= E) id = 0, w = 0.0f;
        } else {
          id = o.ids[i];
          w = o.weights[i];
          if (id < 0 || id >= E) {
            if (!isolated[t])
              fail(fmt::format("layer {}: its own routing gave token {} slot {} the id {}", li, t, k, id));
            id = -1, w = 0.0f;
          }
        }
        if (!std::isfinite(w)) isolated[t] = 1;
        ref_ids_[i] = int32_t(id), ref_w_[i] = w;
      }
    }
    bf16_t* want = reference_->layer(L, x_.data() + size_t(first) * H, rows_, ref_ids_.data(), ref_w_.data());
    if (a_.inject_mismatch > 0 && stats_.steps >= a_.inject_mismatch && !injected_ && !isolated[rows_[0]]) {
      want[0] ^= 1;  // (the check of the checker: this step must fail)
      injected_ = true;
    }
    for (size_t r = 0; r < rows_.size(); ++r) {
      const int t = rows_[r];
      const bf16_t* got = o.y + size_t(t) * H;
      const bf16_t* exp = want + r * H;
      int differ = 0, first_col = -1;
      for (int h = 0; h < H; ++h) {
        const float a = num::bf16_decode(got[h]), b = num::bf16_decode(exp[h]);
        const bool same =
            got[h] == exp[h] || (std::isnan(a) && std::isnan(b));  // (NaN payloads: no contract)
        if (!same && differ++ == 0) first_col = h;
      }
      ++stats_.compared_rows;
      stats_.compared_values += H;
      if (isolated[t]) {
        ++(differ ? stats_.nonfinite_rows_differ : stats_.nonfinite_rows_equal);
        continue;
      }
      if (differ)
        fail(
            fmt::format("layer {} (store layer {}), {} tokens, token {}{}: {} of {} outputs differ from the "
                        "reference (first: column {}, {:#06x} vs {:#06x})",
                        li, L, T, t, extreme_[first + t] ? " (extreme values)" : "", differ, H, first_col,
                        got[first_col], exp[first_col]));
    }
    if (!c.routing) verify_routing(li, L, o, first);
  }

  // The layer's own routing against ref::route (soak_routing.h): the same experts, except where
  // the reference's selection scores tie to within the last bits (the kernel rounds its logits
  // differently, docs/numerics.md §6), and where they agree weights within 1e-5.
  void verify_routing(int li, int L, const Output& o, int first) {
    const int K = s_.topk, E = s_.experts;
    std::vector<int> rows;
    for (int t : rows_)
      if (!extreme_[first + t]) rows.push_back(t);
    if (rows.empty()) return;
    reference_->route(L, x_.data() + size_t(first) * s_.hidden, rows);
    for (size_t r = 0; r < rows.size(); ++r) {
      ++stats_.routing_checked;
      const int t = rows[r];
      const int32_t* got = o.ids + size_t(t) * K;
      const float* gw = o.weights + size_t(t) * K;
      const int32_t* want = reference_->route_ids() + r * K;
      const float* ww = reference_->route_weights() + r * K;
      const float* c = reference_->selection() + r * E;
      const soak::RoutingVerdict v = soak::judge_routing(got, gw, want, ww, c, K, E);
      if (v == soak::RoutingVerdict::kWrong)
        fail(fmt::format(
            "layer {}: token {}'s routing differs from the reference beyond ties: ids [{}] vs [{}]", li, t,
            fmt::join(got, got + K, " "), fmt::join(want, want + K, " ")));
      else if (v == soak::RoutingVerdict::kTie)
        ++stats_.routing_near_ties;
    }
  }

  // A failed comparison (output bytes, routing, stray writes, a store's state).
  void fail(const std::string& what) {
    ++stats_.mismatches;
    note(what);
  }
  // Recorded and printed (the first few), counted by the caller.
  void note(const std::string& what) {
    const std::string line = fmt::format("step {} ({}): {}", stats_.steps, name_of(step_kind_), what);
    if (stats_.failures.size() < 20) {
      stats_.failures.push_back(line);
      fmt::print(stderr, "soak: FAIL {}\n", line);
    }
  }

  nlohmann::ordered_json report(double elapsed, const DeviceMemory& d0, const DeviceMemory& d1, size_t rss0,
                                size_t rss1) {
    bool errors_ok = true;
    nlohmann::ordered_json errors = nlohmann::ordered_json::object();
    for (const auto& [k, n] : stats_.expected) {
      const long r = stats_.raised.count(k) ? stats_.raised.at(k) : 0;
      errors[k] = {{"expected", n}, {"raised", r}};
      errors_ok = errors_ok && r == n;
    }
    const long long dev_growth = d0.known && d1.known ? (long long)d0.free - (long long)d1.free : 0;
    const long long rss_growth = (long long)rss1 - (long long)rss0;
    const bool ok = stats_.mismatches == 0 && stats_.unexpected_errors == 0 && stats_.missing_errors == 0 &&
                    errors_ok && dev_growth <= 0 && (!kRssChecked || rss_growth < (1 << 20));
    nlohmann::ordered_json j;
    j["ok"] = ok;
    j["seed"] = seed_;
    j["preset"] = a_.preset;
    j["shape"] = {{"hidden", s_.hidden},
                  {"inter", s_.inter},
                  {"experts", s_.experts},
                  {"topk", s_.topk},
                  {"shared_experts", s_.shared_experts},
                  {"describe", s_.describe()}};
    j["backend"] = cuda_ ? "cuda" : "cpu";
    j["device"] = device_name();
    j["commit"] = MEGAMOE_GIT_COMMIT;
    j["command"] = a_.command;
    j["max_tokens"] = M_;
    j["check_tokens"] = check_tokens_;
    j["seconds"] = elapsed;
    j["steps"] = stats_.steps;
    j["forwards"] = stats_.forwards;
    j["tokens"] = stats_.tokens;
    j["replays"] = stats_.replays;
    j["reloads"] = stats_.reloads;
    j["reload_kinds"] = stats_.reload_kinds;
    j["step_kinds"] = stats_.kinds;
    j["compared_rows"] = stats_.compared_rows;
    j["compared_values"] = stats_.compared_values;
    j["mismatches"] = stats_.mismatches;
    j["routing_checked"] = stats_.routing_checked;
    j["routing_near_ties"] = stats_.routing_near_ties;
    j["nonfinite_rows"] = {{"equal_to_reference", stats_.nonfinite_rows_equal},
                           {"differ_from_reference", stats_.nonfinite_rows_differ}};
    j["errors"] = errors;
    j["unexpected_errors"] = stats_.unexpected_errors;
    j["missing_errors"] = stats_.missing_errors;
    j["device_memory"] = d0.known ? nlohmann::ordered_json{{"free_after_warmup", d0.free},
                                                           {"free_at_end", d1.free},
                                                           {"total", d0.total},
                                                           {"growth_bytes", dev_growth}}
                                  : nlohmann::ordered_json(nullptr);
    j["host_rss"] = {
        {"after_warmup", rss0}, {"at_end", rss1}, {"growth_bytes", rss_growth}, {"checked", kRssChecked}};
    j["failures"] = stats_.failures;
    return j;
  }

  std::string device_name() const {
#if defined(MEGAMOE_HAVE_CUDA)
    if (cuda_) {
      int d = 0;
      cudaDeviceProp p{};
      if (cudaGetDevice(&d) == cudaSuccess && cudaGetDeviceProperties(&p, d) == cudaSuccess) return p.name;
    }
#endif
    return "cpu";
  }

  struct Pending {
    int layer;
    std::vector<size_t> changed;
    bool whole = false;  // a layerwise reload was left incomplete: only the whole layer completes it
  };

  const SoakArgs& a_;
  MoeShape s_;
  bool cuda_;
  uint64_t seed_;
  Rng rng_;
  int M_ = 0, check_tokens_ = 0;
  ModelDesc desc_;
  std::unique_ptr<WeightStore> store_, ref_store_;
  std::unique_ptr<WeightFeed> feed_;
  std::unique_ptr<Reference> reference_;
  std::vector<std::unique_ptr<LayerUnderTest>> layers_;
  std::vector<int> layer_of_;  // layer object -> the feed's layer (0, 1)
  std::optional<Pending> pending_;
  std::vector<bf16_t> pool_, x_;
  std::vector<uint8_t> extreme_, nonfinite_, isolated_;
  HostRouting routing_;
  std::vector<int> rows_;
  std::vector<int32_t> ref_ids_;
  std::vector<float> ref_w_;
  std::vector<bf16_t> pair_y_;  // the first forward of a pair step, copied
  std::vector<int32_t> pair_ids_;
  std::vector<float> pair_w_;
  Stats stats_;
  Kind step_kind_ = Kind::kOwn;
  bool injected_ = false;
#if defined(MEGAMOE_HAVE_CUDA)
  void* shared_ws_ = nullptr;
  std::vector<cudaStream_t> streams_;
#endif
};

MoeShape soak_shape(const SoakArgs& a) {
  return with_shape_overrides(find_preset(a.preset).shape, a.hidden, a.inter, a.experts, a.topk);
}

int run_soak(const SoakArgs& a) {
  if (!(a.seconds > 0) && a.steps <= 0)
    throw std::invalid_argument("--seconds must be > 0 (or give --steps)");
  if (!a.json.empty()) check_output_file("--json", a.json);
  const api::Backend b = api::parse_backend(a.backend);
  if (b == api::Backend::kAuto)
    throw std::invalid_argument("--backend: cpu or cuda (the soak names its backend)");
  const bool cuda = b == api::Backend::kCuda;
  // Every kernel loaded when the CUDA context is made, not at its first launch: a kernel the
  // warm-up did not reach would otherwise take device memory in the middle of the run.
  if (cuda) setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  api::resolve(b);  // (cuda without a usable device: the error says what is missing)
  const MoeShape s = soak_shape(a);
  if (model_desc(find_preset(a.preset)).moe_layers.size() < 2)
    throw std::invalid_argument(fmt::format("--preset {}: the soak needs two MoE layers", a.preset));
  const uint64_t seed =
      a.seed_given ? a.seed : std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32);
  // The command that replays this run (the same seed draws the same steps, in the same order).
  SoakArgs run = a;
  run.command = fmt::format("megamoe soak --backend {} --preset {}", a.backend, a.preset);
  for (const auto& [flag, v] : {std::pair{"--hidden", a.hidden},
                                {"--inter", a.inter},
                                {"--experts", a.experts},
                                {"--topk", a.topk},
                                {"--max-tokens", a.max_tokens},
                                {"--check-tokens", a.check_tokens}})
    if (v) run.command += fmt::format(" {} {}", flag, v);
  run.command += a.steps > 0 ? fmt::format(" --steps {}", a.steps) : fmt::format(" --seconds {}", a.seconds);
  run.command += fmt::format(" --seed {}", seed);
  fmt::print("soak: seed {}{} (replay: {})\n", seed, a.seed_given ? "" : ", drawn at random", run.command);
  std::fflush(stdout);
  Soak soak(run, s, cuda, seed);
  fmt::print("soak: {} on {}, {}, max_tokens {}, {} tokens compared a forward, {}\n", a.preset, a.backend,
             s.describe(), soak.max_tokens(), soak.check_tokens(),
             a.steps > 0 ? fmt::format("{} steps", a.steps) : fmt::format("{} s", a.seconds));
  std::fflush(stdout);
  const nlohmann::ordered_json j = soak.run();
  fmt::print(
      "soak: {} steps, {} forwards ({} tokens), {} replays, {} reloads in {:.1f} s; {} mismatches, "
      "{} unexpected errors, {} expected errors missing\n",
      j["steps"].get<long>(), j["forwards"].get<long>(), j["tokens"].get<long long>(),
      j["replays"].get<long>(), j["reloads"].get<long>(), j["seconds"].get<double>(),
      j["mismatches"].get<long>(), j["unexpected_errors"].get<long>(), j["missing_errors"].get<long>());
  for (const auto& [k, v] : j["errors"].items())
    fmt::print("soak: error {}: expected {}, raised {}\n", k, v["expected"].get<long>(),
               v["raised"].get<long>());
  if (!j["device_memory"].is_null())
    fmt::print("soak: device memory growth after warm-up: {} bytes\n",
               j["device_memory"]["growth_bytes"].get<long long>());
  fmt::print("soak: host RSS growth after warm-up: {} bytes\n",
             j["host_rss"]["growth_bytes"].get<long long>());
  if (!a.json.empty()) {
    std::ofstream f(a.json);
    if (!(f << j.dump(2) << "\n")) throw std::runtime_error(fmt::format("--json: cannot write {}", a.json));
    fmt::print("wrote {}\n", a.json);
  }
  const bool ok = j["ok"].get<bool>();
  fmt::print("soak: {} (seed {})\n", ok ? "OK" : "FAILED", seed);
  return ok ? 0 : 1;
}

}  // namespace

std::vector<Command> add_soak_commands(CLI::App& app) {
  auto a = std::make_shared<SoakArgs>();
  auto* c = app.add_subcommand(
      "soak",
      "A randomized differential run: forwards of changing token counts, graphs, skewed and invalid "
      "routing, reloads, shared workspaces, extreme inputs; every output against the CPU reference");
  c->add_option("--seconds", a->seconds, "how long to run")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  c->add_option("--steps", a->steps, "stop after this many steps (replaying a failure)")
      ->check(CLI::PositiveNumber);
  CLI::Option* seed = c->add_option("--seed", a->seed, "the run's seed (default: a random one, printed)")
                          ->check(seed_check());
  c->add_option("--preset", a->preset, preset_names(" | "))->capture_default_str();
  c->add_option("--backend", a->backend, "cpu | cuda")->capture_default_str();
  c->add_option("--max-tokens", a->max_tokens, "the layers' max_tokens (default 16 on cpu, 4096 on cuda)")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--check-tokens", a->check_tokens,
                "tokens of each forward compared with the reference (default: all at small shapes, else 2)")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--hidden", a->hidden, "override H")->check(shape_override_range());
  c->add_option("--inter", a->inter, "override I")->check(shape_override_range());
  c->add_option("--experts", a->experts, "override E")->check(shape_override_range());
  c->add_option("--topk", a->topk, "override K")->check(shape_override_range());
  c->add_option("--json", a->json, "write the report as JSON here");
  c->add_option("--inject-mismatch", a->inject_mismatch,
                "flip one bit of the reference at this step (a test that the soak can fail)")
      ->group("");
  return {{c, [a, seed] {
             a->seed_given = seed->count() > 0;
             return run_soak(*a);
           }}};
}

}  // namespace megamoe::tools
