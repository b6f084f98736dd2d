// fused_moe's device side, part 1 (included by fused_moe.cu only): the kernel's
// arguments and tensor maps, tiles and their decoding from the schedule, the stage
// ring's position, the profile counters, the E4M3 packing, and the shared-memory
// schedule tables every role derives from the routing counts.
#pragma once

#include <cuda.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "config.h"
#include "heuristics.h"
#include "megamoe/kernels/fused_moe.h"
#include "megamoe/kernels/tile_schedule.h"
#include "megamoe/numerics/act_quant.h"
#include "megamoe/numerics/mma_model.h"
#include "route.cuh"
#include "sm90_ptx.cuh"

namespace megamoe::kernels {
namespace {  // (this header belongs to fused_moe.cu, its one includer)

// ============================================================================
// Device side
// ============================================================================
// Expert parallelism (ep_layout.h's flow); ranks = 0 on a single device.
struct EpArgs {
  int ranks, rank;
  int E_route;  // experts of the routing ids: every rank's (E); KernelArgs::E is this rank's E/R
  uint64_t timeout_ns;
  EpLayout l;
  uint8_t* peer[1 << EpLayout::kRankBits];  // symmetric buffers (peer[rank]: this rank's)
  uint64_t* state;                          // [0] epoch (bumped by route_logits), [1] status
};

// SM ids the unit table covers (KernelArgs::sm_unit; a grid of at most kNoSmUnit CTAs).
constexpr int kSmUnitSlots = 256;
constexpr uint8_t kNoSmUnit = 255;

struct KernelArgs {
  int H, I, Is, E, K;  // E: the experts this kernel computes (E/R under expert parallelism)
  // Output blocks of a routed GEMM1 (I / 128), the shared one's (Is / 128) and a GEMM2 (H / 128):
  // read from here where a tile is decoded (computed there, ptxas kept them live and spilled).
  int n1, n1s, n2;
  int has_shared;
  int rows_cap, inter_pitch;
  float swiglu_limit;
  DebugArgs debug;   // measurement only: DebugArgs{} in every release forward
  int tail_pool;     // FusedMoeConfig::tail_pool (per forward): GEMM2 tiles left to claims at the end
  int sm_units;      // FusedMoeConfig::sm_units (per forward): the unit of the CTA's SM, sm_unit
  uint64_t* epoch;   // [0] bumped by route_logits once a forward (MoeWorkspaceLayout::ep_state)
  int half_tiles;    // FusedMoeConfig::half_tiles (per forward)
  int pair_weights;  // FusedMoeConfig::pair_weights (per forward; pair tiles only)
  int ep_overlap;    // expert parallelism: the row pull runs beside the tiles (kEpOverlap)
  const int* num_tokens;
  int tokens_cap;  // the forward's host hint: T = device_token_count(num_tokens, tokens_cap)
  const uint16_t* x;
  uint16_t* y;
  int* counters;
  const int* topk_ids;
  const float* topk_weights;
  const int* topk_pos;
  uint8_t* x_sorted;
  float* x_sorted_scale;
  float* row_weight;
  uint8_t* act2;
  float* act2_scale;
  uint16_t* y_rows;
  int32_t* row_src;  // [rows_cap] where a sorted row's output goes (MoeWorkspaceLayout::row_src)
  const float* w13_scale;
  const float* w2_scale;
  const float* sw13_scale;
  const float* sw2_scale;
  int units_base;  // index in counters of the first GEMM1-done counter (after the routing counts)
  EpArgs ep;
  // The schedule unit of the CTA on SM `smid`: the SM's place in the order a plain launch on
  // an idle GPU fills them (kNoSmUnit: none), found at plan creation (probe_sm_units).
  uint8_t sm_unit[kSmUnitSlots];
};

// The K loops' skip bits (DebugArgs::skip, MEGAMOE_DEBUG_SKIP; wrong outputs, for
// timing the parts of the kernel) -- except kSkipMma, which is also how a half tile's idle
// warpgroup runs its K loop (the consumers' wg_idle): stages handed back, nothing computed.
constexpr int kSkipMma = 1;    // no wgmma and no fold
constexpr int kSkipLoads = 4;  // no TMA loads (stages complete at once: the consumers' own speed)
constexpr int kSkipFold = 8;   // mainloop_tokens_m without the fold (wgmma, stages; not the two-block loop)
constexpr int kSkipDeps = 16;  // no tile loads or waits for its done1 count (GEMM2: act2 unwritten)

struct TensorMaps {
  CUtensorMap w13, sw13, w2, sw2;  // weights (shared by every block_n)
  CUtensorMap x, xs, a2, a2s;      // activations (box depends on block_n)
  // A pair tile's parts: the 64 rows of the operand the pair shares that one CTA loads into
  // both CTAs' stage (x and act2: pairs sharing tokens; the weights: pairs sharing weights).
  CUtensorMap x_part, a2_part;
  CUtensorMap w13_part, sw13_part, w2_part, sw2_part;
  CUtensorMap w13w, sw13w, w2w, sw2w;  // the weights in 256-row boxes (wide tiles: two output blocks)
};

struct Tile {
  int gemm;          // 1 or 2 (0: no further tile, in a stage's record)
  int e;             // expert (E = shared)
  int nblk;          // GEMM1: 128-column chunk of I; GEMM2: 128-row block of H
  int row0;          // first sorted row
  int rows;          // valid rows (<= block_n)
  int unit;          // (expert, token block) counter index
  int kblocks;       // 128-deep K blocks
  int pair_weights;  // pair tiles: the pair shares the weight tile (TileCoord::pair_weights), else the tokens
};
static_assert(sizeof(Tile) == 32, "SmemTail::kStageTile holds 8 ints a stage");

// Shared-memory tables every role derives the schedule from.
struct Sched {
  int* cnt;       // [E_total] rows per expert
  int* row_off;   // [E_total + 1]
  int* unit_off;  // [E_total + 1] token blocks before expert e
};

// 128-deep K blocks of a GEMM1 (K = H) or GEMM2 (K = I, or Is for the shared expert E) tile.
__device__ __forceinline__ int tile_kblocks(const KernelArgs& a, int gemm, int e) {
  return (gemm == 1 ? a.H : e < a.E ? a.I : a.Is) / 128;
}

// The tile ids of this forward (TileIds in tile_schedule.h has their order and the pair
// tiles' ids); sh1 = sh2 = 1 for pair tiles, sh2 = 1 for wide tiles.
__device__ __forceinline__ TileIds tile_ids(const KernelArgs& a, const Sched& sc, int sh1, int sh2) {
  return TileIds::count(a.n1, a.n1s, a.n2, a.E, a.E + a.has_shared, kTokenChunk, sh1, sh2, sc.unit_off,
                        a.pair_weights);
}

// Tile id -> tile, given the ids' t1_routed and t1 (tile_ids, computed once: derived
// again from the tables at each tile, the producer spilled).
template <int BN>
__device__ __forceinline__ Tile decode_tile(const KernelArgs& a, const Sched& sc, int tile, int t1_routed,
                                            int t1, int sh1, int sh2, int rank) {
  const TileIds ids{a.n1 >> sh1,
                    a.n1s >> sh1,
                    a.n2 >> sh2,
                    a.E,
                    a.E + a.has_shared,
                    t1_routed,
                    t1,
                    0 /* t2: not needed */,
                    kTokenChunk,
                    sh1,
                    sh2,
                    sc.unit_off,
                    sh1 && sh2 ? a.pair_weights : 0};
  const TileCoord c = ids.decode(tile, rank);
  Tile t;
  t.gemm = c.gemm, t.e = c.e, t.nblk = c.nblk;
  t.kblocks = tile_kblocks(a, t.gemm, t.e);
  t.unit = sc.unit_off[t.e] + c.block;
  t.row0 = sc.row_off[t.e] + c.block * BN;
  t.rows = min(BN, sc.cnt[t.e] - c.block * BN);
  t.pair_weights = c.pair_weights;
  return t;
}

__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  // NOTE: cvt.rn.satfinite: identical to num::e4m3_encode (tested on the CPU side).
  const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

__device__ __forceinline__ uint8_t to_e4m3(float v) {
  return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// One token's 128-column group over 128 / (2 kWords) lanes, kWords BF16 pairs a lane
// (2: the whole warp; 8: eight lanes, four groups a warp): this lane's E4M3 codes (q[i]:
// its values 4i..4i+3) and the group's float32 scale (num::act_scale of its amax).
template <int kWords>
__device__ __forceinline__ void quantize_group(const uint32_t (&raw)[kWords], uint32_t (&q)[kWords / 2],
                                               float& scale) {
  constexpr int kLanes = 128 / (2 * kWords);
  float v[2 * kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i)
    v[2 * i] = __uint_as_float(raw[i] << 16), v[2 * i + 1] = __uint_as_float(raw[i] & 0xFFFF0000u);
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 2 * kWords; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  scale = num::act_scale(amax);
  const float inv = 1.0f / scale;
#pragma unroll
  for (int i = 0; i < kWords / 2; ++i)
    q[i] = pack_e4m3x4(v[4 * i] * inv, v[4 * i + 1] * inv, v[4 * i + 2] * inv, v[4 * i + 3] * inv);
}

// Position in the shared-memory ring: the stage and the parity of its current fill
// (no division by the stage count, which is not a power of two).
template <int kStages>
struct RingPos {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) stage = 0, phase ^= 1;
  }
};

// Where a CTA's time goes (a build with -DMEGAMOE_PROFILE=ON only; a plain build
// compiles none of it): cycles of consumer thread 0 and of the producer thread per
// role, written by every CTA at the end of a launch, printed by
// fused_moe_print_profile(). Measurement only: the clock reads perturb the loops.
#ifdef MEGAMOE_PROFILE
constexpr bool kProfile = true;
#else
constexpr bool kProfile = false;
#endif
enum ProfSlot {
  kPfTotal,      // consumer thread 0: kernel start .. end
  kPfPhase0,     // .. after the grid barrier
  kPfTileStart,  // waiting for a tile's first stage + decoding it
  kPfFullWait,   // K loops: waiting for a stage's data
  kPfMmaWait,    // K loops: waiting for its own wgmma
  kPfLoop,       // K loops in all
  kPfTile,       // whole tiles: start + K loops + the rest (epilogue, tile_written)
  kPfCombine,    // after the last tile: done2 wait + combine
  kPfStages,     // stages consumed
  kPfTiles,      // tiles consumed
  kPfIssue,      // K loops: the wgmma issue (part of issue+fold)
  kPfEpi1,       // GEMM1 epilogues up to the proxy fence
  kPfFence,      // GEMM1 epilogues: the generic -> async proxy fence
  kPfEpi2,       // GEMM2 epilogues (the BF16 stores)
  kPfSlotWait,   // tile_written: waiting for a free slot of the signal thread
  kPfDone2,      // combine: waiting for every GEMM2 tile
  kPfSched,      // phase 0: kernel start .. schedule tables built (barrier init, table scan)
  kPfTasks,      // phase 0: .. this CTA's quantize / scatter tasks done (the rest: grid barrier)
  kPfStartNs,    // global timer (ns, low 32 bits) at the CTA's start: the launch's spread
  kPfArriveNs,   // .. when it arrives at phase 0's grid barrier
  kPfPassNs,     // .. when it leaves it
  kPfProdTotal,  // producer thread: after the grid barrier .. sentinel
  kPfProdEmpty,  // waiting for empty stages
  kPfProdDep,    // waiting for a GEMM2 tile's GEMM1 units
  kPfSlots = 24
};
constexpr int kProfCtas = 1024;
__device__ uint32_t g_profile[kProfCtas][kPfSlots];
struct Prof {
  uint32_t v[kPfSlots] = {};
  // NOTE: ptxas may still re-read the clock for a long-lived start value (an S2UR
  // rematerialized next to its use): the 128-token kernel's "tables" interval of phase 0
  // reads near 2^32 (see docs/performance-history.md); the other intervals read right.
  __device__ __forceinline__ uint32_t now() const { return kProfile ? sm90::clock_ordered() : 0u; }
  __device__ __forceinline__ void stamp(int slot) {
    if (kProfile) v[slot] = uint32_t(sm90::globaltimer_ns());
  }
  __device__ __forceinline__ void add(int slot, uint32_t since) {
    if (kProfile) v[slot] += sm90::clock_ordered() - since;
  }
  __device__ __forceinline__ void count(int slot) {
    if (kProfile) ++v[slot];
  }
  __device__ __forceinline__ void store(int lo, int hi) const {
    if (kProfile && blockIdx.x < kProfCtas)
      for (int i = lo; i < hi; ++i) g_profile[blockIdx.x][i] = v[i];
  }
};

// A consumer warp hands a stage back to the producer: one arrival per warp, after
// every lane is done with the stage (its wgmma retired, its scale reads done).
// NOTE: not one arrival a thread: 256 arrivals on one mbarrier per stage cost as much
// as the stage's loads or its wgmma (ncu, see docs/performance-history.md).
__device__ __forceinline__ void release_stage(uint64_t* empty) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) sm90::mbar_arrive(empty);
}

// The same for a pair tile's stage: on this CTA's barrier and on the pair peer's (`peer`:
// its shared::cluster address), whose producer wrote half of this stage's token or
// weight rows.
__device__ __forceinline__ void release_stage_pair(uint64_t* empty, uint32_t peer) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) {
    sm90::mbar_arrive(empty);
    sm90::mbar_arrive_cluster(peer);
  }
}

// Sorted row (or -1) and routing weight of token t's slot `lane` (routed 0..K-1,
// then the shared expert); lanes past the slots get -1. One load round trip for a
// whole token: phase 0 and the combine take the slots from the lanes by shuffle or
// shared memory instead of walking them with dependent loads (~27 serialized
// round trips per token and thread in the combine).
// Under expert parallelism (combine only) a routed slot's row is t * K + lane of the
// combine region, where its owner stored it.
template <bool kEp>
__device__ __forceinline__ int slot_row(const KernelArgs& a, const Sched& sc, int t, int lane, float& w) {
  w = 0.0f;
  if (lane < a.K) {
    const int id = a.topk_ids[t * a.K + lane];
    if (id < 0) return -1;
    if (kEp) return t * a.K + lane;
    w = a.topk_weights[t * a.K + lane];
    return sc.row_off[id] + a.topk_pos[t * a.K + lane];
  }
  if (lane == a.K && a.has_shared) {
    w = 1.0f;
    return sc.row_off[a.E] + t;
  }
  return -1;
}

// The row the combine reads for token t's slot `lane`: single device y_rows[t][slot]
// (none for a routed slot without an expert, id -1), expert parallelism slot_row's.
template <bool kEp>
__device__ __forceinline__ int combine_row(const KernelArgs& a, const Sched& sc, int t, int lane) {
  float w;
  if (kEp) return slot_row<true>(a, sc, t, lane, w);
  const int slots = a.K + a.has_shared;
  if (lane < a.K) return a.topk_ids[t * a.K + lane] < 0 ? -1 : t * slots + lane;
  return lane < slots ? t * slots + lane : -1;
}

// Exclusive prefix sums of n values by one warp: store(i, sum of val(j) for j < i)
// for i < n; returns the total (in every lane).
template <typename Val, typename Store>
__device__ __forceinline__ int warp_scan_exclusive(int n, int lane, Val val, Store store) {
  int carry = 0;
  for (int base = 0; base < n; base += 32) {
    const int i = base + lane;
    const int v = i < n ? val(i) : 0;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += u;
    }
    if (i < n) store(i, carry + incl - v);
    carry += __shfl_sync(0xffffffffu, incl, 31);
  }
  return carry;
}

// Schedule tables (one warp): rows and token blocks per expert e < E_total (the last
// is the shared expert if there is one). count(e): the expert's rows. Segments are
// padded to kRowAlign rows: the scale tensor maps put the row index innermost, and a
// TMA box must start 16-byte aligned in global memory. shared_first: the shared
// expert's rows are rows [0, T) of the ring (expert parallelism writes them before
// the received counts are known) and the routed segments start at row0.
template <typename Count>
__device__ __forceinline__ void build_sched(const Sched& sc, int E_total, int BN, int lane, Count count,
                                            int row0, bool shared_first) {
  int rows_carry = row0, units_carry = 0;
  for (int base = 0; base < E_total; base += 32) {
    const int e = base + lane;
    const int c = e < E_total ? count(e) : 0;
    const bool own_rows = !(shared_first && e == E_total - 1);
    const int nb = (c + BN - 1) / BN;
    const int cpad = own_rows ? (c + kRowAlign - 1) / kRowAlign * kRowAlign : 0;
    int rc = cpad, uc = nb;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int r2 = __shfl_up_sync(0xffffffffu, rc, o), u2 = __shfl_up_sync(0xffffffffu, uc, o);
      if (lane >= o) rc += r2, uc += u2;
    }
    if (e < E_total) {
      sc.cnt[e] = c;
      sc.row_off[e] = own_rows ? rows_carry + rc - cpad : 0;
      sc.unit_off[e] = units_carry + uc - nb;
    }
    rows_carry += __shfl_sync(0xffffffffu, rc, 31);
    units_carry += __shfl_sync(0xffffffffu, uc, 31);
  }
  if (lane == 0) {
    sc.row_off[E_total] = rows_carry;
    sc.unit_off[E_total] = units_carry;
  }
}

}  // namespace
}  // namespace megamoe::kernels
