// CudaEpMoeLayer: the ranks this process drives, over virtual ranks or NCCL (ep_layer.h).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "../kernels/config.h"
#include "../kernels/cuda_check.h"
#include "call_gate.h"
#include "checks.h"
#include "cuda_backend.h"
#include "device_run.h"
#include "megamoe/api/ep_layer.h"
#include "megamoe/kernels/fused_moe.h"
#include "megamoe/transport/transport.h"
#include "megamoe/weights/device_memory.h"

namespace megamoe::api {

EpTransport parse_ep_transport(const std::string& name) {
  if (name == "virtual") return EpTransport::kVirtual;
  if (name == "nccl") return EpTransport::kNccl;
  throw std::invalid_argument(fmt::format("unknown expert-parallel transport '{}' (virtual, nccl)", name));
}

// What a model's expert-parallel layers share (EpLayerOptions::share): the transport
// with its symmetric buffers, and each local rank's workspace, stream and events. The
// layers of a model run one after another on a stream, so one set serves them all; the
// epoch in the shared workspace counts every forward of every layer, on every rank alike.
struct EpGroup {
  MoeShape shape;  // the layers' shape (every sharing layer has it)
  EpLayerOptions opt;
  kernels::EpLayout layout;
  kernels::MoeWorkspaceLayout ws;
  int sms_share = 0;  // 0: every SM of the rank's device
  std::unique_ptr<transport::Transport> transport;
  // By device: the event a forward records on its caller's stream (an event is recorded on
  // a stream of its own device only), made on first use there; the ranks' streams wait on it.
  std::vector<cudaEvent_t> forks;
  struct Rank {
    int rank = 0, device = 0;
    void* workspace = nullptr;
    int* own_count = nullptr;
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;
  };
  std::vector<Rank> local;
  // The group's layers share workspaces and streams: their calls must not overlap.
  detail::CallGate gate;

  // Makes the transport and each local rank's resources. (Not the constructor: a throw
  // half-way leaves what was made to ~EpGroup, which a constructor's throw would skip.)
  void init(const MoeShape& s, const EpLayerOptions& o);
  ~EpGroup() {
    const DeviceGuard guard;
    for (Rank& r : local) {
      cudaSetDevice(r.device);
      cudaFree(r.workspace);
      cudaFree(r.own_count);
      if (r.stream) cudaStreamDestroy(r.stream);
      if (r.done) cudaEventDestroy(r.done);
    }
    for (size_t d = 0; d < forks.size(); ++d)
      if (forks[d]) cudaSetDevice(int(d)), cudaEventDestroy(forks[d]);
  }

  // The fork event of the current device (the caller's stream's).
  cudaEvent_t fork_event() {
    int d = 0;
    MEGAMOE_CUDA_CHECK(cudaGetDevice(&d));
    if (size_t(d) >= forks.size()) forks.resize(size_t(d) + 1, nullptr);
    if (!forks[d]) MEGAMOE_CUDA_CHECK(cudaEventCreateWithFlags(&forks[d], cudaEventDisableTiming));
    return forks[d];
  }
};

void EpGroup::init(const MoeShape& s, const EpLayerOptions& o) {
  shape = s;
  opt = o;
  if (opt.max_tokens <= 0)
    throw std::invalid_argument(fmt::format("max_tokens = {} per rank must be > 0", opt.max_tokens));
  if (!(opt.timeout_s > 0)) throw std::invalid_argument("the expert-parallel timeout must be > 0 seconds");
  layout = kernels::EpLayout::compute(shape, opt.ranks, opt.max_tokens);  // checks R and E % R
  ws = kernels::MoeWorkspaceLayout::compute(shape, opt.max_tokens, opt.ranks);
  if (opt.transport == EpTransport::kVirtual) {
    if (!opt.local_ranks.empty() || !opt.devices.empty() || !opt.rendezvous.empty())
      throw std::invalid_argument(
          "virtual ranks: every rank runs in this process on the current GPU "
          "(local_ranks, devices and rendezvous are for the nccl transport)");
    int dev = 0, sms = 0;
    MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
    MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    // NOTE: the ranks wait on each other inside their kernels, so all R persistent grids
    // must be resident at once: each takes 1/R of the SMs.
    if (sms / opt.ranks < 1)
      throw std::invalid_argument(
          fmt::format("{} virtual ranks need at least {} SMs ({} here)", opt.ranks, opt.ranks, sms));
    sms_share = sms / opt.ranks;
    transport = transport::make_virtual_ranks(layout);
  } else {
    transport::NcclOptions no;
    no.local_ranks = opt.local_ranks;
    no.devices = opt.devices;
    no.rendezvous = opt.rendezvous;
    no.search = detail::nccl_search();
    transport = transport::make_nccl_transport(layout, no);
  }
  for (int r : transport->local_ranks()) {
    local.emplace_back();
    Rank& k = local.back();  // (owned from here: ~EpGroup frees what a throw leaves)
    k.rank = r;
    k.device = transport->device(r);
    MEGAMOE_CUDA_CHECK(cudaSetDevice(k.device));
    MEGAMOE_CUDA_CHECK(cudaMalloc(&k.workspace, ws.total_bytes));
    // NOTE: poison, so a region the kernels fail to write shows up as garbage, never as zeros.
    MEGAMOE_CUDA_CHECK(cudaMemset(k.workspace, 0xFF, ws.total_bytes));
    MEGAMOE_CUDA_CHECK(cudaMalloc(&k.own_count, sizeof(int)));
    MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking));
    MEGAMOE_CUDA_CHECK(cudaEventCreateWithFlags(&k.done, cudaEventDisableTiming));
  }
}

struct CudaEpMoeLayer::Impl {
  std::shared_ptr<EpGroup> group;  // (its shape is this layer's)
  struct Rank {
    const EpGroup::Rank* at = nullptr;  // its rank and device (the group's, in the same order)
    void* weights = nullptr;            // the rank's own experts (rank_layout), shared expert, router
    bool borrowed = false;              // a WeightStore's buffer (not freed here)
    MoeWeightLayout rank_layout;
    kernels::FusedMoePlan* plan = nullptr;
    IoPointerCheck io_check;
  };
  std::vector<Rank> local;  // in the order of group->local

  ~Impl() {
    const DeviceGuard guard;
    for (Rank& r : local) {
      cudaSetDevice(r.at->device);
      if (r.plan) kernels::fused_moe_plan_destroy(r.plan);
      if (!r.borrowed) cudaFree(r.weights);
    }
  }
};

namespace {

// A sharing layer's options (`share` aside) must be the group's own.
void require_same_options(const EpLayerOptions& o, const EpLayerOptions& g) {
  auto differs = [](auto a, auto b) { return !(a == b); };
  std::string what;
  if (differs(o.ranks, g.ranks)) what += fmt::format(" ranks {} vs {};", o.ranks, g.ranks);
  if (differs(o.max_tokens, g.max_tokens))
    what += fmt::format(" max_tokens {} vs {};", o.max_tokens, g.max_tokens);
  if (differs(o.timeout_s, g.timeout_s))
    what += fmt::format(" timeout_s {} vs {};", o.timeout_s, g.timeout_s);
  if (differs(o.transport, g.transport)) what += " transport;";
  if (differs(o.local_ranks, g.local_ranks) || differs(o.devices, g.devices) ||
      differs(o.rendezvous, g.rendezvous))
    what += " local_ranks, devices or rendezvous;";
  if (!what.empty())
    throw std::invalid_argument("CudaEpMoeLayer: options differ from the layer it shares with:" + what);
}

}  // namespace

CudaEpMoeLayer::CudaEpMoeLayer(const HostMoeWeights& w, const EpLayerOptions& opt)
    : CudaEpMoeLayer(std::vector<WeightSource>{{w.shape, w.layout, w.data(), false}}, opt) {}

CudaEpMoeLayer::CudaEpMoeLayer(const std::vector<WeightSource>& sources, const EpLayerOptions& opt)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  DeviceGuard guard;
  MEGAMOE_CHECK(!sources.empty(), "CudaEpMoeLayer: no weights");
  const MoeShape& shape = sources[0].shape;
  validate_shape(shape);
  for (const WeightSource& w : sources)
    if (!w.shape.same_as(shape))
      throw std::invalid_argument("CudaEpMoeLayer: the ranks' weights are of different layer shapes");
  if (opt.share) {
    EpLayerOptions own = opt;
    own.share = nullptr;
    m.group = opt.share->impl_->group;
    require_same_options(own, m.group->opt);
    // (the shared workspace's regions, the epoch's place among them, are the shape's)
    if (!shape.same_as(m.group->shape))
      throw std::invalid_argument(
          fmt::format("CudaEpMoeLayer: shape {} differs from {} of the layer it shares with",
                      shape.describe(), m.group->shape.describe()));
  } else {
    m.group = std::make_shared<EpGroup>();
    m.group->init(shape, opt);
  }
  const EpGroup& g = *m.group;
  if (sources.size() != 1 && sources.size() != g.local.size())
    throw std::invalid_argument(
        fmt::format("CudaEpMoeLayer: {} weight sources for {} local ranks (give one, or one each)",
                    sources.size(), g.local.size()));
  for (const EpGroup::Rank& gk : g.local) {
    const WeightSource& src = sources[sources.size() == 1 ? 0 : m.local.size()];
    const dev::PointerInfo src_mem = dev::pointer_info(src.base);
    const int r = gk.rank;
    m.local.emplace_back();
    Impl::Rank& k = m.local.back();  // (owned by m from here: ~Impl frees what a throw leaves)
    k.at = &gk;
    MEGAMOE_CUDA_CHECK(cudaSetDevice(gk.device));
    // Each rank holds only its E/R experts (plus the shared expert and the whole router):
    // R ranks on R GPUs hold the layer once between them, and virtual ranks run the same
    // rank-local views. A device store holding exactly the rank's experts on its device
    // is borrowed (reloads land in place); otherwise the rank's part is copied.
    const ExpertRange own{r * g.layout.local_experts, g.layout.local_experts};
    k.rank_layout = MoeWeightLayout::compute(shape, own);
    const ExpertRange have = src.layout.experts;
    if (!have.contains(own))
      throw std::invalid_argument(
          fmt::format("CudaEpMoeLayer: rank {} owns experts {}, but the weights hold experts {} only", r,
                      own.text(), have.text()));
    if (src.borrow && src_mem.device && src_mem.ordinal == gk.device && have == own) {
      require_aligned(src.base, 256, "CudaEpMoeLayer weights");
      k.weights = const_cast<void*>(src.base);  // (read only: the kernels take a const view)
      k.borrowed = true;
    } else {
      MEGAMOE_CUDA_CHECK(cudaMalloc(&k.weights, k.rank_layout.total_bytes));
      for (const RegionCopy& c : region_copies(src.layout, k.rank_layout))
        MEGAMOE_CUDA_CHECK(cudaMemcpy(static_cast<uint8_t*>(k.weights) + c.dst_offset,
                                      static_cast<const uint8_t*>(src.base) + c.src_offset, c.bytes,
                                      cudaMemcpyDefault));
    }
    kernels::EpRank ep;
    ep.layout = g.layout;
    ep.rank = r;
    const transport::PeerTable t = g.transport->peers(r);
    for (int q = 0; q < g.opt.ranks; ++q) ep.peer_base[q] = t.base[q];
    ep.timeout_s = g.opt.timeout_s;
    ep.init_state = !opt.share;  // a shared workspace's epoch goes on counting
    kernels::FusedMoeConfig cfg;
    cfg.num_sms = g.sms_share;
    k.plan = kernels::fused_moe_plan_create(shape, MoeWeightsView::at(k.weights, k.rank_layout, shape), g.ws,
                                            gk.workspace, cfg, detail::switches(), &ep);
    // NOTE: the workspace's poison and the plan's zeroed epoch and records (memsets), and
    // the weight copies, went to the legacy default stream, which neither the ranks'
    // streams nor a caller's non-blocking stream wait for: done before the first forward.
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  }
}

CudaEpMoeLayer::~CudaEpMoeLayer() = default;

void CudaEpMoeLayer::forward(const std::vector<const num::bf16_t*>& x, const std::vector<num::bf16_t*>& y,
                             const std::vector<int>& tokens, Stream stream,
                             const std::vector<const int*>& num_tokens_dev, uint32_t launch_mask) {
  Impl& m = *impl_;
  const auto entry = m.group->gate.enter("CudaEpMoeLayer", "forward");
  DeviceGuard guard;
  const int n = int(m.local.size());
  if (int(x.size()) != n || int(y.size()) != n || int(tokens.size()) != n)
    throw std::invalid_argument(
        fmt::format("forward: {} local ranks need {} inputs, outputs and token counts "
                    "(got {}, {}, {})",
                    n, n, x.size(), y.size(), tokens.size()));
  if (!num_tokens_dev.empty() && int(num_tokens_dev.size()) != n)
    throw std::invalid_argument(
        fmt::format("forward: {} device token counts for {} local ranks", num_tokens_dev.size(), n));
  auto s = static_cast<cudaStream_t>(stream);
  EpGroup& g = *m.group;
  for (int i = 0; i < n; ++i) {
    Impl::Rank& k = m.local[i];
    const int rank = k.at->rank, device = k.at->device;
    g.layout.check_tokens(rank, tokens[i]);
    if (tokens[i] > 0) {
      require_aligned(x[i], 16, "forward x");
      require_aligned(y[i], 16, "forward y");
      k.io_check.require(x[i], device, "forward", "x", s, rank);
      k.io_check.require(y[i], device, "forward", "y", s, rank);
    }
    if (!num_tokens_dev.empty() && num_tokens_dev[i])
      k.io_check.require(num_tokens_dev[i], device, "forward", "num_tokens_dev", s, rank);
  }
  // (the caller's device is current: `s` is a stream of it, or its default stream)
  const cudaEvent_t fork = g.fork_event();
  MEGAMOE_CUDA_CHECK(cudaEventRecord(fork, s));
  for (int i = 0; i < n; ++i) {
    if (!(launch_mask >> i & 1)) continue;
    const Impl::Rank& k = m.local[i];
    const EpGroup::Rank& gk = *k.at;
    MEGAMOE_CUDA_CHECK(cudaSetDevice(gk.device));
    MEGAMOE_CUDA_CHECK(cudaStreamWaitEvent(gk.stream, fork, 0));
    const int* count = num_tokens_dev.empty() ? nullptr : num_tokens_dev[i];
    if (!count) {
      kernels::set_device_int(gk.own_count, tokens[i], gk.stream);
      count = gk.own_count;
    }
    kernels::DeviceTensors t;
    t.x = reinterpret_cast<const uint16_t*>(x[i]);
    t.y = reinterpret_cast<uint16_t*>(y[i]);
    t.num_tokens = count;
    t.workspace = gk.workspace;
    kernels::fused_moe_forward(k.plan, t, tokens[i], gk.stream, detail::switches());
    MEGAMOE_CUDA_CHECK(cudaEventRecord(gk.done, gk.stream));
  }
  // The join, with the caller's device current again: a null `s` is that device's
  // default stream (with a rank's device current it would name the rank's).
  MEGAMOE_CUDA_CHECK(cudaSetDevice(guard.saved));
  for (int i = 0; i < n; ++i)
    if (launch_mask >> i & 1) MEGAMOE_CUDA_CHECK(cudaStreamWaitEvent(s, m.local[i].at->done, 0));
}

void CudaEpMoeLayer::check() {
  Impl& m = *impl_;
  const auto entry = m.group->gate.enter("CudaEpMoeLayer", "check");
  DeviceGuard guard;
  std::string first, counts;
  for (const Impl::Rank& k : m.local) {
    MEGAMOE_CUDA_CHECK(cudaSetDevice(k.at->device));
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    const kernels::EpStatus st = kernels::ep_status(k.plan);
    if (st.phase != kernels::EpStatus::kNone && first.empty()) first = st.message();
    // A rank whose device token count was out of range ran clamped (the protocol
    // stays consistent: its peers see the clamped count); reported, then cleared.
    const kernels::TokenCountStatus tc = kernels::token_count_take(k.plan);
    if (tc.bad_forwards)
      counts += fmt::format("{}rank {}: {}", counts.empty() ? "" : "; ", k.at->rank, tc.message());
  }
  if (first.empty()) {
    if (!counts.empty()) throw std::runtime_error("CudaEpMoeLayer: " + counts);
    return;
  }
  if (!counts.empty()) first += "; " + counts;
  // NOTE: with one process per GPU every process sees its own ranks' status; each resets
  // its own (a peer that timed out elsewhere reports there).
  for (const Impl::Rank& k : m.local) {
    MEGAMOE_CUDA_CHECK(cudaSetDevice(k.at->device));
    kernels::ep_reset(k.plan);
  }
  throw std::runtime_error(first);
}

int CudaEpMoeLayer::ranks() const { return impl_->group->opt.ranks; }
std::vector<int> CudaEpMoeLayer::local_ranks() const { return impl_->group->transport->local_ranks(); }
int CudaEpMoeLayer::device(int i) const {
  MEGAMOE_CHECK(i >= 0 && i < int(impl_->local.size()), "device: no local rank " + std::to_string(i));
  return impl_->local[i].at->device;
}
size_t CudaEpMoeLayer::weight_bytes(int i) const {
  MEGAMOE_CHECK(i >= 0 && i < int(impl_->local.size()), "weight_bytes: no local rank " + std::to_string(i));
  return impl_->local[i].rank_layout.total_bytes;
}
bool CudaEpMoeLayer::borrows_weights(int i) const {
  MEGAMOE_CHECK(i >= 0 && i < int(impl_->local.size()),
                "borrows_weights: no local rank " + std::to_string(i));
  return impl_->local[i].borrowed;
}
int CudaEpMoeLayer::max_tokens() const { return impl_->group->opt.max_tokens; }
const MoeShape& CudaEpMoeLayer::shape() const { return impl_->group->shape; }
const int32_t* CudaEpMoeLayer::topk_ids(int i) const {
  MEGAMOE_CHECK(i >= 0 && i < int(impl_->local.size()), "topk_ids: no local rank " + std::to_string(i));
  return kernels::routing_outputs(impl_->local[i].plan).ids;
}
const float* CudaEpMoeLayer::topk_weights(int i) const {
  MEGAMOE_CHECK(i >= 0 && i < int(impl_->local.size()), "topk_weights: no local rank " + std::to_string(i));
  return kernels::routing_outputs(impl_->local[i].plan).weights;
}
std::string CudaEpMoeLayer::config_for(int tokens_per_rank) const {
  return kernels::describe(
      kernels::fused_moe_config(impl_->local[0].plan, tokens_per_rank, detail::switches()));
}

std::vector<EpCheckRank> ep_self_check(const MoeShape& shape, int tokens, const EpLayerOptions& opt,
                                       uint64_t seed) {
  DeviceGuard guard;
  const HostMoeWeights w = make_random_weights(shape, seed);
  CudaEpMoeLayer layer(w, opt);
  const std::vector<int> ranks = layer.local_ranks();
  const int n = int(ranks.size()), H = shape.hidden;
  std::vector<EpCheckRank> res(n);
  std::vector<std::vector<num::bf16_t>> xs(n);
  std::vector<DeviceBuffer> bx, by;  // each rank's x and y on its device
  std::vector<const num::bf16_t*> dx(n);
  std::vector<num::bf16_t*> dy(n);
  std::vector<int> counts(n);
  for (int i = 0; i < n; ++i) {
    res[i].rank = ranks[i];
    res[i].device = layer.device(i);
    counts[i] = res[i].tokens = std::max(0, tokens - ranks[i] % 3);
    xs[i] = make_random_tokens(size_t(counts[i]) * H, seed + 1 + ranks[i]);  // fresh per rank
    MEGAMOE_CUDA_CHECK(cudaSetDevice(res[i].device));
    bx.emplace_back(xs[i].size() * 2);
    by.emplace_back(xs[i].size() * 2);
    MEGAMOE_CUDA_CHECK(cudaMemcpy(bx[i].p, xs[i].data(), xs[i].size() * 2, cudaMemcpyHostToDevice));
    MEGAMOE_CUDA_CHECK(cudaMemset(by[i].p, 0xFF, xs[i].size() * 2));  // poison
    dx[i] = bx[i].as<const num::bf16_t>();
    dy[i] = by[i].as<num::bf16_t>();
  }
  MEGAMOE_CUDA_CHECK(cudaSetDevice(res[0].device));
  TimedStream ts;
  const double seconds = ts.time_second([&] { layer.forward(dx, dy, counts, ts.stream); });
  layer.check();
  for (int i = 0; i < n; ++i) {
    MEGAMOE_CUDA_CHECK(cudaSetDevice(res[i].device));
    std::vector<num::bf16_t> got(xs[i].size()), want(xs[i].size());
    MEGAMOE_CUDA_CHECK(cudaMemcpy(got.data(), dy[i], got.size() * 2, cudaMemcpyDeviceToHost));
    MoeLayerOptions lo;
    lo.max_tokens = std::max(1, counts[i]);
    CudaMoeLayer one(w, lo);
    MEGAMOE_CUDA_CHECK(cudaMemset(dy[i], 0xFF, got.size() * 2));
    one.forward(dx[i], dy[i], counts[i], nullptr, nullptr);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    MEGAMOE_CUDA_CHECK(cudaMemcpy(want.data(), dy[i], want.size() * 2, cudaMemcpyDeviceToHost));
    res[i].bytes_equal = got == want;
    res[i].us = seconds * 1e6;
  }
  MEGAMOE_CUDA_CHECK(cudaSetDevice(res[0].device));  // the stream's device, for its destruction
  return res;
}

}  // namespace megamoe::api
