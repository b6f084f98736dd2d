// CudaMoeLayer: validation, ownership and the kernel plan.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <stdexcept>

#include "../kernels/config.h"
#include "../kernels/cuda_check.h"
#include "call_gate.h"
#include "checks.h"
#include "cuda_backend.h"
#include "layer_checks.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/kernels/fused_moe.h"

namespace megamoe::api {

struct CudaMoeLayer::Impl {
  MoeShape shape;
  MoeWeightLayout wlayout;
  kernels::MoeWorkspaceLayout ws;
  void* owned_weights = nullptr;
  const void* weights = nullptr;  // the layout's base (a view's w13: device_weights())
  void* workspace = nullptr;
  bool owns_workspace = false;  // false: MoeLayerOptions::workspace, the caller's
  int* own_count = nullptr;
  kernels::FusedMoePlan* plan = nullptr;
  int device = 0;  // where the workspace lives
  IoPointerCheck io_check;
  std::shared_ptr<detail::CallGate> gate;  // shared with the layers of the same workspace

  // What forward and route check first (`op` names the call in messages): the hint
  // against max_tokens, x and a caller's device count as device memory; returns the
  // device count the kernels read (the layer's own, set to the hint, when none is given).
  const int* token_count(const char* op, const num::bf16_t* x, int hint, const int* count, cudaStream_t s) {
    // The kernels launch on the current device: another one would run them there,
    // reading this layer's memory over the link (or faulting without peer access).
    int current = -1;
    MEGAMOE_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device)
      throw std::invalid_argument(
          fmt::format("{}: the current device is {}, but the layer lives on device {} (make it current)", op,
                      current, device));
    detail::require_token_count(op, hint, ws.max_tokens);
    if (hint > 0) io_check.require(x, device, op, "x", s);
    if (count) {
      io_check.require(count, device, op, "num_tokens_dev", s);
      return count;
    }
    kernels::set_device_int(own_count, hint, s);  // a kernel node: capturable
    return own_count;
  }

  // x, y and the token count of a forward, checked (alignment, device memory, the hint).
  kernels::DeviceTensors io_tensors(const num::bf16_t* x, num::bf16_t* y, int hint, const int* count,
                                    cudaStream_t s) {
    if (hint > 0) {
      require_aligned(x, 16, "forward x");
      require_aligned(y, 16, "forward y");
    }
    kernels::DeviceTensors t;
    t.num_tokens = token_count("forward", x, hint, count, s);
    if (hint > 0) io_check.require(y, device, "forward", "y", s);
    t.x = x;
    t.y = y;
    t.workspace = workspace;
    return t;
  }

  ~Impl() {
    if (plan) kernels::fused_moe_plan_destroy(plan);
    if (owns_workspace) cudaFree(workspace);
    cudaFree(owned_weights);
    cudaFree(own_count);
  }
};

static std::unique_ptr<CudaMoeLayer::Impl> make_impl(const MoeShape& s, const MoeLayerOptions& opt) {
  validate_shape(s);
  detail::require_max_tokens(opt.max_tokens);
  auto impl = std::make_unique<CudaMoeLayer::Impl>();
  impl->shape = s;
  impl->wlayout = MoeWeightLayout::compute(s);
  impl->ws = kernels::MoeWorkspaceLayout::compute(s, opt.max_tokens);
  if (opt.workspace) {
    if (opt.workspace_bytes < impl->ws.total_bytes)
      throw std::invalid_argument(fmt::format(
          "CudaMoeLayer workspace: {} bytes given, {} needed for max_tokens = {} (workspace_bytes_for)",
          opt.workspace_bytes, impl->ws.total_bytes, opt.max_tokens));
    require_device_memory(opt.workspace, "CudaMoeLayer workspace");
    require_aligned(opt.workspace, 256, "CudaMoeLayer workspace");
    impl->workspace = opt.workspace;
  } else {
    MEGAMOE_CUDA_CHECK(cudaMalloc(&impl->workspace, impl->ws.total_bytes));
    impl->owns_workspace = true;
    // NOTE: poison, so a region the kernels fail to write shows up as garbage, never as zeros.
    MEGAMOE_CUDA_CHECK(cudaMemset(impl->workspace, 0xFF, impl->ws.total_bytes));
  }
  MEGAMOE_CUDA_CHECK(cudaMalloc(&impl->own_count, sizeof(int)));
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&impl->device));
  impl->gate = detail::gate_for_workspace(opt.workspace);
  return impl;
}

static void finish_plan(CudaMoeLayer::Impl& impl, const MoeWeightsView& v) {
  kernels::FusedMoeConfig cfg;
  impl.plan = kernels::fused_moe_plan_create(impl.shape, v, impl.ws, impl.workspace, cfg, detail::switches());
  // NOTE: the workspace's poison and the plan's zeroed record (memsets), and the weights'
  // upload, went to the legacy default stream, which a caller's non-blocking stream does
  // not wait for: done before the first forward.
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

CudaMoeLayer::CudaMoeLayer(const HostMoeWeights& w, const MoeLayerOptions& opt)
    : impl_(make_impl(whole_layer(w, "CudaMoeLayer").shape, opt)) {
  MEGAMOE_CUDA_CHECK(cudaMalloc(&impl_->owned_weights, w.bytes()));
  MEGAMOE_CUDA_CHECK(cudaMemcpy(impl_->owned_weights, w.data(), w.bytes(), cudaMemcpyHostToDevice));
  impl_->weights = impl_->owned_weights;
  finish_plan(*impl_, MoeWeightsView::at(impl_->weights, impl_->wlayout, impl_->shape));
}

CudaMoeLayer::CudaMoeLayer(const MoeShape& shape, const void* device_base, const MoeLayerOptions& opt)
    : impl_(make_impl(shape, opt)) {
  require_device_memory(device_base, "CudaMoeLayer weights");
  require_aligned(device_base, 256, "CudaMoeLayer weights");
  impl_->weights = device_base;
  finish_plan(*impl_, MoeWeightsView::at(impl_->weights, impl_->wlayout, impl_->shape));
}

CudaMoeLayer::CudaMoeLayer(const MoeShape& shape, const MoeWeightsView& device_weights,
                           const MoeLayerOptions& opt)
    : impl_(make_impl(shape, opt)) {
  // (device memory of the current device, aligned as each region is read)
  detail::check_weights_view("CudaMoeLayer weights view", impl_->shape, device_weights,
                             [](const void* p, const std::string& what, size_t align) {
                               require_device_memory(p, what.c_str());
                               require_aligned(p, align, what.c_str());
                             });
  impl_->weights = device_weights.w13;
  finish_plan(*impl_, device_weights);
}

CudaMoeLayer::~CudaMoeLayer() = default;

void CudaMoeLayer::forward(const num::bf16_t* x, num::bf16_t* y, int tokens_hint, const int* num_tokens_dev,
                           Stream stream) {
  const auto entry = impl_->gate->enter("CudaMoeLayer", "forward");
  auto s = static_cast<cudaStream_t>(stream);
  kernels::fused_moe_forward(impl_->plan, impl_->io_tensors(x, y, tokens_hint, num_tokens_dev, s),
                             tokens_hint, s, detail::switches());
}

void CudaMoeLayer::forward(const num::bf16_t* x, num::bf16_t* y, int tokens_hint, const int* num_tokens_dev,
                           Stream stream, const RoutingInput& routing) {
  const auto entry = impl_->gate->enter("CudaMoeLayer", "forward");
  auto s = static_cast<cudaStream_t>(stream);
  detail::require_id_bytes(routing.id_bytes);
  const kernels::DeviceTensors t = impl_->io_tensors(x, y, tokens_hint, num_tokens_dev, s);
  if (tokens_hint > 0) {
    impl_->io_check.require(routing.ids, impl_->device, "forward", "routing.ids", s);
    impl_->io_check.require(routing.weights, impl_->device, "forward", "routing.weights", s);
    require_aligned(routing.ids, size_t(routing.id_bytes), "forward routing.ids");
    require_aligned(routing.weights, 4, "forward routing.weights");
  }
  kernels::ExternalRouting r;
  r.ids = routing.ids, r.id_bytes = routing.id_bytes, r.weights = routing.weights;
  kernels::fused_moe_forward(impl_->plan, t, tokens_hint, s, r, detail::switches());
}

void CudaMoeLayer::route(const num::bf16_t* x, int tokens_hint, const int* num_tokens_dev, Stream stream) {
  const auto entry = impl_->gate->enter("CudaMoeLayer", "route");
  auto s = static_cast<cudaStream_t>(stream);
  kernels::DeviceTensors t;
  t.num_tokens = impl_->token_count("route", x, tokens_hint, num_tokens_dev, s);
  t.x = x;
  t.workspace = impl_->workspace;
  kernels::route_forward(impl_->plan, t, tokens_hint, s, detail::switches());
}

void CudaMoeLayer::check() {
  const auto entry = impl_->gate->enter("CudaMoeLayer", "check");
  // (the record lives on the layer's device, which token_count_take synchronizes)
  const DeviceGuard guard;
  MEGAMOE_CUDA_CHECK(cudaSetDevice(impl_->device));
  std::string error;
  for (const std::string& m :
       {kernels::token_count_take(impl_->plan).message(), kernels::routing_ids_take(impl_->plan).message()})
    if (!m.empty()) error += (error.empty() ? "CudaMoeLayer: " : "; ") + m;
  if (!error.empty()) throw std::runtime_error(error);
}

const int32_t* CudaMoeLayer::topk_ids() const { return kernels::routing_outputs(impl_->plan).ids; }
const float* CudaMoeLayer::topk_weights() const { return kernels::routing_outputs(impl_->plan).weights; }
const MoeShape& CudaMoeLayer::shape() const { return impl_->shape; }
int CudaMoeLayer::max_tokens() const { return impl_->ws.max_tokens; }
const void* CudaMoeLayer::device_weights() const { return impl_->weights; }
size_t CudaMoeLayer::workspace_bytes() const { return impl_->ws.total_bytes; }
size_t CudaMoeLayer::workspace_bytes_for(const MoeShape& s, int max_tokens) {
  detail::require_max_tokens(max_tokens);
  return kernels::MoeWorkspaceLayout::compute(s, max_tokens).total_bytes;
}
std::string CudaMoeLayer::config_for(int tokens) const {
  return kernels::describe(kernels::fused_moe_config(impl_->plan, tokens, detail::switches()));
}

}  // namespace megamoe::api
