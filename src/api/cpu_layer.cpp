// CpuMoeLayer: the CPU backend's layer object (moe_layer.h), over the kernel-faithful
// reference; and require_ready, what either layer object asks of a WeightStore.
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "layer_checks.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/reference/moe.h"
#include "megamoe/weights/store.h"

namespace megamoe::api {

void require_ready(const WeightStore& store, int layer, const char* op) {
  if (!store.ready(layer))
    throw std::runtime_error(fmt::format(
        "{}: the layer's weights are incomplete (never loaded, or a reload left a weight without its scale "
        "/ a layerwise reload without all tensors); load them (the missing tensors, or the whole layer)",
        op));
}

struct CpuMoeLayer::Impl {
  MoeShape shape;
  int max_tokens = 0;
  std::unique_ptr<HostMoeWeights> owned;  // the first constructor's copy
  MoeWeightsView view{};                  // borrowed or owned regions (unused over a store)
  const WeightStore* store = nullptr;     // a store's layer: read at each forward
  int store_layer = 0;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  int last_tokens = 0;
  // Forwards of one layer from several threads run one at a time (they share ids / weights).
  std::mutex mu;

  MoeWeightsView weights_view(const char* op) const {
    if (!store) return view;
    require_ready(*store, store_layer, op);
    return store->host_view(store_layer);
  }

  // The caller's routing, checked and widened to int32 into ids / weights.
  void take_routing(const RoutingInput& r, int T) {
    detail::require_id_bytes(r.id_bytes);
    const size_t n = size_t(T) * size_t(shape.topk);
    if (n && (!r.ids || !r.weights))
      throw std::invalid_argument(
          fmt::format("forward routing: null {}", !r.ids ? "topk_ids" : "topk_weights"));
    const int K = shape.topk;
    for (size_t i = 0; i < n; ++i) {
      const int64_t v =
          r.id_bytes == 8 ? static_cast<const int64_t*>(r.ids)[i] : static_cast<const int32_t*>(r.ids)[i];
      if (v < 0 || v >= shape.experts)
        throw std::invalid_argument(
            fmt::format("topk_ids: expected expert ids in [0, {}), found {} at [{}, {}]", shape.experts, v,
                        i / K, i % K));
      ids[i] = int32_t(v);
    }
    if (n) std::memcpy(weights.data(), r.weights, n * sizeof(float));
    for (size_t i = 0; i < n; ++i)
      if (!std::isfinite(weights[i]))
        throw std::invalid_argument(fmt::format("topk_weights: expected finite weights, found {} at [{}, {}]",
                                                weights[i], i / K, i % K));
  }

  void run(const num::bf16_t* x, float* y, int T, const RoutingInput* routing) {
    const std::lock_guard lock(mu);
    detail::require_token_count("forward", T, max_tokens);
    // A store's reload on another thread waits for this forward (and this one for it).
    std::shared_lock<std::shared_mutex> hold;
    if (store) hold = store->read_lock();
    const MoeWeightsView v = weights_view("forward");
    if (T > 0 && (!x || !y)) throw std::invalid_argument(fmt::format("forward: null {}", !x ? "x" : "y"));
    const size_t n = size_t(T) * size_t(shape.topk);
    ids.resize(n);
    weights.resize(n);
    last_tokens = 0;
    if (routing)
      take_routing(*routing, T);
    else if (T > 0)
      ref::route(shape, v, x, T, ids.data(), weights.data());
    if (T > 0) ref::moe_layer(shape, v, x, T, ids.data(), weights.data(), ref::Mode::kKernelFaithful, y);
    last_tokens = T;
  }

  void run_bf16(const num::bf16_t* x, num::bf16_t* y, int T, const RoutingInput* routing) {
    std::vector<float> yf(size_t(std::max(T, 0)) * size_t(shape.hidden));
    run(x, yf.data(), T, routing);
    for (size_t i = 0; i < yf.size(); ++i) y[i] = num::bf16_encode(yf[i]);
  }
};

static std::unique_ptr<CpuMoeLayer::Impl> make_cpu_impl(const MoeShape& s, const MoeLayerOptions& opt) {
  s.validate();
  detail::require_max_tokens(opt.max_tokens);
  auto impl = std::make_unique<CpuMoeLayer::Impl>();
  impl->shape = s;
  impl->max_tokens = opt.max_tokens;
  return impl;
}

CpuMoeLayer::CpuMoeLayer(const HostMoeWeights& w, const MoeLayerOptions& opt)
    : impl_(make_cpu_impl(whole_layer(w, "CpuMoeLayer").shape, opt)) {
  impl_->owned = std::make_unique<HostMoeWeights>(w.shape);
  std::memcpy(impl_->owned->data(), w.data(), w.bytes());
  impl_->view = impl_->owned->view();
}

CpuMoeLayer::CpuMoeLayer(const MoeShape& shape, const void* host_base, const MoeLayerOptions& opt)
    : impl_(make_cpu_impl(shape, opt)) {
  if (!host_base) throw std::invalid_argument("CpuMoeLayer weights: null pointer");
  impl_->view = MoeWeightsView::at(host_base, MoeWeightLayout::compute(shape), shape);
}

CpuMoeLayer::CpuMoeLayer(const MoeShape& shape, const MoeWeightsView& host_weights,
                         const MoeLayerOptions& opt)
    : impl_(make_cpu_impl(shape, opt)) {
  detail::check_weights_view("CpuMoeLayer weights view", shape, host_weights,
                             [](const void*, const std::string&, size_t) {});
  impl_->view = host_weights;
}

CpuMoeLayer::CpuMoeLayer(const WeightStore& store, int layer, const MoeLayerOptions& opt)
    : impl_(make_cpu_impl(store.shape(layer), opt)) {  // (a layer the store does not hold: throws)
  if (store.memory() != StoreMemory::kHost)
    throw std::invalid_argument(fmt::format(
        "CpuMoeLayer: the WeightStore holds layer {} in device memory (make it with StoreMemory::kHost)",
        layer));
  if (!store.layout(layer).whole(store.shape(layer)))
    throw std::invalid_argument(
        fmt::format("CpuMoeLayer: the WeightStore holds {} of layer {} (an expert-parallel rank's part)",
                    store.layout(layer).experts_text(store.shape(layer)), layer));
  impl_->store = &store;
  impl_->store_layer = layer;
}

CpuMoeLayer::~CpuMoeLayer() = default;

void CpuMoeLayer::forward(const num::bf16_t* x, num::bf16_t* y, int tokens) {
  impl_->run_bf16(x, y, tokens, nullptr);
}
void CpuMoeLayer::forward(const num::bf16_t* x, num::bf16_t* y, int tokens, const RoutingInput& routing) {
  impl_->run_bf16(x, y, tokens, &routing);
}
void CpuMoeLayer::forward(const num::bf16_t* x, float* y, int tokens, const RoutingInput* routing) {
  impl_->run(x, y, tokens, routing);
}
void CpuMoeLayer::check() {}

const int32_t* CpuMoeLayer::topk_ids() const { return impl_->ids.data(); }
const float* CpuMoeLayer::topk_weights() const { return impl_->weights.data(); }
int CpuMoeLayer::last_tokens() const { return impl_->last_tokens; }
const MoeShape& CpuMoeLayer::shape() const { return impl_->shape; }
int CpuMoeLayer::max_tokens() const { return impl_->max_tokens; }
MoeWeightsView CpuMoeLayer::host_weights() const { return impl_->weights_view("host_weights"); }

}  // namespace megamoe::api
