// CudaEpMoeLayer: R virtual ranks on one GPU (ep_layer.h).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <stdexcept>
#include <vector>

#include "../kernels/cuda_check.h"
#include "checks.h"
#include "megamoe/api/ep_layer.h"
#include "megamoe/kernels/fused_moe.h"
#include "megamoe/transport/transport.h"

namespace megamoe::api {

struct CudaEpMoeLayer::Impl {
  MoeShape shape;
  EpLayerOptions opt;
  kernels::EpLayout layout;
  kernels::MoeWorkspaceLayout ws;
  std::unique_ptr<transport::Transport> transport;
  void* weights = nullptr;
  struct Rank {
    void* workspace = nullptr;
    int* own_count = nullptr;
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;
    kernels::FusedMoePlan* plan = nullptr;
  };
  std::vector<Rank> rank;
  cudaEvent_t fork = nullptr;

  ~Impl() {
    for (Rank& r : rank) {
      if (r.plan) kernels::fused_moe_plan_destroy(r.plan);
      cudaFree(r.workspace);
      cudaFree(r.own_count);
      if (r.stream) cudaStreamDestroy(r.stream);
      if (r.done) cudaEventDestroy(r.done);
    }
    if (fork) cudaEventDestroy(fork);
    cudaFree(weights);
  }
};

CudaEpMoeLayer::CudaEpMoeLayer(const HostMoeWeights& w, const EpLayerOptions& opt)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  validate_shape(w.shape);
  if (opt.max_tokens <= 0)
    throw std::invalid_argument(fmt::format("max_tokens = {} per rank must be > 0", opt.max_tokens));
  if (!(opt.timeout_s > 0)) throw std::invalid_argument("the expert-parallel timeout must be > 0 seconds");
  m.shape = w.shape;
  m.opt = opt;
  m.layout = kernels::EpLayout::compute(w.shape, opt.ranks, opt.max_tokens);  // checks R and E % R
  m.ws = kernels::MoeWorkspaceLayout::compute(w.shape, opt.max_tokens, opt.ranks);
  int dev = 0, sms = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  // NOTE: the ranks wait on each other inside their kernels, so all R persistent grids
  // must be resident at once: each takes 1/R of the SMs.
  if (sms / opt.ranks < 1)
    throw std::invalid_argument(fmt::format("{} virtual ranks need at least {} SMs ({} here)", opt.ranks,
                                            opt.ranks, sms));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&m.weights, w.bytes()));
  MEGAMOE_CUDA_CHECK(cudaMemcpy(m.weights, w.data(), w.bytes(), cudaMemcpyHostToDevice));
  m.transport = transport::make_virtual_ranks(m.layout);
  MEGAMOE_CUDA_CHECK(cudaEventCreateWithFlags(&m.fork, cudaEventDisableTiming));
  const MoeWeightsView view = MoeWeightsView::at(m.weights, MoeWeightLayout::compute(w.shape), w.shape);
  m.rank.resize(opt.ranks);
  for (int r = 0; r < opt.ranks; ++r) {
    Impl::Rank& k = m.rank[r];
    MEGAMOE_CUDA_CHECK(cudaMalloc(&k.workspace, m.ws.total_bytes));
    // NOTE: poison, so a region the kernels fail to write shows up as garbage, never as zeros.
    MEGAMOE_CUDA_CHECK(cudaMemset(k.workspace, 0xFF, m.ws.total_bytes));
    MEGAMOE_CUDA_CHECK(cudaMalloc(&k.own_count, sizeof(int)));
    MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking));
    MEGAMOE_CUDA_CHECK(cudaEventCreateWithFlags(&k.done, cudaEventDisableTiming));
    kernels::EpRank ep;
    ep.layout = m.layout;
    ep.rank = r;
    const transport::PeerTable t = m.transport->peers(r);
    for (int q = 0; q < opt.ranks; ++q) ep.peer_base[q] = t.base[q];
    ep.view_expert0 = r * m.layout.local_experts;  // one copy of every expert
    ep.timeout_s = opt.timeout_s;
    kernels::FusedMoeConfig cfg;
    cfg.num_sms = sms / opt.ranks;
    k.plan = kernels::fused_moe_plan_create(w.shape, view, m.ws, k.workspace, cfg, &ep);
  }
}

CudaEpMoeLayer::~CudaEpMoeLayer() = default;

void CudaEpMoeLayer::forward(const std::vector<const num::bf16_t*>& x, const std::vector<num::bf16_t*>& y,
                             const std::vector<int>& tokens, Stream stream,
                             const std::vector<const int*>& num_tokens_dev, uint32_t launch_mask) {
  Impl& m = *impl_;
  const int R = m.opt.ranks;
  if (int(x.size()) != R || int(y.size()) != R || int(tokens.size()) != R)
    throw std::invalid_argument(fmt::format("forward: {} ranks need {} inputs, outputs and token counts "
                                            "(got {}, {}, {})",
                                            R, R, x.size(), y.size(), tokens.size()));
  if (!num_tokens_dev.empty() && int(num_tokens_dev.size()) != R)
    throw std::invalid_argument(fmt::format("forward: {} device token counts for {} ranks",
                                            num_tokens_dev.size(), R));
  for (int r = 0; r < R; ++r) {
    m.layout.check_tokens(r, tokens[r]);
    if (tokens[r] > 0) {
      require_aligned(x[r], 16, "forward x");
      require_aligned(y[r], 16, "forward y");
    }
  }
  auto s = static_cast<cudaStream_t>(stream);
  MEGAMOE_CUDA_CHECK(cudaEventRecord(m.fork, s));
  for (int r = 0; r < R; ++r) {
    if (!(launch_mask >> r & 1)) continue;
    Impl::Rank& k = m.rank[r];
    MEGAMOE_CUDA_CHECK(cudaStreamWaitEvent(k.stream, m.fork, 0));
    const int* count = num_tokens_dev.empty() ? nullptr : num_tokens_dev[r];
    if (!count) {
      kernels::set_device_int(k.own_count, tokens[r], k.stream);
      count = k.own_count;
    }
    kernels::DeviceTensors t;
    t.x = reinterpret_cast<const uint16_t*>(x[r]);
    t.y = reinterpret_cast<uint16_t*>(y[r]);
    t.num_tokens = count;
    t.workspace = k.workspace;
    kernels::fused_moe_forward(k.plan, t, tokens[r], k.stream);
    MEGAMOE_CUDA_CHECK(cudaEventRecord(k.done, k.stream));
    MEGAMOE_CUDA_CHECK(cudaStreamWaitEvent(s, k.done, 0));
  }
}

void CudaEpMoeLayer::check() {
  Impl& m = *impl_;
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  std::string first;
  for (const Impl::Rank& k : m.rank) {
    const kernels::EpStatus st = kernels::ep_status(k.plan);
    if (st.phase != kernels::EpStatus::kNone && first.empty()) first = st.message();
  }
  if (first.empty()) return;
  for (const Impl::Rank& k : m.rank) kernels::ep_reset(k.plan);
  throw std::runtime_error(first);
}

int CudaEpMoeLayer::ranks() const { return impl_->opt.ranks; }
int CudaEpMoeLayer::max_tokens() const { return impl_->opt.max_tokens; }
const MoeShape& CudaEpMoeLayer::shape() const { return impl_->shape; }
const int32_t* CudaEpMoeLayer::topk_ids(int r) const {
  MEGAMOE_CHECK(r >= 0 && r < impl_->opt.ranks, "topk_ids: no rank " + std::to_string(r));
  return kernels::routing_outputs(impl_->rank[r].plan).ids;
}
const float* CudaEpMoeLayer::topk_weights(int r) const {
  MEGAMOE_CHECK(r >= 0 && r < impl_->opt.ranks, "topk_weights: no rank " + std::to_string(r));
  return kernels::routing_outputs(impl_->rank[r].plan).weights;
}
std::string CudaEpMoeLayer::config_for(int tokens_per_rank) const {
  return kernels::describe(kernels::fused_moe_config(impl_->rank[0].plan, tokens_per_rank));
}

}  // namespace megamoe::api
