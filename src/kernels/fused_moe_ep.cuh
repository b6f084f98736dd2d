// fused_moe's device side, part 2 (included by fused_moe.cu only): the expert-parallel
// protocol (ep_layout.h's flow: signals, waits with timeouts, the count exchange and the
// row pull of phase 0) and the epilogues' row addressing (out_row, row_src) and SwiGLU.
#pragma once

#include "fused_moe_device.cuh"

namespace megamoe::kernels {
namespace {  // (this header belongs to fused_moe.cu, its one includer)

// ---------------------------------------------------------------------------
// Expert parallelism (ep_layout.h's flow, steps 1-3 in phase 0, 4 in the GEMM2
// epilogue, 5 in the combine).
// ---------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ T* ep_region(uint8_t* base, const Region& r) {
  return reinterpret_cast<T*>(base + r.offset);
}
// Signal `kind` that rank `from` raises in rank `at`'s buffer.
__device__ __forceinline__ uint64_t* ep_signal(const EpArgs& ep, int at, int kind, int from) {
  return ep_region<uint64_t>(ep.peer[at], ep.l.signals) + kind * ep.ranks + from;
}

// Spins until probe() >= v. Gives up (false) when the rank's timeout passes, setting
// the status word to (phase, rank, peer) for the host, or when another CTA of the
// rank already gave up: a peer that never arrives is an error, never a hang.
template <typename Probe>
__device__ __forceinline__ bool ep_wait(const EpArgs& ep, Probe probe, uint64_t v, int phase, int peer) {
  if (probe() >= v) return true;
  const uint64_t t0 = sm90::globaltimer_ns();
  for (uint32_t i = 1;; ++i) {
    if (probe() >= v) return true;
    if ((i & 63) == 0) {
      if (sm90::ld_relaxed_gpu(&ep.state[1]) != 0) return false;
      if (sm90::globaltimer_ns() - t0 > ep.timeout_ns) {
        atomicCAS(reinterpret_cast<unsigned long long*>(&ep.state[1]), 0ull,
                  EpStatus::encode(EpStatus::Phase(phase), ep.rank, peer));
        return false;
      }
    }
  }
}
__device__ __forceinline__ bool ep_wait_signal(const EpArgs& ep, int kind, int from, uint64_t epoch,
                                               int phase) {
  const uint64_t* sig = ep_signal(ep, ep.rank, kind, from);
  if (!ep_wait(
          ep, [&] { return sm90::ld_relaxed_sys(sig); }, epoch, phase, from))
    return false;
  (void)sm90::ld_acquire_sys(sig);
  return true;
}
// Grid barrier of this rank's CTAs (the caller fenced and synchronized its CTA), all or
// nothing: every CTA passes or every CTA leaves (false). A CTA that arrived and then gives
// up (the timeout, or the status word set by another CTA or by an earlier forward that was
// not reset) leaves only while the count is short of the target, and then adds
// kBarrierAbort to it, so the waiting CTAs and the late ones see the abort and leave too.
// (Had it only left, the last CTA to arrive would pass alone into the tiles, whose waits for
// the departed CTAs' rows and tiles have no timeout: a hang, where the protocol promises an
// error.) Once the count is met no abort can land: a CTA that timed out then passes, and
// its status word reports the timeout to the host. The counter is zeroed every forward;
// both barriers use it (targets gridDim.x and 2 gridDim.x), so an abort at the first one
// also fails the second.
constexpr int kBarrierAbort = 1 << 30;
__device__ __forceinline__ bool ep_grid_barrier(const EpArgs& ep, int* ctr, int target) {
  atomicAdd(ctr, 1);
  if (!ep_wait(
          ep, [&] { return uint64_t(sm90::ld_relaxed_gpu(ctr)); }, uint64_t(target), EpStatus::kBarrier,
          ep.rank)) {
    for (int v = sm90::ld_relaxed_gpu(ctr); v < target;) {
      const int seen = atomicCAS(ctr, v, v + kBarrierAbort);
      if (seen == v) return false;
      v = seen;
    }
  }
  return sm90::ld_acquire_gpu(ctr) < kBarrierAbort;
}

// Phase-0 scratch tables under expert parallelism, in the last ring stage (no TMA
// load targets it before the grid barrier that ends phase 0). Pair p = el * R + src.
struct EpTables {
  static constexpr int kE = kMaxExpertsTotal + 1;                  // E_route + 1 at most
  static constexpr int kCounts = kE + (1 << EpLayout::kRankBits);  // R * (El + 1) = E + R at most
  int* gprefix;      // [E_route + 1] own slots before global expert e (the send_list order)
  int* counts;       // [R][El + 1]   the received counts
  int* pair_prefix;  // [E_route + 1] received rows before pair p
  int* pair_send;    // [E_route]     pair p's first entry in source src's send_list
  int* pair_ring;    // [E_route]     pair p's first row in this rank's ring
  static constexpr int kInts = 4 * kE + kCounts;
  __device__ explicit EpTables(int* b)
      : gprefix(b),
        counts(b + kE),
        pair_prefix(b + kE + kCounts),
        pair_send(b + 2 * kE + kCounts),
        pair_ring(b + 3 * kE + kCounts) {}
};
static_assert(EpTables::kInts * 4 <= stage_bytes(8), "the EP tables fit one ring stage");

// The pull's tables when it overlaps the GEMMs (KernelArgs::ep_overlap): the ring stage of
// EpTables is refilled as soon as the producer starts, so the two tables the pull needs
// live in the unused tails of the schedule's cnt and row_off arrays (SmemTail::kTables,
// kMaxExpertsTotal + 1 ints each, of which E_total and E_total + 1 are used; the plan
// allows the overlap only where E_route + E_total <= kMaxExpertsTotal). Pair p = el * R + src.
struct EpPullTables {
  int* ring_rel;  // [E_route] pair p's first row, counted from its expert's first row
  int* send;      // [E_route] pair p's first entry in source src's send_list
};
__device__ __forceinline__ EpPullTables ep_pull_tables(const Sched& sc, int E_route) {
  return {sc.row_off - E_route, sc.unit_off - E_route};
}

// Steps 1-3 up to the pull: quantize this rank's tokens into its x_q / x_scale (and
// the shared expert's ring rows), its slots into send_list, a barrier of its CTAs,
// counts to the owners, every source's counts, then the schedule and pair tables.
// All threads of the CTA; false (the status word set) if a peer did not arrive.
__device__ __forceinline__ bool ep_exchange(const KernelArgs& a, const Sched& sc, const EpTables& et, int T,
                                            uint64_t epoch, int BN) {
  const EpArgs& ep = a.ep;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int R = ep.ranks, r = ep.rank, El = a.E, Er = ep.E_route, K = a.K, H = a.H, hb = H / 128;
  uint8_t* me = ep.peer[r];
  if (warp == 0) {
    const int total = warp_scan_exclusive(
        Er, lane, [&](int e) { return a.counters[MoeWorkspaceLayout::kCounterExperts + e]; },
        [&](int i, int v) { et.gprefix[i] = v; });
    if (lane == 0) et.gprefix[Er] = total;
  }
  __syncthreads();
  // ---- 1. tokens to x_q (and the shared expert's rows), slots to send_list ----
  {
    uint8_t* xq = ep_region<uint8_t>(me, ep.l.x_q);
    float* xs = ep_region<float>(me, ep.l.x_scale);
    auto* send = ep_region<EpLayout::SendEntry>(me, ep.l.send_list);
    const int tasks = T * hb, warps_total = gridDim.x * (kThreads / 32);
    for (int task = blockIdx.x * (kThreads / 32) + warp; task < tasks; task += warps_total) {
      const int t = task / hb, g = task - t * hb;
      const uint2 raw = *reinterpret_cast<const uint2*>(a.x + size_t(t) * H + g * 128 + lane * 4);
      float sc_x;
      uint32_t qw[1];
      quantize_group<2>({raw.x, raw.y}, qw, sc_x);
      const uint32_t q = qw[0];
      *reinterpret_cast<uint32_t*>(xq + size_t(t) * H + g * 128 + lane * 4) = q;
      if (lane == 0) xs[t * hb + g] = sc_x;
      if (a.has_shared) {
        *reinterpret_cast<uint32_t*>(a.x_sorted + size_t(t) * H + g * 128 + lane * 4) = q;
        if (lane == 0) {
          a.x_sorted_scale[size_t(g) * a.rows_cap + t] = sc_x;
          if (g == 0) a.row_weight[t] = 1.0f;  // (row_src is not read for the shared expert: out_row)
        }
      }
      if (g == 0 && lane < K) {
        const int id = a.topk_ids[t * K + lane];
        if (id >= 0)
          send[et.gprefix[id] + a.topk_pos[t * K + lane]] =
              EpLayout::SendEntry{EpLayout::pack_src(r, t, lane), a.topk_weights[t * K + lane]};
      }
    }
  }
  // ---- 2. barrier of this rank's CTAs, then counts and the counts signal to every owner ----
  // (the shared expert's rows are read by TMA, the async proxy; with the pull overlapped
  // no later grid barrier orders them before that)
  sm90::fence_proxy_async_global();
  __threadfence();
  __syncthreads();
  bool ok = true;
  if (tid == 0) ok = ep_grid_barrier(ep, &a.counters[MoeWorkspaceLayout::kCounterBarrier], gridDim.x);
  if (__syncthreads_or(!ok)) return false;
  if (blockIdx.x == 0) {
    for (int i = tid; i < R * (El + 1); i += kThreads) {
      const int q = i / (El + 1), j = i - q * (El + 1);
      const int* gp = et.gprefix + q * El;
      ep_region<int>(ep.peer[q], ep.l.counts)[r * (El + 1) + j] = j < El ? gp[j + 1] - gp[j] : gp[0];
    }
    __threadfence_system();
    __syncthreads();
    if (tid < R) sm90::st_release_sys(ep_signal(ep, tid, EpLayout::kCounts, r), epoch);
  }
  // ---- 3. every source's counts; the schedule and pair tables ----
  ok = tid >= R || ep_wait_signal(ep, EpLayout::kCounts, tid, epoch, EpStatus::kCounts);
  if (__syncthreads_or(!ok)) return false;
  const int* rc = ep_region<int>(me, ep.l.counts);
  for (int i = tid; i < R * (El + 1); i += kThreads) et.counts[i] = __ldcg(rc + i);
  __syncthreads();
  const int* cn = et.counts;
  if (warp == 0) {
    const int row0 = a.has_shared ? (T + kRowAlign - 1) / kRowAlign * kRowAlign : 0;
    build_sched(
        sc, El + a.has_shared, BN, lane,
        [&](int e) {
          if (e == El) return T;  // the shared expert: every own token
          int c = 0;
          for (int src = 0; src < R; ++src) c += cn[src * (El + 1) + e];
          return c;
        },
        row0, a.has_shared != 0);
  } else if (warp == 1) {
    const int total = warp_scan_exclusive(
        Er, lane, [&](int p) { return cn[(p % R) * (El + 1) + p / R]; },
        [&](int p, int v) { et.pair_prefix[p] = v; });
    if (lane == 0) et.pair_prefix[Er] = total;
  } else {
    for (int src = warp - 2; src < R; src += kThreads / 32 - 2)
      warp_scan_exclusive(
          El, lane, [&](int el) { return cn[src * (El + 1) + el]; },
          [&](int el, int v) { et.pair_send[el * R + src] = cn[src * (El + 1) + El] + v; });
  }
  __syncthreads();
  const EpPullTables pt = ep_pull_tables(sc, Er);
  for (int el = tid; el < El; el += kThreads) {
    int row = sc.row_off[el];
    for (int src = 0; src < R; ++src) {
      const int p = el * R + src;
      et.pair_ring[p] = row;
      if (a.ep_overlap) pt.ring_rel[p] = row - sc.row_off[el], pt.send[p] = et.pair_send[p];
      row += cn[src * (El + 1) + el];
    }
  }
  __syncthreads();
  return true;
}

// A warp copies one received row into this rank's ring row `ring`: entry `entry` of source
// `src`'s send_list names the token, whose FP8 data and scales come from the source's x_q and
// x_scale; the entry's weight and packed source go to row_weight and row_src.
__device__ __forceinline__ void ep_copy_row(const KernelArgs& a, int src, int entry, int ring) {
  const EpArgs& ep = a.ep;
  const int lane = threadIdx.x % 32, H = a.H, hb = H / 128;
  uint8_t* sb = ep.peer[src];
  const int2 e =
      __ldcg(reinterpret_cast<const int2*>(ep_region<EpLayout::SendEntry>(sb, ep.l.send_list) + entry));
  const int token = EpLayout::src_token(e.x);
  const uint4* from = reinterpret_cast<const uint4*>(ep_region<uint8_t>(sb, ep.l.x_q) + size_t(token) * H);
  uint4* to = reinterpret_cast<uint4*>(a.x_sorted + size_t(ring) * H);
#pragma unroll 4
  for (int c = lane; c < H / 16; c += 32) to[c] = __ldcg(from + c);
  const float* fs = ep_region<float>(sb, ep.l.x_scale) + size_t(token) * hb;
  for (int g = lane; g < hb; g += 32) a.x_sorted_scale[size_t(g) * a.rows_cap + ring] = __ldcg(fs + g);
  if (lane == 0) {
    a.row_weight[ring] = __int_as_float(e.y);
    a.row_src[ring] = e.x;
  }
}

// Step 3, the pull before the tiles: every warp of the grid copies received rows, pair by pair.
__device__ __forceinline__ void ep_pull(const KernelArgs& a, const EpTables& et) {
  const EpArgs& ep = a.ep;
  const int warp = threadIdx.x / 32;
  const int R = ep.ranks, Er = ep.E_route;
  const int n = et.pair_prefix[Er], warps_total = gridDim.x * (kThreads / 32);
  for (int i = blockIdx.x * (kThreads / 32) + warp; i < n; i += warps_total) {
    const int p = largest_le(et.pair_prefix, 0, Er - 1, 1, i);
    const int j = i - et.pair_prefix[p];
    ep_copy_row(a, p % R, et.pair_send[p] + j, et.pair_ring[p] + j);
  }
}

// Step 3 overlapped with the GEMMs (KernelArgs::ep_overlap): warps 2 and 3 of the producer
// warpgroup pull the received rows while the producer and the consumers run the tiles.
// They walk the ring's routed rows in order, interleaved over the grid's pull warps (the
// GEMM1 tiles go round-robin in the same expert-major order, TileSchedule, so the rows
// the first tiles need come first), a warp a row as ep_pull, and count each row into its
// unit's done1 counter: a GEMM1 tile's tokens wait for rows, a GEMM2 tile's for rows plus
// the unit's GEMM1 tiles (the producer's `need`). The writes are fenced for the TMA reads
// (async proxy) and released at gpu scope, as the GEMM1 epilogue's act2. (The rank's
// second grid barrier stays, fused_moe.cu: it now guards only a peer's timeout.)
template <int BN>
__device__ __forceinline__ void ep_pull_overlapped(const KernelArgs& a, const Sched& sc, int* done1,
                                                   int pull_warp, int pull_warps) {
  const EpArgs& ep = a.ep;
  const int lane = threadIdx.x % 32, R = ep.ranks, El = a.E;
  const EpPullTables pt = ep_pull_tables(sc, ep.E_route);
  const int end = sc.row_off[El + a.has_shared];  // (the shared expert's rows are first: not pulled)
  const int stride = gridDim.x * pull_warps;
  for (int ring = sc.row_off[0] + blockIdx.x * pull_warps + pull_warp; ring < end; ring += stride) {
    PullRow pr;
    if (!ep_pull_row(sc.row_off, sc.cnt, pt.ring_rel, pt.send, El, R, ring, pr)) continue;  // (padding)
    ep_copy_row(a, pr.src, pr.entry, ring);
    // (the warp barrier orders every lane's stores before lane 0's release, as for the
    // consumers' tile_written; each lane fences its own stores for the async proxy)
    sm90::fence_proxy_async_global();
    __syncwarp();
    if (lane == 0) sm90::red_release_gpu_add(&done1[sc.unit_off[pr.el] + pr.je / BN], 1);
  }
}

// Where a GEMM2 row goes, from its row_src entry `src` (loaded before the K loop: the
// load's round trip stays off the epilogue): single device y_rows[token][slot], so the
// combine reads each token's slot rows from one place; expert parallelism the
// source rank's combine[token][slot], or y_rows[row] for the shared expert.
template <bool kEp>
__device__ __forceinline__ uint16_t* out_row(const KernelArgs& a, const Tile& tl, int row, int32_t src) {
  if (!kEp) return a.y_rows + size_t(src) * a.H;
  if (tl.e == a.E) return a.y_rows + size_t(row) * a.H;
  return ep_region<uint16_t>(a.ep.peer[EpLayout::src_rank(src)], a.ep.l.combine) +
         (size_t(EpLayout::src_token(src)) * a.K + EpLayout::src_slot(src)) * a.H;
}

// A GEMM1 epilogue's SwiGLUs: rows(act, limit) with swiglu_fast when `fast` (the warp's
// gates allow it), its clamp folded away when there is none (DeepSeek-V3, GLM-5: five
// instructions of ~25 an element), else swiglu.
template <typename Rows>
__device__ __forceinline__ void run_swiglu(Rows& rows, bool fast, float limit) {
  auto fast_act = [](float g, float u, float l, float w) { return num::swiglu_fast(g, u, l, w); };
  if (fast && limit > 0.0f)
    rows(fast_act, limit);
  else if (fast)
    rows(fast_act, 0.0f);
  else
    rows([](float g, float u, float l, float w) { return num::swiglu(g, u, l, w); }, limit);
}

// The row_src entry of the tile's row n (0 past tl.rows: nothing is stored there).
__device__ __forceinline__ int32_t load_row_src(const KernelArgs& a, const Tile& tl, int n) {
  return n < tl.rows ? __ldcg(a.row_src + tl.row0 + n) : 0;
}

}  // namespace
}  // namespace megamoe::kernels
