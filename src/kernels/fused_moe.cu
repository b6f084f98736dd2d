// fused_moe's host side: the workspace layout, the launch plan (tensor maps, the SM-unit
// probe, cluster support, the kernel's arguments), the launches and the status reads. The
// kernel itself (its roles and their sequence) is fused_moe_kernel.cuh and the headers it
// includes; include/megamoe/kernels/fused_moe.h has the flow.
#include <cuda.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "config.h"
#include "cuda_check.h"
#include "fused_moe_kernel.cuh"
#include "heuristics.h"
#include "megamoe/kernels/fused_moe.h"
#include "megamoe/kernels/tile_schedule.h"
#include "megamoe/numerics/mma_model.h"
#include "route.cuh"
#include "sm90_ptx.cuh"

namespace megamoe::kernels {

// ============================================================================
// Workspace layout
// ============================================================================
MoeWorkspaceLayout MoeWorkspaceLayout::compute(const MoeShape& s, int max_tokens, int ep_ranks) {
  s.validate();
  MEGAMOE_CHECK(ep_ranks >= 0 && (ep_ranks == 0 || s.experts % ep_ranks == 0),
                "workspace: " + std::to_string(s.experts) + " experts do not split over " +
                    std::to_string(ep_ranks) + " ranks");
  MoeWorkspaceLayout w;
  w.max_tokens = max_tokens;
  w.ep_ranks = ep_ranks;
  const int shared = s.has_shared() ? 1 : 0;
  w.experts_total = s.experts + shared;
  w.local_experts = ep_ranks ? s.experts / ep_ranks : s.experts;
  // Rows of every expert segment, each padded to kRowAlign rows (see the schedule tables):
  // all slots of max_tokens tokens, or under expert parallelism what R sources can send
  // to this rank's experts plus the shared expert's rows of its own tokens.
  const int64_t routed =
      ep_ranks ? EpLayout::max_recv_rows(s, ep_ranks, max_tokens) : int64_t(max_tokens) * s.topk;
  const int64_t rows =
      routed + int64_t(max_tokens) * shared + int64_t(kRowAlign) * (w.local_experts + shared);
  w.rows_cap = int((rows + 127) / 128 * 128);
  if (w.rows_cap == 0) w.rows_cap = 128;
  w.units_cap = w.local_experts + shared + int(rows / 8);
  w.inter_pitch = std::max(s.inter, s.shared_inter());
  w.router_partials = kRouterGroups;
  RegionPlanner plan(1024);
  auto place = [&](Region& r, size_t bytes) { plan.place(r, bytes); };
  const size_t T = std::max(1, max_tokens), K = s.topk, H = s.hidden, E = s.experts, R = w.rows_cap;
  place(w.counters, size_t(w.counter_count()) * 4);
  place(w.logits_partial, size_t(w.router_partials) * T * E * 4);
  place(w.topk_ids, T * K * 4);
  place(w.topk_weights, T * K * 4);
  place(w.topk_pos, T * K * 4);
  place(w.x_sorted, R * H);
  place(w.x_sorted_scale, (H / 128) * R * 4);
  place(w.row_weight, R * 4);
  place(w.act2, R * size_t(w.inter_pitch));
  place(w.act2_scale, size_t(w.inter_pitch / num::kInterGroup) * R * 4);
  place(w.y_rows, R * H * 2);
  place(w.row_src, R * 4);
  place(w.ep_state, 16);
  place(w.token_status, TokenCountStatus::kWords * 4);
  w.total_bytes = plan.total();
  return w;
}

std::string EpStatus::message() const {
  if (phase == kNone) return "ok";
  const char* what = phase == kCounts    ? "the dispatch counts"
                     : phase == kCombine ? "the combine results"
                                         : "its own CTAs at a grid barrier";
  return "expert-parallel timeout: rank " + std::to_string(rank) + " waited for " + what +
         (phase == kBarrier ? std::string() : " of rank " + std::to_string(peer)) +
         " (a peer that never launched or failed; the group was reset)";
}

namespace {

// ============================================================================
// Host side: tensor maps and the plan
// ============================================================================
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                                   CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                   CUtensorMapFloatOOBfill);

EncodeTiledFn encode_fn() {
  static EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    MEGAMOE_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
    MEGAMOE_CHECK(q == cudaDriverEntryPointSuccess && p, "cuTensorMapEncodeTiled not found in the driver");
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

CUtensorMap make_map(const char* what, CUtensorMapDataType dtype, int rank, const void* base,
                     std::initializer_list<uint64_t> dims, std::initializer_list<uint64_t> strides_bytes,
                     std::initializer_list<uint32_t> box, CUtensorMapSwizzle swizzle,
                     CUtensorMapL2promotion promo = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  CUtensorMap m{};
  cuuint64_t d[5], s[4];
  cuuint32_t b[5], es[5];
  int i = 0;
  for (auto v : dims) d[i++] = v;
  i = 0;
  for (auto v : strides_bytes) s[i++] = v;
  i = 0;
  for (auto v : box) b[i++] = v;
  for (int k = 0; k < 5; ++k) es[k] = 1;
  const CUresult r =
      encode_fn()(&m, dtype, cuuint32_t(rank), const_cast<void*>(base), d, s, b, es,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promo, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(std::string("cuTensorMapEncodeTiled failed for ") + what + " (CUresult " +
                             std::to_string(int(r)) + ")");
  return m;
}

int block_n_index(int bn) {
  for (int i = 0; i < kNumBlockNs; ++i)
    if (kBlockNs[i] == bn) return i;
  throw std::invalid_argument("fused_moe: unsupported block_n " + std::to_string(bn) +
                              " (8, 16, 32, 48, 64, 128)");
}

__global__ void set_int_kernel(int* p, int v) { *p = v; }

template <int BN>
void set_smem_attr() {
  MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(fused_moe_kernel<BN, false>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes(BN)));
  MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(fused_moe_kernel<BN, true>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes(BN)));
  if constexpr (BN == 128 || BN <= kDecodePairsMaxBlockN)
    MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(fused_moe_kernel<BN, false, true>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes(BN)));
  if constexpr (BN == 128) {
    MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(fused_moe_kernel<128, false, false, true>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            smem_bytes(128, true)));
    MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(fused_moe_kernel<128, true, false, true>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            smem_bytes(128, true)));
  }
}

// A fused kernel's launch: pair tiles and decode pairs in clusters of two CTAs along x
// (cluster rank = blockIdx.x % 2); programmatic: the CTAs may start while route_topk runs.
struct FusedLaunch {
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[2]{};
  FusedLaunch(int grid, int smem, bool cluster_pairs, bool programmatic, cudaStream_t stream) {
    cfg.gridDim = dim3(grid), cfg.blockDim = dim3(kThreads), cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    if (cluster_pairs) {
      cudaLaunchAttribute& c = attr[cfg.numAttrs++];
      c.id = cudaLaunchAttributeClusterDimension;
      c.val.clusterDim.x = 2, c.val.clusterDim.y = 1, c.val.clusterDim.z = 1;
    }
    if (programmatic) attr[cfg.numAttrs++] = sm90::programmatic_serialization();
  }
  template <typename Kernel>
  void operator()(Kernel kernel, const KernelArgs& args, const TensorMaps& maps) {
    MEGAMOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args, maps));
  }
};

template <int BN>
void launch_fused(const KernelArgs& args, const TensorMaps& maps, int grid, const FusedMoeConfig& cfg,
                  cudaStream_t stream) {
  const bool pdl = cfg.programmatic_launch;
  if constexpr (BN == 128) {
    if (cfg.wide_tiles) {
      FusedLaunch launch(grid, smem_bytes(128, true), false, pdl, stream);
      if (args.ep.ranks)
        launch(fused_moe_kernel<128, true, false, true>, args, maps);
      else
        launch(fused_moe_kernel<128, false, false, true>, args, maps);
      return;
    }
  }
  if constexpr (BN == 128 || BN <= kDecodePairsMaxBlockN) {
    if (BN == 128 ? cfg.pair_tiles : cfg.decode_pairs) {
      FusedLaunch(grid, smem_bytes(BN), true, pdl, stream)(fused_moe_kernel<BN, false, true>, args, maps);
      return;
    }
  }
  FusedLaunch launch(grid, smem_bytes(BN), false, pdl, stream);
  if (args.ep.ranks)
    launch(fused_moe_kernel<BN, true>, args, maps);
  else
    launch(fused_moe_kernel<BN, false>, args, maps);
}

// The SM of each CTA of a plain launch of one CTA an SM (the fused kernel's threads and its
// widest shared memory), into sm[blockIdx.x]: the placement schedule_unit's table keeps.
__global__ void __launch_bounds__(kThreads, 1) sm_probe_kernel(uint32_t* sm) {
  if (threadIdx.x == 0) sm[blockIdx.x] = sm90::smid();
}

// FusedMoePlan's unit table (KernelArgs::sm_unit): the probe twice on a stream of its own.
// A plain launch on an idle GPU walks the SMs in one fixed cyclic order, starting a few SMs
// further on at each launch (bench/probes/placement_probe.cu shows it),
// and puts blockIdx 2k, 2k + 1 on the two SMs of one TPC. So the table is the first run's
// order (any other run's is the same order turned) where both runs pass sm_unit_table's
// checks (tile_schedule.h). Anything else (another stream's kernels moving the CTAs, SM ids
// past the table, another pairing) leaves it off: false (MEGAMOE_PRINT_CONFIG=1 says why).
bool probe_sm_units_now(int grid, uint8_t (&table)[kSmUnitSlots], bool print_config) {
  if (!sm_unit_grid_ok(grid, kNoSmUnit)) return false;
  const int smem = smem_bytes(128, true);
  // (a plan may be made while another thread captures a graph: this thread's calls below stay
  // legal in the relaxed capture mode, restored on the way out)
  struct RelaxedCapture {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    RelaxedCapture() { MEGAMOE_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode)); }
    ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode); }
  } relaxed;
  MEGAMOE_CUDA_CHECK(
      cudaFuncSetAttribute(sm_probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  uint32_t* d_sm = nullptr;
  cudaStream_t st = nullptr;
  MEGAMOE_CUDA_CHECK(cudaMalloc(&d_sm, size_t(grid) * 2 * sizeof(uint32_t)));
  MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (int run = 0; run < 2; ++run) {
    sm_probe_kernel<<<grid, kThreads, smem, st>>>(d_sm + run * grid);
    MEGAMOE_CUDA_CHECK_LAUNCH();
  }
  std::vector<uint32_t> sm(size_t(grid) * 2);
  MEGAMOE_CUDA_CHECK(
      cudaMemcpyAsync(sm.data(), d_sm, sm.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost, st));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(st));
  MEGAMOE_CUDA_CHECK(cudaStreamDestroy(st));
  MEGAMOE_CUDA_CHECK(cudaFree(d_sm));
  for (int run = 1; run >= 0; --run) {  // (run 0's table stays)
    const uint32_t* r = sm.data() + size_t(run) * grid;
    const int bad = sm_unit_table(r, grid, table, kSmUnitSlots, kNoSmUnit);
    if (bad >= 0) {
      if (print_config)
        std::fprintf(stderr,
                     "megamoe: no unit table: probe run %d put blockIdx %d on SM %u (an SM twice, past the "
                     "table or off its pair's TPC)\n",
                     run, bad, r[bad]);
      return false;
    }
  }
  return true;
}

// The table of the current device, probed once a process where it held (a property of the
// card, not of the plan: a model's layers each make a plan); a probe that found no table is
// tried again by the next plan (the GPU may have been busy).
// (grid: the card's SMs, the only grid the plan probes for)
bool probe_sm_units(int grid, uint8_t (&table)[kSmUnitSlots], bool print_config) {
  struct Found {
    uint8_t table[kSmUnitSlots];
  };
  static std::mutex mu;
  static std::map<int, Found> found;  // by device
  int dev = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard<std::mutex> lock(mu);
  auto it = found.find(dev);
  if (it == found.end()) {
    Found f;
    if (!probe_sm_units_now(grid, f.table, print_config)) {
      std::fill(std::begin(table), std::end(table), kNoSmUnit);
      return false;
    }
    it = found.emplace(dev, f).first;
  }
  std::copy(std::begin(it->second.table), std::end(it->second.table), std::begin(table));
  return true;
}

}  // namespace

struct FusedMoePlan {
  MoeShape shape;
  MoeWorkspaceLayout ws;
  MoeWeightsView w;
  void* workspace = nullptr;
  ConfigInputs inputs;  // every decision's inputs but the token count (resolve_config)
  int num_sms = 0;      // the persistent grid (resolve_grid)
  TensorMaps maps[kNumBlockNs];
  KernelArgs args{};
};

namespace {

// ---- fused_moe_plan_create's steps, in the order it takes them ----

// The shape, workspace and expert-parallel rank the kernel is built for.
void check_plan_inputs(const MoeShape& s, const MoeWorkspaceLayout& ws, const EpRank* ep) {
  s.validate();
  MEGAMOE_CHECK(s.hidden % 128 == 0, "fused_moe needs H % 128 == 0");
  MEGAMOE_CHECK(s.inter % 128 == 0, "fused_moe needs I % 128 == 0");
  MEGAMOE_CHECK(s.experts + (s.has_shared() ? 1 : 0) <= kMaxExpertsTotal,
                "fused_moe supports at most 511 experts");
  MEGAMOE_CHECK(s.topk + (s.has_shared() ? 1 : 0) <= 32,
                "fused_moe supports at most 32 slots (top-k + shared)");
  MEGAMOE_CHECK((ep != nullptr) == (ws.ep_ranks > 0),
                "fused_moe: the workspace was sized for " + std::to_string(ws.ep_ranks) +
                    " expert-parallel ranks but the plan is " + (ep ? "" : "not ") + "expert parallel");
  if (ep) {
    const EpLayout& l = ep->layout;
    MEGAMOE_CHECK(l.ranks == ws.ep_ranks && l.local_experts == ws.local_experts && l.topk == s.topk &&
                      l.hidden == s.hidden && l.max_tokens == ws.max_tokens,
                  "fused_moe: the expert-parallel layout does not match the shape and workspace");
    MEGAMOE_CHECK(ep->rank >= 0 && ep->rank < l.ranks, "fused_moe: rank out of range");
    MEGAMOE_CHECK(ep->timeout_s > 0, "fused_moe: the expert-parallel timeout must be > 0");
    for (int q = 0; q < l.ranks; ++q)
      MEGAMOE_CHECK(ep->peer_base[q] != nullptr, "fused_moe: no buffer for peer rank " + std::to_string(q));
  }
}

// The tensor maps of every block_n: the weights' (shared by all) and the workspace's
// activations (their box depends on block_n).
void make_tensor_maps(const MoeShape& s, const MoeWeightsView& w, const MoeWorkspaceLayout& ws, uint8_t* base,
                      TensorMaps (&maps)[kNumBlockNs]) {
  const uint64_t H = s.hidden, I = s.inter, E = ws.local_experts, Is = s.shared_inter(), R = ws.rows_cap;
  const uint64_t P = ws.inter_pitch;
  TensorMaps wm{};
  // The weight maps' L2 promotion (kWeightL2PromotionBytes, heuristics.h).
  static_assert(kWeightL2PromotionBytes == 128 || kWeightL2PromotionBytes == 256, "L2 promotion");
  const CUtensorMapL2promotion wpromo = kWeightL2PromotionBytes == 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                                                       : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  // w13 viewed as [E][group I/8][gate or up 2][row 8][H]: a box {128, 8, 2, 8, 1} is 64 gate and 64 up
  // rows interleaved by 8 (gate 0-7, up 0-7, gate 8-15, ...), 16 KB; `groups` = 4 is a pair's part of
  // it (a pair sharing its weights: each CTA loads its part of the tile for both). w2 [E][H][inter], boxes
  // of `rows` rows (128, or 64 for a pair's part).
  auto w13_map = [&](const char* what, const void* p, uint64_t inter, uint64_t experts, uint32_t groups) {
    return make_map(what, CU_TENSOR_MAP_DATA_TYPE_UINT8, 5, p, {H, 8, 2, inter / 8, experts},
                    {H, inter * H, 8 * H, 2 * inter * H}, {128, 8, 2, groups, 1}, CU_TENSOR_MAP_SWIZZLE_128B,
                    wpromo);
  };
  auto w2_map = [&](const char* what, const void* p, uint64_t inter, uint64_t experts, uint32_t rows) {
    return make_map(what, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, p, {inter, H, experts}, {inter, H * inter},
                    {128, rows, 1}, CU_TENSOR_MAP_SWIZZLE_128B, wpromo);
  };
  wm.w13 = w13_map("w13", w.w13, I, E, 8);
  wm.w2 = w2_map("w2", w.w2, I, E, 128);
  wm.w13_part = w13_map("w13 (pair part)", w.w13, I, E, 4);
  wm.w2_part = w2_map("w2 (pair part)", w.w2, I, E, 64);
  // Wide tiles: two output blocks (I % 128 == 0, so 16 groups always fit; with an odd H / 128
  // the w2 box is never used: wide_ok below needs every GEMM's output blocks in pairs).
  wm.w13w = w13_map("w13 (wide)", w.w13, I, E, 16);
  wm.w2w = w2_map("w2 (wide)", w.w2, I, E, uint32_t(std::min<uint64_t>(256, H)));
  if (s.has_shared()) {
    MEGAMOE_CHECK(Is % 128 == 0, "fused_moe needs the shared intermediate % 128 == 0");
    wm.sw13 = w13_map("shared_w13", w.shared_w13, Is, 1, 8);
    wm.sw2 = w2_map("shared_w2", w.shared_w2, Is, 1, 128);
    wm.sw13_part = w13_map("shared_w13 (pair part)", w.shared_w13, Is, 1, 4);
    wm.sw2_part = w2_map("shared_w2 (pair part)", w.shared_w2, Is, 1, 64);
    wm.sw13w = w13_map("shared_w13 (wide)", w.shared_w13, Is, 1, 16);
    wm.sw2w = w2_map("shared_w2 (wide)", w.shared_w2, Is, 1, uint32_t(std::min<uint64_t>(256, H)));
  } else {
    wm.sw13 = wm.w13;
    wm.sw2 = wm.w2;
    wm.sw13_part = wm.w13_part;
    wm.sw2_part = wm.w2_part;
    wm.sw13w = wm.w13w;
    wm.sw2w = wm.w2w;
  }
  for (int i = 0; i < kNumBlockNs; ++i) {
    const uint32_t bn = kBlockNs[i];
    TensorMaps m = wm;
    m.x = make_map("x_sorted", CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base + ws.x_sorted.offset, {H, R}, {H},
                   {128, bn}, CU_TENSOR_MAP_SWIZZLE_128B);
    m.xs = make_map("x_sorted_scale", CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, base + ws.x_sorted_scale.offset,
                    {R, H / 128}, {R * 4}, {bn, 1}, CU_TENSOR_MAP_SWIZZLE_NONE);
    m.a2 = make_map("act2", CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base + ws.act2.offset, {P, R}, {P}, {128, bn},
                    CU_TENSOR_MAP_SWIZZLE_128B);
    m.a2s = make_map("act2_scale", CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, base + ws.act2_scale.offset,
                     {R, P / num::kInterGroup}, {R * 4}, {bn, 1}, CU_TENSOR_MAP_SWIZZLE_NONE);
    if (bn == 128) {
      m.x_part = make_map("x_sorted (pair part)", CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base + ws.x_sorted.offset,
                          {H, R}, {H}, {128, 64}, CU_TENSOR_MAP_SWIZZLE_128B);
      m.a2_part = make_map("act2 (pair part)", CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base + ws.act2.offset,
                           {P, R}, {P}, {128, 64}, CU_TENSOR_MAP_SWIZZLE_128B);
    }
    maps[i] = m;
  }
}

// Every kernel instantiation may take its shared memory (cudaFuncSetAttribute once a plan).
void set_smem_attrs() {
  set_smem_attr<8>();
  set_smem_attr<16>();
  set_smem_attr<32>();
  set_smem_attr<48>();
  set_smem_attr<64>();
  set_smem_attr<128>();
}

// Whether the card holds the grid's clusters of two CTAs at once (CardInfo::clusters_resident;
// the kernel's grid barrier waits for every CTA), asked of each cluster kernel the shape could
// take (resolve_config's rule for pair tiles and decode pairs).
bool clusters_resident(int grid, const MoeShape& s, const EpRank* ep) {
  const bool even_h = (s.hidden / 128) % 2 == 0;
  const bool even_blocks = even_h && (s.inter / 128) % 2 == 0 && (s.shared_inter() / 128) % 2 == 0;
  auto resident = [&](int bn, auto kernel) {
    FusedLaunch l(grid, smem_bytes(bn), true, false, nullptr);
    int clusters = 0;
    MEGAMOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &l.cfg));
    return 2 * clusters >= grid;
  };
  bool ok = true;
  if (!ep && grid % 2 == 0) {
    if (even_blocks) ok = ok && resident(128, fused_moe_kernel<128, false, true>);
    if (even_h) {
      ok = ok && resident(8, fused_moe_kernel<8, false, true>);
      ok = ok && resident(16, fused_moe_kernel<16, false, true>);
    }
  }
  static_assert(kDecodePairsMaxBlockN == 16, "the decode pair kernels: block_n 8 and 16");
  return ok;
}

// The kernel's shape arguments.
void set_shape_args(KernelArgs& a, const MoeShape& s, const MoeWorkspaceLayout& ws) {
  a.H = s.hidden, a.I = s.inter, a.Is = s.shared_inter(), a.E = ws.local_experts, a.K = s.topk;
  a.n1 = a.I / 128, a.n1s = a.Is / 128, a.n2 = a.H / 128;
  a.units_base = MoeWorkspaceLayout::kCounterExperts + ws.experts_total;
  a.has_shared = s.has_shared() ? 1 : 0;
  a.rows_cap = ws.rows_cap, a.inter_pitch = ws.inter_pitch;
  a.swiglu_limit = s.swiglu_limit;
}

// The kernel's workspace and weight-scale pointers.
void set_buffer_args(KernelArgs& a, const MoeWeightsView& w, const MoeWorkspaceLayout& ws, uint8_t* base) {
  a.counters = reinterpret_cast<int*>(base + ws.counters.offset);
  a.topk_ids = reinterpret_cast<const int*>(base + ws.topk_ids.offset);
  a.topk_weights = reinterpret_cast<const float*>(base + ws.topk_weights.offset);
  a.topk_pos = reinterpret_cast<const int*>(base + ws.topk_pos.offset);
  a.x_sorted = base + ws.x_sorted.offset;
  a.x_sorted_scale = reinterpret_cast<float*>(base + ws.x_sorted_scale.offset);
  a.row_weight = reinterpret_cast<float*>(base + ws.row_weight.offset);
  a.act2 = base + ws.act2.offset;
  a.act2_scale = reinterpret_cast<float*>(base + ws.act2_scale.offset);
  a.y_rows = reinterpret_cast<uint16_t*>(base + ws.y_rows.offset);
  a.row_src = reinterpret_cast<int32_t*>(base + ws.row_src.offset);
  a.w13_scale = w.w13_scale, a.w2_scale = w.w2_scale;
  a.sw13_scale = w.shared_w13_scale, a.sw2_scale = w.shared_w2_scale;
  // [0] the forward count (route_logits bumps it; expert parallelism's epoch,
  // DebugArgs::unit_turn), [1] expert parallelism's status: EpArgs::state is the same words.
  a.epoch = reinterpret_cast<uint64_t*>(base + ws.ep_state.offset);
}

// The status words (zeroed unless another plan of the group owns them) and the rank's
// expert-parallel arguments.
void init_state_and_ep(KernelArgs& a, const MoeShape& s, const MoeWorkspaceLayout& ws, uint8_t* base,
                       const EpRank* ep) {
  if (!ep || ep->init_state) {
    MEGAMOE_CUDA_CHECK(cudaMemset(base + ws.token_status.offset, 0, ws.token_status.bytes));  // (poisoned)
    MEGAMOE_CUDA_CHECK(cudaMemset(a.epoch, 0, ws.ep_state.bytes));  // epoch 0, status fine
  }
  if (ep) {
    EpArgs& e = a.ep;
    e.ranks = ep->layout.ranks;
    e.rank = ep->rank;
    e.E_route = s.experts;
    e.timeout_ns = uint64_t(ep->timeout_s * 1e9);
    e.l = ep->layout;
    for (int q = 0; q < e.ranks; ++q) e.peer[q] = ep->peer_base[q];
    e.state = a.epoch;
  }
}

// The card's figures (CardInfo) but what the plan finds by running kernels on it.
CardInfo read_card() {
  int dev = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
  CardInfo c;
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&c.sms, cudaDevAttrMultiProcessorCount, dev));
  MEGAMOE_CUDA_CHECK(
      cudaDeviceGetAttribute(&c.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  c.read_gbps_per_sm = device_read_gbps_per_sm(dev);
  return c;
}

}  // namespace

FusedMoePlan* fused_moe_plan_create(const MoeShape& s, const MoeWeightsView& w, const MoeWorkspaceLayout& ws,
                                    void* workspace, const FusedMoeConfig& cfg, const Overrides& switches,
                                    const EpRank* ep) {
  check_plan_inputs(s, ws, ep);
  auto plan = std::make_unique<FusedMoePlan>();
  plan->shape = s;
  plan->ws = ws;
  plan->w = w;  // (under expert parallelism the rank's experts, and every expert's router)
  plan->workspace = workspace;
  auto* base = static_cast<uint8_t*>(workspace);
  ConfigInputs& in = plan->inputs;
  in.shape = s;
  in.ep_ranks = ws.ep_ranks;
  in.grid_cap = cfg.num_sms;
  in.card = read_card();
  in.switches = switches;
  plan->num_sms = resolve_grid(in);

  make_tensor_maps(s, w, ws, base, plan->maps);
  // The router kernels address x and the router weight with 32-bit element offsets.
  const int64_t route_elems = std::max<int64_t>(ws.max_tokens, s.experts) * s.hidden;
  MEGAMOE_CHECK(route_elems < (int64_t(1) << 31),
                "max(max_tokens, experts) * hidden = " + std::to_string(route_elems) +
                    " exceeds the routing's 32-bit offsets (at most 2^31 - 1): use a smaller max_tokens");
  route_prepare();
  set_smem_attrs();
  in.card.clusters_resident = clusters_resident(plan->num_sms, s, ep);
  KernelArgs& a = plan->args;
  set_shape_args(a, s, ws);
  a.debug = resolve_debug(in);
  // The schedule's units by SM: the card's order, probed where the configuration may use it.
  in.card.sm_unit_table =
      sm_units_wanted(in) && probe_sm_units(plan->num_sms, a.sm_unit, switches.print_config);
  a.ep_overlap = resolve_config(in, 0).ep_overlap ? 1 : 0;
  set_buffer_args(a, w, ws, base);
  init_state_and_ep(a, s, ws, base, ep);
  return plan.release();
}

void fused_moe_plan_destroy(FusedMoePlan* plan) { delete plan; }

void fused_moe_print_profile(int tokens) {
#ifdef MEGAMOE_PROFILE
  static uint32_t h[kProfCtas][kPfSlots];
  MEGAMOE_CUDA_CHECK(cudaMemcpyFromSymbol(h, g_profile, sizeof(h)));
  double sum[kPfSlots] = {}, mx[kPfSlots] = {};
  int n = 0;
  for (int c = 0; c < kProfCtas; ++c) {
    if (h[c][kPfTotal] == 0) continue;
    ++n;
    for (int i = 0; i < kPfSlots; ++i) sum[i] += h[c][i], mx[i] = std::max(mx[i], double(h[c][i]));
  }
  if (n == 0) return;
  auto pct = [&](int i, int of) { return 100.0 * sum[i] / sum[of]; };
  const double loop_rest = sum[kPfLoop] - sum[kPfFullWait] - sum[kPfMmaWait];
  const double epilogues = sum[kPfTile] - sum[kPfTileStart] - sum[kPfLoop];
  std::fprintf(
      stderr,
      "megamoe profile T=%d (%d CTAs, consumer thread 0): total %.0f kcyc (max %.0f); phase0 %.1f%%, "
      "tile start %.1f%%, K loops %.1f%% (data wait %.1f%%, wgmma wait %.1f%%, issue+fold %.1f%%), "
      "epilogues %.1f%% (GEMM1 %.1f%% + proxy fence %.1f%%, GEMM2 %.1f%%, slot waits %.1f%%), combine %.1f%% "
      "(waiting for the last GEMM2 tile %.1f%%); %.0f stages, %.0f tiles a CTA; wgmma issue %.1f%% | "
      "producer: empty wait %.1f%%, dependency wait %.1f%% of %.0f kcyc\n",
      tokens, n, sum[kPfTotal] / n * 1e-3, mx[kPfTotal] * 1e-3, pct(kPfPhase0, kPfTotal),
      pct(kPfTileStart, kPfTotal), pct(kPfLoop, kPfTotal), pct(kPfFullWait, kPfTotal),
      pct(kPfMmaWait, kPfTotal), 100.0 * loop_rest / sum[kPfTotal], 100.0 * epilogues / sum[kPfTotal],
      pct(kPfEpi1, kPfTotal), pct(kPfFence, kPfTotal), pct(kPfEpi2, kPfTotal), pct(kPfSlotWait, kPfTotal),
      pct(kPfCombine, kPfTotal), pct(kPfDone2, kPfTotal), sum[kPfStages] / n, sum[kPfTiles] / n,
      pct(kPfIssue, kPfTotal), pct(kPfProdEmpty, kPfProdTotal), pct(kPfProdDep, kPfProdTotal),
      sum[kPfProdTotal] / n * 1e-3);
  // Phase 0 by part, and the launch on the global timer (ns, relative to the first CTA's start).
  uint32_t first = 0;
  bool have = false;
  for (int c = 0; c < kProfCtas; ++c)
    if (h[c][kPfTotal] != 0 && (!have || int32_t(h[c][kPfStartNs] - first) < 0))
      first = h[c][kPfStartNs], have = true;
  double start_max = 0, arrive_min = 1e30, arrive_max = 0, pass_max = 0;
  for (int c = 0; c < kProfCtas; ++c) {
    if (h[c][kPfTotal] == 0) continue;
    start_max = std::max(start_max, double(int32_t(h[c][kPfStartNs] - first)));
    arrive_min = std::min(arrive_min, double(int32_t(h[c][kPfArriveNs] - first)));
    arrive_max = std::max(arrive_max, double(int32_t(h[c][kPfArriveNs] - first)));
    pass_max = std::max(pass_max, double(int32_t(h[c][kPfPassNs] - first)));
  }
  std::fprintf(stderr,
               "megamoe profile T=%d phase 0: tables %.1f%%, tasks %.1f%%, grid barrier %.1f%% of the total; "
               "global timer from the first CTA's start: last start %.2f us, arrivals %.2f..%.2f us, last "
               "leaves %.2f us\n",
               tokens, pct(kPfSched, kPfTotal), pct(kPfTasks, kPfTotal),
               100.0 * (sum[kPfPhase0] - sum[kPfSched] - sum[kPfTasks]) / sum[kPfTotal], start_max * 1e-3,
               arrive_min * 1e-3, arrive_max * 1e-3, pass_max * 1e-3);
#else
  (void)tokens;
#endif
}

void set_device_int(int* p, int v, cudaStream_t stream) {
  set_int_kernel<<<1, 1, 0, stream>>>(p, v);
  MEGAMOE_CUDA_CHECK_LAUNCH();
}

EpStatus ep_status(const FusedMoePlan* p) {
  EpStatus st;
  if (!p->args.ep.ranks) return st;
  uint64_t code = 0;
  MEGAMOE_CUDA_CHECK(cudaMemcpy(&code, p->args.ep.state + 1, sizeof(code), cudaMemcpyDeviceToHost));
  return EpStatus::decode(code);
}

void ep_reset(const FusedMoePlan* p) {
  const EpArgs& e = p->args.ep;
  if (!e.ranks) return;
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  MEGAMOE_CUDA_CHECK(cudaMemset(e.state, 0, 2 * sizeof(uint64_t)));
  MEGAMOE_CUDA_CHECK(cudaMemset(e.peer[e.rank] + e.l.signals.offset, 0, e.l.signals.bytes));
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
}

std::string TokenCountStatus::message() const {
  if (bad_forwards == 0) return {};
  return std::to_string(bad_forwards) + " forward" + (bad_forwards == 1 ? "" : "s") +
         " read a device token count outside [0, tokens_hint] (the last: " + std::to_string(last_count) +
         " with tokens_hint " + std::to_string(last_hint) + "); the kernels clamped it, so " +
         (last_count < 0 ? "no token was computed" : "the tokens past the hint were not computed");
}

TokenCountStatus token_count_take(const FusedMoePlan* p) {
  uint8_t* words = static_cast<uint8_t*>(p->workspace) + p->ws.token_status.offset;
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  int w[RoutingIdStatus::kFirstWord];  // (this record's words only: the routing's stays)
  MEGAMOE_CUDA_CHECK(cudaMemcpy(w, words, sizeof(w), cudaMemcpyDeviceToHost));
  if (w[0] != 0) {
    MEGAMOE_CUDA_CHECK(cudaMemset(words, 0, sizeof(w)));
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return {w[0], w[1], w[2]};
}

std::string RoutingIdStatus::message() const {
  if (bad_ids == 0) return {};
  return "topk_ids: " + std::to_string(bad_ids) + " id" + (bad_ids == 1 ? "" : "s") + " outside [0, " +
         std::to_string(experts) + ") (the first: token " + std::to_string(first_token) + " slot " +
         std::to_string(first_slot) + " = " + std::to_string(first_value) +
         "); each was computed as expert 0 with weight 0";
}

RoutingIdStatus routing_ids_take(const FusedMoePlan* p) {
  static_assert(TokenCountStatus::kWords >= RoutingIdStatus::kFirstWord + 5, "the status region's words");
  uint8_t* words =
      static_cast<uint8_t*>(p->workspace) + p->ws.token_status.offset + RoutingIdStatus::kFirstWord * 4;
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  int w[5];
  MEGAMOE_CUDA_CHECK(cudaMemcpy(w, words, sizeof(w), cudaMemcpyDeviceToHost));
  if (w[0] != 0) {
    MEGAMOE_CUDA_CHECK(cudaMemset(words, 0, sizeof(w)));
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  RoutingIdStatus st;
  st.bad_ids = w[0], st.first_token = w[1], st.first_slot = w[2];
  st.first_value = int64_t(uint64_t(uint32_t(w[3])) | (uint64_t(uint32_t(w[4])) << 32));
  st.experts = p->shape.experts;
  return st;
}

RoutingOutputs routing_outputs(const FusedMoePlan* p) {
  auto* base = static_cast<const uint8_t*>(p->workspace);
  return {reinterpret_cast<const int32_t*>(base + p->ws.topk_ids.offset),
          reinterpret_cast<const float*>(base + p->ws.topk_weights.offset)};
}

FusedMoeConfig fused_moe_config(const FusedMoePlan* p, int tokens) {
  return resolve_config(p->inputs, tokens);
}

FusedMoeConfig fused_moe_config(const FusedMoePlan* p, int tokens, const Overrides& switches) {
  return resolve_config(with_forward_switches(p->inputs, switches), tokens);
}

namespace {

// The routing's two kernels (programmatic: route_topk as a programmatic dependent, the
// forward's FusedMoeConfig::programmatic_launch).
void launch_routing(const FusedMoePlan* p, const DeviceTensors& t, int host_tokens_hint, bool programmatic,
                    std::optional<RouteTile> route_tile, cudaStream_t stream) {
  auto* base = static_cast<uint8_t*>(p->workspace);
  RouteArgs r;
  r.zero = reinterpret_cast<int*>(base + p->ws.counters.offset);
  r.zero_words = p->ws.counter_count();
  r.x = t.x;
  r.router = p->w.router;
  r.bias = p->shape.correction_bias ? p->w.bias : nullptr;
  r.num_tokens = t.num_tokens;
  r.tokens_cap = host_tokens_hint;
  r.token_status = reinterpret_cast<int*>(base + p->ws.token_status.offset);
  r.partial = reinterpret_cast<float*>(base + p->ws.logits_partial.offset);
  r.ids = reinterpret_cast<int32_t*>(base + p->ws.topk_ids.offset);
  r.weights = reinterpret_cast<float*>(base + p->ws.topk_weights.offset);
  r.pos = reinterpret_cast<int32_t*>(base + p->ws.topk_pos.offset);
  r.expert_counts =
      reinterpret_cast<int*>(base + p->ws.counters.offset) + MoeWorkspaceLayout::kCounterExperts;
  r.max_tokens = p->ws.max_tokens;
  r.epoch = p->args.epoch;  // one epoch per forward (ep_state[0])
  launch_route(p->shape, r, host_tokens_hint, p->num_sms, programmatic, route_tile, stream);
}

// route_external in place of the routing's two kernels: the same words written.
void launch_external_routing(const FusedMoePlan* p, const DeviceTensors& t, int host_tokens_hint,
                             const ExternalRouting& in, cudaStream_t stream) {
  MEGAMOE_CHECK(p->args.ep.ranks == 0, "fused_moe: external routing is single-device only");
  MEGAMOE_CHECK(in.id_bytes == 4 || in.id_bytes == 8, "internal: the API layer checks id_bytes");
  MEGAMOE_CHECK(host_tokens_hint == 0 || (in.ids && in.weights),
                "fused_moe: external routing without ids or weights");
  auto* base = static_cast<uint8_t*>(p->workspace);
  RouteExternalArgs r;
  r.in_ids = in.ids;
  r.in_ids_64 = in.id_bytes == 8;
  r.in_weights = in.weights;
  r.num_tokens = t.num_tokens;
  r.tokens_cap = host_tokens_hint;
  r.token_status = reinterpret_cast<int*>(base + p->ws.token_status.offset);
  r.id_status = r.token_status + RoutingIdStatus::kFirstWord;
  r.ids = reinterpret_cast<int32_t*>(base + p->ws.topk_ids.offset);
  r.weights = reinterpret_cast<float*>(base + p->ws.topk_weights.offset);
  r.pos = reinterpret_cast<int32_t*>(base + p->ws.topk_pos.offset);
  r.zero = reinterpret_cast<int*>(base + p->ws.counters.offset);
  r.zero_words = p->ws.counter_count();
  r.expert_counts = r.zero + MoeWorkspaceLayout::kCounterExperts;
  r.epoch = p->args.epoch;
  launch_route_external(p->shape, r, stream);
}

// The routing (the layer's router, or the caller's: `routing` non-null), then the fused kernel.
void forward_impl(const FusedMoePlan* p, const DeviceTensors& t, int host_tokens_hint, cudaStream_t stream,
                  const ExternalRouting* routing, const Overrides& switches) {
  MEGAMOE_CHECK(host_tokens_hint >= 0 && host_tokens_hint <= p->ws.max_tokens,
                "internal: the API layer bounds the token count by max_tokens");
  const ConfigInputs in = with_forward_switches(p->inputs, switches);
  const FusedMoeConfig cfg = resolve_config(in, host_tokens_hint);
  if (routing)
    launch_external_routing(p, t, host_tokens_hint, *routing, stream);
  else
    launch_routing(p, t, host_tokens_hint, cfg.programmatic_launch, in.switches.route_tile, stream);
  maybe_print_config(in, host_tokens_hint, cfg);
  KernelArgs a = p->args;
  a.half_tiles = cfg.half_tiles;
  a.sm_units = cfg.sm_units;
  a.tail_pool = cfg.tail_pool;
  a.pair_weights = cfg.pair_weights;  // (pair tiles only: resolve_config)
  a.num_tokens = t.num_tokens;
  a.tokens_cap = host_tokens_hint;
  a.x = t.x;
  a.y = t.y;
  const TensorMaps& maps = p->maps[block_n_index(cfg.block_n)];
  switch (cfg.block_n) {
    case 8: launch_fused<8>(a, maps, p->num_sms, cfg, stream); break;
    case 16: launch_fused<16>(a, maps, p->num_sms, cfg, stream); break;
    case 32: launch_fused<32>(a, maps, p->num_sms, cfg, stream); break;
    case 48: launch_fused<48>(a, maps, p->num_sms, cfg, stream); break;
    case 64: launch_fused<64>(a, maps, p->num_sms, cfg, stream); break;
    default: launch_fused<128>(a, maps, p->num_sms, cfg, stream); break;
  }
}

}  // namespace

void route_forward(const FusedMoePlan* p, const DeviceTensors& t, int host_tokens_hint, cudaStream_t stream,
                   const Overrides& switches) {
  const ConfigInputs in = with_forward_switches(p->inputs, switches);
  launch_routing(p, t, host_tokens_hint, resolve_config(in, host_tokens_hint).programmatic_launch,
                 in.switches.route_tile, stream);
}

void route_forward(const FusedMoePlan* p, const DeviceTensors& t, int host_tokens_hint, cudaStream_t stream) {
  route_forward(p, t, host_tokens_hint, stream, p->inputs.switches);
}

void fused_moe_forward(const FusedMoePlan* p, const DeviceTensors& t, int host_tokens_hint,
                       cudaStream_t stream, const Overrides& switches) {
  forward_impl(p, t, host_tokens_hint, stream, nullptr, switches);
}

void fused_moe_forward(const FusedMoePlan* p, const DeviceTensors& t, int host_tokens_hint,
                       cudaStream_t stream) {
  forward_impl(p, t, host_tokens_hint, stream, nullptr, p->inputs.switches);
}

void fused_moe_forward(const FusedMoePlan* p, const DeviceTensors& t, int host_tokens_hint,
                       cudaStream_t stream, const ExternalRouting& routing, const Overrides& switches) {
  forward_impl(p, t, host_tokens_hint, stream, &routing, switches);
}

void fused_moe_forward(const FusedMoePlan* p, const DeviceTensors& t, int host_tokens_hint,
                       cudaStream_t stream, const ExternalRouting& routing) {
  forward_impl(p, t, host_tokens_hint, stream, &routing, p->inputs.switches);
}

}  // namespace megamoe::kernels
