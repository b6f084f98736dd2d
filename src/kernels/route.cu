// Routing on the GPU. The router GEMM runs on the tensor cores (mma.sync BF16
// -> F32) from BF16 activations and BF16/F32 router weights; split-K partials
// are summed in a fixed order by the top-k kernel, so the logits (and thus ids
// and weights) are bit-identical from run to run and across tile configurations.
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <climits>
#include <cstdlib>
#include <string>

#include "cuda_check.h"
#include "heuristics.h"
#include "megamoe/kernels/fused_moe.h"
#include "megamoe/numerics/fp8.h"
#include "route.cuh"
#include "sm90_ptx.cuh"

namespace megamoe::kernels {
namespace {

// ============================================================================
// route_logits: partial[slice][t][e] = sum over the slice's columns of x[t][h] * w[e][h]
// ============================================================================
// x is BF16, so exact in the BF16 operand. A float32 router weight is split into
// three BF16 terms hi + mid + lo (each the nearest BF16 of what the previous ones
// leave), which carry the full 24-bit significand; all three products go into
// one float32 accumulator. For a BF16 router weight one term is exact.
// NOTE: every logit is the same float computation whatever the tile configuration:
// per K slice (kRouterSlices, fixed) two accumulators (even / odd 16-column steps),
// per step in ascending order mma(hi), mma(mid), mma(lo), the two added at the end;
// a group's kSlicesPerGroup slices summed in order (0 + s0 + s1 + ...) into one partial
// by the block, the groups summed in order by route_topk. A block covers one group:
// its WK warp slices run the group's slices side by side (the decode tile: a shorter
// dependent chain a warp) or one after the other (WK = 1). The tile shape (picked from the token hint)
// only changes which threads do the work, so a graph captured at a large hint replays bit-identically at any
// smaller count.
constexpr int kRouteStepK = 64;  // columns per pipeline stage
constexpr int kRoutePad = 8;     // row padding (elements): conflict-free fragment loads

template <typename WT>
struct RouterTerms;
template <>
struct RouterTerms<float> {
  static constexpr int kTerms = 3;
};
template <>
struct RouterTerms<uint16_t> {
  static constexpr int kTerms = 1;
};

// B fragments (k, k+1 and k+8, k+9 of one expert row) of every term.
__device__ __forceinline__ void router_b_frags(const float* w, uint32_t (&b)[3][2]) {
  const float2 p0 = *reinterpret_cast<const float2*>(w);
  const float2 p1 = *reinterpret_cast<const float2*>(w + 8);
  float rest[4] = {p0.x, p0.y, p1.x, p1.y};  // what the terms so far leave of the weights
#pragma unroll
  for (int term = 0; term < 3; ++term) {
    b[term][0] = num::bf16x2_encode(rest[0], rest[1]);
    b[term][1] = num::bf16x2_encode(rest[2], rest[3]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t packed = b[term][i / 2];
      // exact: the residual of a nearest-BF16 rounding
      rest[i] -= __uint_as_float(i % 2 == 0 ? packed << 16 : packed & 0xFFFF0000u);
    }
  }
}
__device__ __forceinline__ void router_b_frags(const uint16_t* w, uint32_t (&b)[1][2]) {
  b[0][0] = *reinterpret_cast<const uint32_t*>(w);
  b[0][1] = *reinterpret_cast<const uint32_t*>(w + 8);
}

// Block tile BT tokens x BE experts x one group of K slices; WK x WM x WN warps, each
// MI x NI fragments of 16 x 8 of one slice (warp slice wk takes slices wk, wk + WK, ...
// of the group); `kStages`-deep cp.async ring, a stage kRouteStepK columns of WK slices.
template <typename WT, int BT, int BE, int WK, int WM, int WN, int kStages>
__global__ void __launch_bounds__(WK* WM* WN * 32) route_logits_kernel(RouteArgs a, int H, int E) {
  constexpr int kThreads = WK * WM * WN * 32;
  // A group's slices side by side (one a warp slice) or one after the other (a running sum).
  static_assert(WK == 1 || WK == kSlicesPerGroup, "one warp slice, or one a slice");
  constexpr bool kSeq = WK == 1;
  constexpr int kRounds = kSeq ? kSlicesPerGroup : 1;  // slices a warp slice takes in turn
  constexpr int MI = BT / WM / 16, NI = BE / WN / 8;
  constexpr int kTerms = RouterTerms<WT>::kTerms;
  constexpr int XP = kRouteStepK + kRoutePad;  // x row pitch (bf16)
  constexpr int WP = kRouteStepK + kRoutePad;  // w row pitch (WT)
  constexpr int kXChunks = kRouteStepK * 2 / 16, kWChunks = kRouteStepK * int(sizeof(WT)) / 16;
  static_assert(MI * WM * 16 == BT && NI * WN * 8 == BE, "warp tiling");

  // route_topk may be scheduled now (it waits for this grid's end before its first read).
  sm90::launch_dependents();
  // The forward's counters (expert rows for route_topk's atomics, the fused kernel's
  // barrier and completion counts) are zeroed here, a slice per block, before any
  // block returns: one graph node fewer than a memset.
  {
    const int nblocks = gridDim.x * gridDim.y * gridDim.z;
    const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int per = (a.zero_words + nblocks - 1) / nblocks;
    const int end = min(a.zero_words, (b + 1) * per);
    for (int i = b * per + int(threadIdx.x); i < end; i += kThreads) a.zero[i] = 0;
    if (a.epoch && b == 0 && threadIdx.x == 0) *a.epoch += 1;
    if (b == 0 && threadIdx.x == 0) {
      const int raw = *a.num_tokens;
      if (raw < 0 || raw > a.tokens_cap) {  // a caller's bug, kept for CudaMoeLayer::check
        a.token_status[0] += 1;
        a.token_status[1] = raw;
        a.token_status[2] = a.tokens_cap;
      }
    }
  }
  const int T = device_token_count(a.num_tokens, a.tokens_cap);
  const int t0 = blockIdx.y * BT;
  if (t0 >= T) return;
  const int e0 = blockIdx.x * BE;
  const int hs = H / kRouterSlices;
  const int h_begin = blockIdx.z * kSlicesPerGroup * hs;
  const int slice_steps = (hs + kRouteStepK - 1) / kRouteStepK;
  const int steps = kRounds * slice_steps;
  const WT* W = static_cast<const WT*>(a.router);

  // A stage holds kRouteStepK columns of each of the WK slices: rows [WK][BT] of x and
  // [WK][BE] of W.
  extern __shared__ __align__(16) uint8_t route_smem[];
  auto* xs = reinterpret_cast<uint16_t*>(route_smem);                                 // [kStages][WK*BT][XP]
  auto* ws = reinterpret_cast<WT*>(route_smem + size_t(kStages) * WK * BT * XP * 2);  // [kStages][WK*BE][WP]

  const int tid = threadIdx.x;
  // This thread's 16-byte chunks: the same rows and column every stage (kThreads is a
  // multiple of the chunks a row), a stage moves the columns by kRouteStepK. Worked out
  // once: per stage and chunk they cost ~35 instructions (ncu: more than the mma
  // steps of the 16 x 16 tile). A stage row r of x is token r % BT of slice r / BT
  // (likewise for W); a thread's rows are r0 + j * RS, so its chunks are one element
  // offset from x / W plus j times a fixed step (T * H and E * H < 2^31,
  // fused_moe_plan_create), valid while the token (expert) is below T (E).
  constexpr int kPer = 16 / int(sizeof(WT));
  constexpr int kXPer = WK * BT * kXChunks / kThreads, kWPer = WK * BE * kWChunks / kThreads;
  static_assert(kXPer * kThreads == WK * BT * kXChunks && kWPer * kThreads == WK * BE * kWChunks &&
                    kThreads % kXChunks == 0 && kThreads % kWChunks == 0,
                "whole chunks a thread, one column per thread");
  const int xc = (tid % kXChunks) * 8, xr = tid / kXChunks;
  const int wc = (tid % kWChunks) * kPer, wr = tid / kWChunks;
  // Rows r0 + j * RS of a [WK][N] stage tile: either every j the same token of the next
  // slices (RS a multiple of N) or, in one slice, tokens RS apart (N a multiple of RS).
  struct Rows {
    int off0;  // element offset of row r0's chunk (column 0 of the block's group)
    int left;  // tokens (experts) valid from row r0 on, in steps of RS: j valid while j * RS < left
  };
  auto rows = [&](int r0, int N, int first, int count, int c) {
    const int idx = first + r0 % N;
    return Rows{idx * H + h_begin + (r0 / N) * hs + c, count - idx};
  };
  constexpr int kXRS = kThreads / kXChunks, kWRS = kThreads / kWChunks;
  static_assert(
      (kXRS % BT == 0 || (BT % kXRS == 0 && WK == 1)) && (kWRS % BE == 0 || (BE % kWRS == 0 && WK == 1)),
      "a thread's rows: one token of several slices, or several tokens of one slice");
  const Rows xrow = rows(xr, BT, t0, T, xc), wrow = rows(wr, BE, e0, E, wc);
  auto chunk = [&](const Rows& r, int j, int N, int RS, int& off) {
    if (RS % N == 0) {  // the same token, slice (r0 / N) + j * RS / N
      off = r.off0 + j * (RS / N) * hs;
      return r.left > 0;
    }
    off = r.off0 + j * RS * H;
    return j * RS < r.left;
  };
  // The next stage to load: round ld_round of the warp slices, step ld_step of their slices
  // (counted, not divided out of the step index: a division a stage cost the prefill tiles).
  int ld_round = 0, ld_step = 0;
  auto load_stage = [&](int slot) {
    const int c = ld_step * kRouteStepK;
    const int col = ld_round * WK * hs + c;
    if (++ld_step == slice_steps) ld_step = 0, ++ld_round;
    const bool x_in = c + xc < hs, w_in = c + wc < hs;
    uint16_t* xd = xs + (size_t(slot) * WK * BT + xr) * XP + xc;
#pragma unroll
    for (int j = 0; j < kXPer; ++j) {
      int off;
      const bool ok = chunk(xrow, j, BT, kXRS, off) && x_in;
      sm90::cp_async_16(xd + j * kXRS * XP, ok ? a.x + off + col : a.x, ok ? 16 : 0);
    }
    WT* wd = ws + (size_t(slot) * WK * BE + wr) * WP + wc;
#pragma unroll
    for (int j = 0; j < kWPer; ++j) {
      int off;
      const bool ok = chunk(wrow, j, BE, kWRS, off) && w_in;
      sm90::cp_async_16(wd + j * kWRS * WP, ok ? W + off + col : W, ok ? 16 : 0);
    }
  };

  const int warp = tid / 32, lane = tid % 32;
  const int wk = warp / (WM * WN), wm = (warp / WN) % WM, wn = warp % WN;
  const int g = lane / 4, tq = lane % 4;
  // Two accumulators per output: even and odd 16-column steps (halves the dependent
  // mma chain of a decode warp), added once at the end.
  // f(mi, ni, q) for every element of this warp's fragments.
  auto each_frag = [&](auto f) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int q = 0; q < 4; ++q) f(mi, ni, q);
  };
  float acc[2][MI][NI][4];
  each_frag([&](int mi, int ni, int q) { acc[0][mi][ni][q] = acc[1][mi][ni][q] = 0.0f; });
  // The slices this warp finished, summed in order (kSeq only).
  float zsum[kSeq ? MI : 1][kSeq ? NI : 1][4] = {};
  int done_steps = 0;  // of the slice in progress

#pragma unroll 1
  for (int s = 0; s < kStages - 1; ++s) {
    // NOTE: not unrolled: unrolled, the 12-stage decode tile's prologue made the kernel
    // 6200 instructions, and a cold instruction cache (the fused kernel runs between two
    // routings) was a third of its stall samples at T = 1 (ncu).
    if (s < steps) load_stage(s);
    sm90::cp_async_commit();
  }
  for (int step = 0; step < steps; ++step) {
    sm90::cp_async_wait<kStages - 2>();
    __syncthreads();  // stage `step` visible to all; slot (step - 1) % kStages free
    if (step + kStages - 1 < steps) load_stage((step + kStages - 1) % kStages);
    sm90::cp_async_commit();
    const int slot = step % kStages;
    const uint16_t* xb = xs + (size_t(slot) * WK * BT + wk * BT + wm * (BT / WM)) * XP;
    const WT* wb = ws + (size_t(slot) * WK * BE + wk * BE + wn * (BE / WN)) * WP;
#pragma unroll
    for (int kk = 0; kk < kRouteStepK / 16; ++kk) {
      uint32_t af[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const uint16_t* p = xb + (mi * 16 + g) * XP + kk * 16 + 2 * tq;
        af[mi][0] = *reinterpret_cast<const uint32_t*>(p);
        af[mi][1] = *reinterpret_cast<const uint32_t*>(p + 8 * XP);
        af[mi][2] = *reinterpret_cast<const uint32_t*>(p + 8);
        af[mi][3] = *reinterpret_cast<const uint32_t*>(p + 8 * XP + 8);
      }
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        uint32_t bf[kTerms][2];
        router_b_frags(wb + (ni * 8 + g) * WP + kk * 16 + 2 * tq, bf);
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int term = 0; term < kTerms; ++term)
            sm90::mma_bf16_16816(acc[kk % 2][mi][ni], af[mi], bf[term][0], bf[term][1]);
      }
    }
    if (kSeq && ++done_steps == slice_steps) {  // a slice done: into the running sum
      done_steps = 0;
      each_frag([&](int mi, int ni, int q) {
        zsum[kSeq ? mi : 0][kSeq ? ni : 0][q] += acc[0][mi][ni][q] + acc[1][mi][ni][q];
        acc[0][mi][ni][q] = acc[1][mi][ni][q] = 0.0f;
      });
    }
  }
  sm90::cp_async_wait<0>();

  // Token and expert (within the block tile) of this thread's fragment element q.
  auto frag_t = [&](int mi, int q) { return wm * (BT / WM) + mi * 16 + g + (q / 2) * 8; };
  auto frag_e = [&](int ni, int q) { return wn * (BE / WN) + ni * 8 + 2 * tq + (q % 2); };
  // One slice a warp slice: the block sums them in slice order through shared memory
  // (the ring is free now).
  float* red = reinterpret_cast<float*>(route_smem);  // [WK][BT][BE]
  if constexpr (!kSeq) {
    __syncthreads();
    each_frag([&](int mi, int ni, int q) {
      red[(wk * BT + frag_t(mi, q)) * BE + frag_e(ni, q)] = acc[0][mi][ni][q] + acc[1][mi][ni][q];
    });
    __syncthreads();
  }
  float* out = a.partial + size_t(blockIdx.z) * a.max_tokens * E;
  if constexpr (!kSeq) {
    for (int i = tid; i < BT * BE; i += kThreads) {
      const int t = t0 + i / BE, e = e0 + i % BE;
      float z = 0.0f;
#pragma unroll
      for (int k = 0; k < WK; ++k) z += red[k * BT * BE + i];
      if (t < T && e < E) out[size_t(t) * E + e] = z;
    }
  } else {
    each_frag([&](int mi, int ni, int q) {
      const int t = t0 + frag_t(mi, q), e = e0 + frag_e(ni, q);
      if (t < T && e < E) out[size_t(t) * E + e] = zsum[kSeq ? mi : 0][kSeq ? ni : 0][q];
    });
  }
}

template <typename WT, int BT, int BE, int WK, int WM, int WN, int kStages>
struct RouteTile {
  static constexpr size_t smem() {
    const size_t ring =
        size_t(kStages) * WK *
        (size_t(BT) * (kRouteStepK + kRoutePad) * 2 + size_t(BE) * (kRouteStepK + kRoutePad) * sizeof(WT));
    const size_t red = WK > 1 ? size_t(WK) * BT * BE * 4 : 0;  // the block's slice sum
    return ring > red ? ring : red;
  }
  static void prepare() {
    MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(route_logits_kernel<WT, BT, BE, WK, WM, WN, kStages>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem())));
  }
  static void launch(const RouteArgs& a, const MoeShape& s, int hint, cudaStream_t stream) {
    auto kernel = route_logits_kernel<WT, BT, BE, WK, WM, WN, kStages>;
    // NOTE: the grid covers the host hint, an upper bound of the device token count: blocks
    // past the device count exit at once, so a graph captured at a hint serves any count below it.
    const dim3 grid((s.experts + BE - 1) / BE, std::max(1, (hint + BT - 1) / BT), kRouterGroups);
    kernel<<<grid, WK * WM * WN * 32, smem(), stream>>>(a, s.hidden, s.experts);
    MEGAMOE_CUDA_CHECK_LAUNCH();
  }
};

// Tile configurations by token hint (see heuristics.h for the thresholds).
template <typename WT>
using RouteSmall = RouteTile<WT, 16, 16, kSlicesPerGroup, 1, 2, 6>;  // decode: a warp slice a slice
template <typename WT>
using RouteMedium = RouteTile<WT, 64, 32, 1, 2, 2, 4>;
// The medium tile with the group's four slices side by side (16 warps): a quarter of the
// dependent chain a warp and four times the copies in flight a block.
template <typename WT>
using RouteMediumWide = RouteTile<WT, 64, 32, kSlicesPerGroup, 2, 2, 3>;
template <typename WT>
using RouteLarge = RouteTile<WT, 128, 64, 1, 2, 2, 3>;  // prefill: fewer re-reads
// NOTE: with the running sum of the slices the F32 router's 2 x 2 warps spill six ints,
// reloaded once per 64-column step (~1100 instructions); 2 x 4 warps (no spill) measured
// slower (GLM-5 16384 tokens 745 against 721 us, DeepSeek-V3 567 against 477).

template <typename WT>
void launch_route_logits(const RouteArgs& a, const MoeShape& s, int hint,
                         std::optional<kernels::RouteTile> forced, cudaStream_t stream) {
  // Overrides::route_tile forces a tile shape (the same bits; for timing). (kernels::
  // names the switch's enum, which the RouteTile template above hides.)
  using Forced = kernels::RouteTile;
  if (forced) {
    switch (*forced) {
      case Forced::kSmall: return RouteSmall<WT>::launch(a, s, hint, stream);
      case Forced::kMedium: return RouteMedium<WT>::launch(a, s, hint, stream);
      case Forced::kWide: return RouteMediumWide<WT>::launch(a, s, hint, stream);
      case Forced::kLarge: return RouteLarge<WT>::launch(a, s, hint, stream);
    }
  }
  if (hint <= kRouteSmallTokens)
    RouteSmall<WT>::launch(a, s, hint, stream);
  else if (hint <= kRouteWideTokens)
    RouteMediumWide<WT>::launch(a, s, hint, stream);
  else if (hint <= route_medium_max_tokens(s.experts))
    RouteMedium<WT>::launch(a, s, hint, stream);
  else
    RouteLarge<WT>::launch(a, s, hint, stream);
}

constexpr int kTopkWarps = 4;
constexpr int kMaxE = 512;

// (value, id) max with ties to the lower id.
__device__ __forceinline__ void argmax_merge(float& v, int& id, float ov, int oid) {
  if (ov > v || (ov == v && oid < id)) {
    v = ov;
    id = oid;
  }
}

__device__ __forceinline__ void warp_argmax(float& v, int& id) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oid = __shfl_xor_sync(0xffffffffu, id, o);
    argmax_merge(v, id, ov, oid);
  }
}

// An unsigned key ordered as the floats (NaN excluded); + 0.0f makes -0 equal to +0.
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t u = __float_as_uint(v + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One warp per token; a warp's tokens in a software pipeline: the next token's partial
// logits load while this one is ranked, and a token's row positions (atomics whose return
// their stores wait for) are stored one token later.
// kPerLane: experts a lane holds (E <= 32 * kPerLane), so registers follow the expert count.
template <int kPerLane>
__global__ void __launch_bounds__(kTopkWarps * 32) route_topk_kernel(RouteArgs a, MoeShape s) {
  __shared__ float score_s[kTopkWarps][32 * kPerLane];
  __shared__ float sel_s[kTopkWarps][32 * kPerLane];
  __shared__ float group_s[kTopkWarps][32];
  // The fused kernel may be scheduled from here on (its CTAs wait for this grid's end before
  // reading the routing). Launched programmatically (launch_route), route_logits' partials
  // and counters are complete only after the wait.
  sm90::launch_dependents();
  sm90::grid_dependency_wait();
  const int T = device_token_count(a.num_tokens, a.tokens_cap);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int E = s.experts, K = s.topk;
  float* score = score_s[warp];
  float* sel = sel_s[warp];
  const int t_step = gridDim.x * kTopkWarps;
  // The lane's experts' correction bias: the same for every token.
  float bias[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    bias[i] = lane + 32 * i < E && a.bias ? __ldg(a.bias + lane + 32 * i) : 0.0f;
  // NOTE: all loads of a token at once (unrolled, kPerLane experts a lane): one
  // round trip instead of one per expert and slice (~30 us at T=1).
  float part[kPerLane][kRouterGroups];
  auto load_partials = [&](int t) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
#pragma unroll
      for (int k = 0; k < kRouterGroups; ++k)
        part[i][k] = e < E && t < T ? __ldcg(a.partial + (size_t(k) * a.max_tokens + t) * E + e) : 0.0f;
    }
  };
  // Logits: the split-K partials summed in split order.
  float z[kPerLane];
  auto sum_partials = [&] {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      z[i] = 0.0f;
#pragma unroll
      for (int k = 0; k < kRouterGroups; ++k) z[i] += part[i][k];
    }
  };
  int32_t* pos_dst = nullptr;  // the previous token's row position, stored once its atomic returned
  int pos_val = 0;
  int t = blockIdx.x * kTopkWarps + warp;
  load_partials(t);
  for (; t < T; t += t_step) {
    sum_partials();             // this token's logits (loaded one token earlier)
    load_partials(t + t_step);  // the next token's: in flight while this one is ranked
    float zmax = -FLT_MAX;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < E) {
        score[e] = z[i];
        sel[e] = bias[i];
        zmax = fmaxf(zmax, z[i]);
      }
    }
    __syncwarp();
    float denom = 1.0f;
    if (s.score == ScoreFunc::kSoftmax) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) zmax = fmaxf(zmax, __shfl_xor_sync(0xffffffffu, zmax, o));
      float sum = 0.0f;
      for (int e = lane; e < E; e += 32) sum += expf(score[e] - zmax);
      denom = warp_sum(sum);
    }
    for (int e = lane; e < E; e += 32) {
      const float z = score[e];
      float p;
      if (s.score == ScoreFunc::kSigmoid) {
        p = 1.0f / (1.0f + expf(-z));
      } else if (s.score == ScoreFunc::kSoftmax) {
        p = expf(z - zmax) / denom;
      } else {
        const float sp = z > 20.0f ? z : log1pf(expf(z));
        p = sqrtf(sp);
      }
      score[e] = p;
      sel[e] += p;  // sel holds the bias (stored with the logits above)
    }
    __syncwarp();
    if (s.n_group > 1) {
      const int gsize = E / s.n_group;
      if (lane < s.n_group) {
        float b1 = -FLT_MAX, b2 = -FLT_MAX;
        for (int i = 0; i < gsize; ++i) {
          const float v = sel[lane * gsize + i];
          if (v > b1) {
            b2 = b1;
            b1 = v;
          } else if (v > b2) {
            b2 = v;
          }
        }
        group_s[warp][lane] = b1 + b2;
      }
      __syncwarp();
      // Keep the topk_group best groups (ties to the lower group id).
      float gv = lane < s.n_group ? group_s[warp][lane] : -FLT_MAX;
      bool keep = false;
      for (int r = 0; r < s.topk_group; ++r) {
        float v = keep ? -FLT_MAX : gv;
        int id = lane < s.n_group && !keep ? lane : 1 << 30;
        if (lane >= s.n_group) v = -FLT_MAX;
        warp_argmax(v, id);
        if (lane == id) keep = true;
      }
      const unsigned keep_mask = __ballot_sync(0xffffffffu, keep);
      for (int e = lane; e < E; e += 32)
        if (!((keep_mask >> (e / gsize)) & 1u)) sel[e] = -FLT_MAX;
      __syncwarp();
    }
    // Top-K by selection score, ties to the lower id. The candidates stay in registers as
    // order-preserving keys (a lane's experts lane, lane + 32, ...) with each lane's best
    // kept: a pick is two warp reductions (the largest key, then the lowest id holding it)
    // and a rescan by the one lane that gave it (the earlier five shuffle rounds a pick were slower).
    uint32_t cand[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      cand[i] = order_key(lane + 32 * i < E ? sel[lane + 32 * i] : -INFINITY);
    auto lane_best = [&](uint32_t& key, int& at) {  // the first of the largest: the lowest id
      key = cand[0], at = 0;
#pragma unroll
      for (int i = 1; i < kPerLane; ++i)
        if (cand[i] > key) key = cand[i], at = i;
    };
    uint32_t best;
    int best_at;
    lane_best(best, best_at);
    float wsum = 0.0f;
    int my_id = -1;
    float my_w = 0.0f;
    for (int k = 0; k < K; ++k) {
      const uint32_t top = __reduce_max_sync(0xffffffffu, best);
      const int id = int(__reduce_min_sync(0xffffffffu, best == top ? uint32_t(lane + 32 * best_at) : ~0u));
      const float w = score[id];
      wsum += w;
      if (lane == k) {
        my_id = id;
        my_w = w;
      }
      if (lane == id % 32) {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i)
          if (i == best_at) cand[i] = 0u;  // below every key of a number
        lane_best(best, best_at);
      }
    }
    if (pos_dst) *pos_dst = pos_val;  // (the atomic returned while this token was ranked)
    pos_dst = nullptr;
    if (lane < K) {
      float w = my_w;
      if (s.norm_topk_prob) w = w / (wsum + 1e-20f);
      w *= s.routed_scaling;
      a.ids[size_t(t) * K + lane] = my_id;
      a.weights[size_t(t) * K + lane] = w;
      pos_val = atomicAdd(&a.expert_counts[my_id], 1);
      pos_dst = &a.pos[size_t(t) * K + lane];
    }
    __syncwarp();
  }
  if (pos_dst) *pos_dst = pos_val;
}

// ============================================================================
// route_external: the caller's ids and weights in place of route_logits + route_topk
// ============================================================================
constexpr int kRouteExternalThreads = 512;
constexpr int kRouteExternalUnroll = 8;  // slots a thread loads before it counts them

__global__ void __launch_bounds__(kRouteExternalThreads)
    route_external_kernel(RouteExternalArgs a, int E, int K) {
  __shared__ int count_s[kMaxE];
  __shared__ int bad_s, first_bad_s;
  // The fused kernel may be scheduled now: it waits for this grid's end before its first read.
  sm90::launch_dependents();
  const int tid = threadIdx.x;
  // What route_logits does first: the forward's counters zeroed, the epoch bumped, a device
  // token count out of range recorded (the same words, so check() reads one record).
  for (int i = tid; i < a.zero_words; i += kRouteExternalThreads) a.zero[i] = 0;
  for (int e = tid; e < E; e += kRouteExternalThreads) count_s[e] = 0;
  if (tid == 0) {
    bad_s = 0, first_bad_s = INT_MAX;
    if (a.epoch) *a.epoch += 1;
    const int raw = *a.num_tokens;
    if (raw < 0 || raw > a.tokens_cap) {
      a.token_status[0] += 1;
      a.token_status[1] = raw;
      a.token_status[2] = a.tokens_cap;
    }
  }
  __syncthreads();
  const int n = device_token_count(a.num_tokens, a.tokens_cap) * K;
  for (int base = 0; base < n; base += kRouteExternalThreads * kRouteExternalUnroll) {
    // All loads of a round first: one round trip for kRouteExternalUnroll slots.
    int64_t id[kRouteExternalUnroll];
    float w[kRouteExternalUnroll];
#pragma unroll
    for (int j = 0; j < kRouteExternalUnroll; ++j) {
      const int i = base + j * kRouteExternalThreads + tid;
      id[j] = 0, w[j] = 0.0f;
      if (i < n) {
        id[j] =
            a.in_ids_64 ? static_cast<const int64_t*>(a.in_ids)[i] : static_cast<const int32_t*>(a.in_ids)[i];
        w[j] = a.in_weights[i];
      }
    }
    const int lane = tid % 32;
#pragma unroll
    for (int j = 0; j < kRouteExternalUnroll; ++j) {
      const int i = base + j * kRouteExternalThreads + tid;
      const bool valid = i < n;
      int e = valid ? int(id[j]) : -1;
      if (valid && (id[j] < 0 || id[j] >= E)) {  // recorded; the slot computes expert 0 at weight 0
        atomicAdd(&bad_s, 1);
        atomicMin(&first_bad_s, i);
        e = 0, w[j] = 0.0f;
      }
      // One shared atomic per expert and warp (a skewed routing sends most slots to one
      // expert); positions in any order: a row's result does not depend on its place in
      // the segment.
      const unsigned peers = __match_any_sync(0xffffffffu, e);
      const int leader = __ffs(peers) - 1;
      int first = 0;
      if (lane == leader && valid) first = atomicAdd(&count_s[e], __popc(peers));
      first = __shfl_sync(0xffffffffu, first, leader);
      if (valid) {
        a.ids[i] = e;
        a.weights[i] = w[j];
        a.pos[i] = first + __popc(peers & ((1u << lane) - 1u));
      }
    }
  }
  __syncthreads();
  for (int e = tid; e < E; e += kRouteExternalThreads) a.expert_counts[e] = count_s[e];
  if (tid == 0 && bad_s > 0) {
    int* st = a.id_status;
    if (st[0] == 0) {  // the first bad id since the record was cleared
      const int i = first_bad_s;
      const int64_t v =
          a.in_ids_64 ? static_cast<const int64_t*>(a.in_ids)[i] : static_cast<const int32_t*>(a.in_ids)[i];
      st[1] = i / K, st[2] = i % K;
      st[3] = int(uint32_t(uint64_t(v))), st[4] = int(uint32_t(uint64_t(v) >> 32));
    }
    st[0] = min(st[0], INT_MAX - bad_s) + bad_s;  // (saturates)
  }
}

}  // namespace

void launch_route_external(const MoeShape& s, const RouteExternalArgs& a, cudaStream_t stream) {
  MEGAMOE_CHECK(s.experts <= kMaxE, "route_external supports at most 512 experts");
  route_external_kernel<<<1, kRouteExternalThreads, 0, stream>>>(a, s.experts, s.topk);
  MEGAMOE_CUDA_CHECK_LAUNCH();
}

void route_topk(const MoeShape& s, const RouteArgs& a, int host_tokens_hint, int num_sms, bool programmatic,
                cudaStream_t stream);

// Which routing kernels launch_route launches (set_route_parts_for_timing; all in a forward).
static int g_route_parts = kRoutePartLogits | kRoutePartTopk;

// route_topk's instantiations, 8 experts a lane up to 256 experts and 16 past them, with
// their blocks resident on one SM (registers and shared memory): found at plan creation
// (route_prepare), never inside a graph capture; 0 until then.
namespace {
struct TopkKernel {
  void (*fn)(RouteArgs, MoeShape);
  std::atomic<int> per_sm;
};
TopkKernel g_topk[2] = {{route_topk_kernel<8>, 0}, {route_topk_kernel<kMaxE / 32>, 0}};
TopkKernel& topk_kernel(int experts) { return g_topk[experts > 32 * 8]; }
}  // namespace

void route_prepare() {
  RouteSmall<float>::prepare(), RouteMedium<float>::prepare(), RouteLarge<float>::prepare();
  RouteSmall<uint16_t>::prepare(), RouteMedium<uint16_t>::prepare(), RouteLarge<uint16_t>::prepare();
  RouteMediumWide<float>::prepare(), RouteMediumWide<uint16_t>::prepare();
  for (TopkKernel& k : g_topk) {
    int n = 0;
    MEGAMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k.fn, kTopkWarps * 32, 0));
    k.per_sm = n;
  }
}

void launch_route(const MoeShape& s, const RouteArgs& a, int host_tokens_hint, int num_sms, bool programmatic,
                  std::optional<kernels::RouteTile> route_tile, cudaStream_t stream) {
  MEGAMOE_CHECK(s.experts <= kMaxE, "route_topk supports at most 512 experts");
  MEGAMOE_CHECK(s.topk <= 32, "route_topk supports top-k <= 32");
  MEGAMOE_CHECK(s.n_group <= 32, "route_topk supports n_group <= 32");
  MEGAMOE_CHECK(host_tokens_hint >= 0 && host_tokens_hint <= a.max_tokens, "token hint out of range");
  MEGAMOE_CHECK(
      s.hidden % (kRouterSlices * 8) == 0,
      "the router splits H into " + std::to_string(kRouterSlices) + " slices of a multiple of 8 columns");
  if (g_route_parts & kRoutePartLogits) {
    if (s.router_dtype == RouterDtype::kBF16)
      launch_route_logits<uint16_t>(a, s, host_tokens_hint, route_tile, stream);
    else
      launch_route_logits<float>(a, s, host_tokens_hint, route_tile, stream);
  }
  if (g_route_parts & kRoutePartTopk) route_topk(s, a, host_tokens_hint, num_sms, programmatic, stream);
}

void set_route_parts_for_timing(int parts) { g_route_parts = parts; }

void route_topk(const MoeShape& s, const RouteArgs& a, int host_tokens_hint, int num_sms, bool programmatic,
                cudaStream_t stream) {
  const TopkKernel& kernel = topk_kernel(s.experts);
  // One wave of resident blocks at most: a warp's later tokens run in its pipeline.
  const int per_sm = kernel.per_sm.load();
  MEGAMOE_CHECK(per_sm > 0, "route_topk: launched before route_prepare (plan creation)");
  const int topk_blocks =
      std::max(1, std::min((host_tokens_hint + kTopkWarps - 1) / kTopkWarps, num_sms * per_sm));
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr = sm90::programmatic_serialization();
  cfg.gridDim = dim3(topk_blocks), cfg.blockDim = dim3(kTopkWarps * 32), cfg.stream = stream;
  cfg.attrs = &attr, cfg.numAttrs = programmatic ? 1 : 0;
  MEGAMOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel.fn, a, s));
}

}  // namespace megamoe::kernels
