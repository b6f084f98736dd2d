// fused_moe's device side, part 4 (included by fused_moe.cu only): the kernel's roles as
// functions and the kernel (their sequence). See include/megamoe/kernels/fused_moe.h for the
// flow; the numerics are docs/numerics.md §4 and §7 and are mirrored exactly by
// ref::moe_layer(kKernelFaithful). The kernel's parts, in include order:
// fused_moe_device.cuh (arguments, tiles, the stage ring, the schedule tables),
// fused_moe_ep.cuh (the expert-parallel protocol, the epilogues' row addressing),
// fused_moe_mainloop.cuh (the consumers' K loops), then this file. The host side (workspace
// layout, tensor maps, the SM-unit probe, the plan and the launches) is fused_moe.cu.
//
// The kernel's layout (warp-specialized, one function a role and phase):
//   fused_moe_kernel     setup (init_cta, build_tables, start_schedule), phase 0
//                        (phase0_scatter or ep_pull, phase0_grid_barrier), then the roles
//   producer_warpgroup   producer_thread (fill_tile: issue_weights, issue_tokens),
//                        signal_thread, ep_pull_overlapped, combine_load_rows
//   consumer_tiles       per tile gemm1_tile (gemm1_swap_ab / gemm1_tokens_m and their
//                        epilogues) or gemm2_tile (gemm2_swap_ab / gemm2_tokens_m)
//   combine              combine_bulk or combine_warp_units
// KernelShape holds an instantiation's constants, CtaSmem its shared-memory regions,
// Consumer a consumer thread's fragment coordinates and tile counts.
//
// Roles inside one CTA of 384 threads (one CTA per SM):
//   warpgroup 0: thread 0 issues every TMA load (weights, tokens, scales)
//                into a ring of `kStages` shared-memory stages (full/empty
//                mbarriers); thread 32 publishes finished tiles to the other
//                CTAs (gpu-scope releases of the completion counters, off the
//                consumers' path); warp 3 loads the combine's slot rows at the
//                end (CombinePlan); the other threads exit after phase 0.
//   warpgroups 1, 2: wgmma consumers. A tile is 128 weight rows x block_n
//                token rows. Up to 64 tokens the weights are the wgmma M (64
//                rows per warpgroup) and the tokens N ("swap AB", so a decode
//                tile of 8 tokens wastes no M rows); at 128 tokens the tokens
//                are M (64 per warpgroup) and the 128 weight rows N, so the
//                scale fold costs one FFMA per accumulator (swap_ab()).
//
// GEMM1 tile: 128 intermediate columns of one expert (output block nblk: one
// act2 scale group, num::kInterGroup), as two 64-column halves: gate rows
// [128p + 64h, +64) and the same up rows, interleaved by 8 rows in shared memory
// by a 5-D TMA box over the checkpoint layout, so each thread's accumulator holds
// a gate value and its up partner (fragment rows r and r+8, or with tokens in M
// columns 8j and 8j+8) and SwiGLU runs in registers. A stage holds one half's 128
// weight rows (the K block's two halves in consecutive stages), or a wide tile's
// both. The epilogue multiplies the routing weight and quantizes per token over the
// tile's 128 columns (float32 scale) into act2.
// GEMM2 tile: 128 hidden outputs x block_n rows over K = I; BF16 results go to
// per-slot rows y_rows, on one device at [token][slot] (each sorted row's place
// from row_src, written in phase 0), so a token's slot rows are adjacent for the
// combine. Both GEMMs fold the tensor-core partial sum every 128 columns
// (num::kGemm1FoldK, num::kInterGroup), with scale_act * scale_w in float32.
// Finally every CTA
// reduces a share of the tokens over their slots in ascending order (routed
// 0..K-1, then shared): the output bytes do not depend on tile sizes or SM
// count.
//
// Schedule: GEMM1 tiles, then GEMM2 tiles, in a static byte-balanced order
// (TileSchedule) but for a pool of the last GEMM2 tiles, which CTAs claim from a
// counter once their own list is done; the producer carries each tile's id to the
// consumers in the first stage it fills. Weights and tokens of a stage are issued
// separately: a GEMM2 tile's weights go out while its token loads wait for the
// completion counter of its (expert, token block). Expert row segments start on
// multiples of 8 rows (kRowAlign: TMA boxes start 16-byte aligned).
//
// Pair tiles (kClusterPairs, 128-token tiles on one device, heuristics.h): clusters of two
// CTAs, in which the schedule's unit is a pair of tiles and TileSchedule's "CTA" is a
// cluster. A pair shares either its token block (output blocks 2j, 2j + 1: each CTA loads
// its own weights and 64 of the 128 token rows, multicast into both CTAs' stage) or, with
// KernelArgs::pair_weights, its weight tile (token blocks 2p, 2p + 1 of one output block:
// each CTA loads 64 of the 128 weight rows for both, and its own tokens); TileIds has the
// order. Each consumer warp hands a stage back to both CTAs (the peer's producer wrote
// into it). A CTA leaves only once the peer's consumers are done with its barriers
// (barrier.cluster).
//
// Wide tiles (kWide, heuristics.h's kWideTiles; they take the pair tiles' place where half
// tiles are off): a four-stage ring whose stage holds 256 weight rows and the token rows
// once: a GEMM1 tile's two halves, or both tiles of a GEMM2 token pair (output blocks 2j,
// 2j + 1 of one token block, TileIds with sh2 = 1), mainloop_tokens_m_blocks; a wide GEMM2
// tile counts as two tiles in done2.
#pragma once

#include <cuda.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "fused_moe_device.cuh"
#include "fused_moe_ep.cuh"
#include "fused_moe_mainloop.cuh"
#include "heuristics.h"
#include "megamoe/kernels/tile_schedule.h"
#include "megamoe/numerics/act_quant.h"
#include "megamoe/numerics/mma_model.h"
#include "route.cuh"
#include "sm90_ptx.cuh"

namespace megamoe::kernels {
namespace {  // (this header belongs to fused_moe.cu, its one includer)

// ============================================================================
// Device side: the combine's helpers and the kernel (fused_moe_device.cuh,
// fused_moe_ep.cuh and fused_moe_mainloop.cuh hold the parts it is made of)
// ============================================================================

// The CTA's roles by thread (kThreads: three warpgroups). Warpgroup 0 is the producer's
// (kProducerWarps warps): its thread kProducerThread issues every TMA load, kSignalThread
// publishes finished tiles, under expert parallelism warps kPullFirstWarp.. pull rows beside
// the tiles (ep_overlap), and warp kCombineWarp, idle after phase 0, loads the bulk combine's
// rows; the other two warpgroups consume (kConsumerThreads). At setup, before the roles,
// kProducerThread initializes the mbarriers and kSignalThread prefetches the tensor maps.
constexpr int kProducerWarps = 4;
constexpr int kProducerThread = 0;
constexpr int kSignalThread = 32;  // (warp 1's lane 0)
constexpr int kPullFirstWarp = 2, kPullWarps = 2;
constexpr int kCombineWarp = 3;
static_assert(kPullFirstWarp + kPullWarps <= kProducerWarps && kCombineWarp < kProducerWarps &&
                  kProducerWarps * 32 + kConsumerThreads == kThreads,
              "the roles of a CTA");
// Named barriers (bar.sync ids; 0 is __syncthreads'): the consumers' own, and the one that
// hands the stage ring from the consumers to the bulk combine's loads (warp kCombineWarp).
constexpr int kConsumerBarrier = 1;
constexpr int kCombineRingBarrier = 2;

// A 4 x 4 transpose of 32-bit words inside each lane quad (ql = lane % 4): afterwards
// w[m] is what lane m of the quad held in w[ql]. Two butterfly steps, two shuffles each.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int ql) {
  const bool b1 = ql & 2, b0 = ql & 1;
  uint32_t r0 = __shfl_xor_sync(0xffffffffu, b1 ? w[0] : w[2], 2);
  uint32_t r1 = __shfl_xor_sync(0xffffffffu, b1 ? w[1] : w[3], 2);
  w[0] = b1 ? r0 : w[0], w[1] = b1 ? r1 : w[1], w[2] = b1 ? w[2] : r0, w[3] = b1 ? w[3] : r1;
  r0 = __shfl_xor_sync(0xffffffffu, b0 ? w[0] : w[1], 1);
  r1 = __shfl_xor_sync(0xffffffffu, b0 ? w[2] : w[3], 1);
  w[0] = b0 ? r0 : w[0], w[2] = b0 ? r1 : w[2], w[1] = b0 ? w[1] : r0, w[3] = b0 ? w[3] : r1;
}

// sum[j] += column j of eight BF16 values (two a 32-bit word, the low 16 bits first): the
// combine's step, in slot order.
__device__ __forceinline__ void add_bf16x8(float (&sum)[8], const uint4& x) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    sum[2 * j] += __uint_as_float(w[j] << 16);
    sum[2 * j + 1] += __uint_as_float(w[j] & 0xFFFF0000u);
  }
}

// Eight floats as eight BF16 values (num::bf16x2_encode a pair).
__device__ __forceinline__ uint4 bf16x8_encode(const float (&sum)[8]) {
  return make_uint4(num::bf16x2_encode(sum[0], sum[1]), num::bf16x2_encode(sum[2], sum[3]),
                    num::bf16x2_encode(sum[4], sum[5]), num::bf16x2_encode(sum[6], sum[7]));
}

// Two E4M3 codes in one 16-bit word (lo in the low byte).
__device__ __forceinline__ uint16_t pack_e4m3x2(float lo, float hi) {
  return uint16_t(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

// The single-device combine through shared memory (kCombineCols, heuristics.h): unit u is
// token u / chunks, columns (u % chunks) * kCombineCols of every slot; CTA b takes units
// b, b + G, ...; a stage holds one unit's slot rows, slot k at k * kCombineCols * 2 bytes.
// Expert parallelism (two sources of rows), more than 32 slots or a ring without room
// for two stages keep the warp-unit combine.
struct CombinePlan {
  int slots, chunks, units, stages;
  uint32_t stage_bytes;
  bool bulk;
  __device__ CombinePlan(const KernelArgs& a, int T, int ring_bytes, bool ep) {
    slots = a.K + a.has_shared;
    chunks = (a.H + kCombineCols - 1) / kCombineCols;
    units = T * chunks;
    stage_bytes = uint32_t(slots) * kCombineCols * 2;
    stages = min(kCombineStages, ring_bytes / int(stage_bytes));
    bulk = !ep && slots <= 32 && stages >= 2;
  }
  __device__ int token(int u) const { return u / chunks; }
  __device__ int col0(int u) const { return (u - token(u) * chunks) * kCombineCols; }
  // A CTA's i-th unit: its ring stage and the parity of that stage's use.
  __device__ int stage(int i) const { return i % stages; }
  __device__ uint32_t parity(int i) const { return (i / stages) & 1; }
};

// This CTA's unit of TileSchedule: blockIdx.x (>> csh: pair tiles' clusters), or with
// a.sm_units its SM's place in the order a plain launch on an idle GPU fills the SMs
// (sm_unit, found at plan creation). The prefill layer depends on which SM runs which unit
// (TPC mates share one L2 path, and the plain launch puts units 2k, 2k + 1 on one TPC; other
// orders were slower at 4096 tokens, see docs/performance-history.md), and a launch behind
// busy SMs (a programmatic launch, another stream's kernel still running) places the CTAs in
// another order: the table keeps the idle launch's mapping whatever the placement. A measurement switch
// (a.debug.unit_stride, MEGAMOE_UNIT_STRIDE, which turns the table off) permutes the units, b * stride mod G,
// or with 0 takes the SM's id where the grid holds one CTA on each SM numbered 0..G-1. A CTA on an SM past
// either table traps: two CTAs would take one unit. Out of line: inlined, it moved the kernels' register
// allocation into spills.
__device__ __noinline__ int schedule_unit(const KernelArgs& a, int csh) {
  const int G = gridDim.x >> csh;
  if (csh == 0 && (a.sm_units || a.debug.unit_stride == 0)) {
    const uint32_t sm = sm90::smid();
    const int unit = !a.sm_units ? int(sm) : sm < uint32_t(kSmUnitSlots) ? a.sm_unit[sm] : kNoSmUnit;
    if (unit >= G) __trap();
    if (a.sm_units && a.debug.unit_turn)
      return int((uint64_t(unit) + a.epoch[0] * uint64_t(a.debug.unit_turn)) % G);
    return unit;
  }
  return int((int64_t(blockIdx.x >> csh) * a.debug.unit_stride) % G);
}

// The compile-time shape of one kernel instantiation: its template arguments and what
// follows from them, shared by every role below.
template <int BN_, bool kEp_, bool kClusterPairs_, bool kWide_>
struct KernelShape {
  static constexpr int BN = BN_;
  static constexpr bool kEp = kEp_, kClusterPairs = kClusterPairs_, kWide = kWide_;
  static constexpr int kStages = stages_for(BN, kWide);
  static constexpr int kStageBytes = stage_bytes(BN, kWide);
  static constexpr int kWBytes = (kWide ? 2 : 1) * kBlockM * kBlockK;  // a stage's weight rows
  static constexpr int kXBytes = BN * kBlockK;
  static constexpr bool kSwapAB = swap_ab(BN);
  // Pair tiles: 128-token tiles share their stages (multicast); decode tiles split a GEMM1
  // tile's halves between the two CTAs and exchange the tokens' amax (kDecodePair).
  static constexpr bool kPairTile = kClusterPairs && !kSwapAB;
  static constexpr bool kDecodePair = kClusterPairs && kSwapAB;
  // fp32 accumulators per thread: m64nBN for each of a GEMM1 tile's two halves (tokens in M:
  // two blocks of 64, also a wide GEMM2 tile's two output blocks)
  static constexpr int kAcc = kSwapAB ? BN : 128;
  // Pair tiles: the schedule's ids count pairs of tiles (TileIds), and a cluster takes the
  // place of a CTA in TileSchedule.
  static constexpr int sh1 = kPairTile ? 1 : 0;               // GEMM1 ids count pairs of tiles
  static constexpr int sh2 = kClusterPairs || kWide ? 1 : 0;  // GEMM2 ids count pairs of tiles
  static constexpr int csh = kClusterPairs ? 1 : 0;           // the schedule's unit is a cluster of two CTAs

  static_assert(num::kGemm1FoldK == kBlockK && num::kInterGroup == kBlockK,
                "both GEMMs fold once a K block (GEMM2: one intermediate scale group)");
  static_assert(kSwapAB || BN == 128, "the tokens-in-M layout is built for 128-token tiles");
  static_assert(kStages <= 16, "SmemTail holds 16 stage barriers");
  static_assert(!kClusterPairs || (!kEp && (BN == 128 || BN <= kDecodePairsMaxBlockN)),
                "pair tiles: one device");
  static_assert(!kWide || (BN == 128 && !kClusterPairs), "wide tiles: 128-token tiles, no cluster");
};

// The CTA's shared memory: the stage ring (`ring`, kStages stages) and the regions of
// SmemTail after it.
template <class S>
struct CtaSmem {
  uint8_t* ring;
  uint64_t* full_bar;   // [kStages] a stage's bytes landed (the producer's expect_tx)
  uint64_t* empty_bar;  // [kStages] its consumers are done with it
  // A consumer tile's outputs are written (8 warp arrivals, the counter to release in
  // slot_counter) -> the signal thread releases it and frees the slot.
  uint64_t* done_bar;
  uint64_t* free_bar;
  int* slot_counter;
  // The tile a stage starts, decoded by the producer (so the consumers' path has no binary
  // search over the experts and no division at a tile).
  Tile* stage_tile;
  uint64_t* comb_full;
  uint64_t* comb_empty;
  uint32_t* comb_mask;
  Sched sc;
  float* red;            // [8 warps][BN]
  float* tok_inv_scale;  // [BN]
  uint8_t* staging;      // [8 warps][16 rows][128 B], tokens in M only
  // Decode pairs, at the same place (SmemTail::xchg): the amax exchange's barriers and buffers.
  uint8_t* xchg;
  uint64_t* xchg_bar;      // [2]
  const float* xchg_amax;  // [2][64]

  // smem: the 1024-aligned start of the dynamic shared memory.
  __device__ __forceinline__ explicit CtaSmem(uint8_t* smem) : ring(smem) {
    uint8_t* tail = smem + S::kStages * S::kStageBytes;
    full_bar = reinterpret_cast<uint64_t*>(tail + SmemTail::kFullBar);
    empty_bar = reinterpret_cast<uint64_t*>(tail + SmemTail::kEmptyBar);
    done_bar = reinterpret_cast<uint64_t*>(tail + SmemTail::kDoneBar);
    free_bar = reinterpret_cast<uint64_t*>(tail + SmemTail::kFreeBar);
    slot_counter = reinterpret_cast<int*>(tail + SmemTail::kSlotCounter);
    stage_tile = reinterpret_cast<Tile*>(tail + SmemTail::kStageTile);
    comb_full = reinterpret_cast<uint64_t*>(tail + SmemTail::kCombFull);
    comb_empty = reinterpret_cast<uint64_t*>(tail + SmemTail::kCombEmpty);
    comb_mask = reinterpret_cast<uint32_t*>(tail + SmemTail::kCombMask);
    int* tables = reinterpret_cast<int*>(tail + SmemTail::kTables);
    sc = Sched{tables, tables + (kMaxExpertsTotal + 1), tables + 2 * (kMaxExpertsTotal + 1)};
    red = reinterpret_cast<float*>(tail + SmemTail::kRed);
    tok_inv_scale = reinterpret_cast<float*>(tail + SmemTail::inv_scales(S::BN));
    staging = tail + SmemTail::staging(S::BN);
    xchg = tail + SmemTail::xchg(S::BN);
    xchg_bar = reinterpret_cast<uint64_t*>(xchg + SmemTail::kXchgBar);
    xchg_amax = reinterpret_cast<const float*>(xchg + SmemTail::kXchgAmax);
  }
};

// ============================================================================
// Combine: y[t] = bf16(sum over slots, ascending, of the BF16 slot rows)
// ============================================================================

// The bulk combine's loads (warp kCombineWarp of the producer warpgroup): each unit's slot
// rows into a ring stage.
// NOTE: not warp 0: its lanes waiting for lane 0's producer loop slowed that loop (the
// consumers' data waits rose); this warp waits at the barrier below, off every issue slot,
// until the consumers are done with the ring (see docs/performance-history.md).
template <class S>
__device__ __forceinline__ void combine_load_rows(const KernelArgs& a, const CtaSmem<S>& sm,
                                                  const CombinePlan& cp, int E_total, int lane) {
  // The consumers are done with the stage ring: they join this barrier after their last
  // tile, each after the proxy fence that orders its reads of the ring before these bulk
  // copies. (The counter below orders that too, through the gpu-scope releases, but
  // compute-sanitizer's racecheck follows a barrier, not that chain.)
  sm90::named_barrier(kCombineRingBarrier, kConsumerThreads + 32);
  if (lane == 0) {
    sm90::wait_geq_acquire_gpu(&a.counters[MoeWorkspaceLayout::kCounterDone2],
                               a.n2 * sm.sc.unit_off[E_total]);
    sm90::fence_proxy_async_global();  // y_rows (the GEMM2 epilogues' generic stores)
  }
  __syncwarp();
  // Lane k < slots: whether token t has slot k's row (a routed slot without an expert
  // has none), loaded a unit ahead so the round trip overlaps the ring's waits.
  auto has_row = [&](int u) {
    if (u >= cp.units || lane >= cp.slots) return false;
    return lane >= a.K || __ldcg(a.topk_ids + cp.token(u) * a.K + lane) >= 0;
  };
  bool valid_next = has_row(blockIdx.x);
  int i = 0;
  for (int u = blockIdx.x; u < cp.units; u += gridDim.x, ++i) {
    const uint32_t mask = __ballot_sync(0xffffffffu, valid_next);
    valid_next = has_row(u + gridDim.x);
    if (lane == 0) {
      const int s = cp.stage(i), c0 = cp.col0(u);
      const uint32_t bytes = uint32_t(min(kCombineCols, a.H - c0)) * 2;
      sm90::mbar_wait(&sm.comb_empty[s], cp.parity(i) ^ 1);
      sm.comb_mask[s] = mask;  // published by the full barrier's completion
      sm90::mbar_arrive_expect_tx(&sm.comb_full[s], __popc(mask) * bytes);
      uint8_t* dst = sm.ring + s * cp.stage_bytes;
      const uint16_t* src = a.y_rows + size_t(cp.token(u)) * cp.slots * a.H + c0;
      for (int k = 0; k < cp.slots; ++k)
        if ((mask >> k) & 1)
          sm90::bulk_load(dst + k * (kCombineCols * 2), src + size_t(k) * a.H, bytes, &sm.comb_full[s]);
    }
  }
}

// The bulk combine's sums (the consumers; CombinePlan): a thread sums 8 columns of a unit
// over its slots, from the ring stage combine_load_rows filled.
template <class S>
__device__ __forceinline__ void combine_bulk(const KernelArgs& a, const CtaSmem<S>& sm, const CombinePlan& cp,
                                             int ctid, uint32_t t_comb, Prof& pf) {
  // The ring is free: each thread fences its own reads of it (the K loops' scale loads)
  // against the combine's bulk copies into it (async proxy), then syncs with the combine
  // warp -- bar.sync, not an arrive: the copies cannot land before this barrier anyway, and
  // racecheck then sees the order from both sides. (One fence, the combine lane's after the
  // barrier, with bar.arrive is what the PTX memory model accepts too, but racecheck reported
  // these loads against those copies where BN = 8 puts ring stage 0's scales inside the
  // combine's first stage.)
  sm90::fence_proxy_async_shared();
  sm90::named_barrier(kCombineRingBarrier, kConsumerThreads + 32);
  int i = 0;
  for (int u = blockIdx.x; u < cp.units; u += gridDim.x, ++i) {
    const int s = cp.stage(i);
    sm90::mbar_wait(&sm.comb_full[s], cp.parity(i));
    if (i == 0) pf.add(kPfDone2, t_comb);  // the first unit waited for every GEMM2 tile too
    const uint32_t mask = sm.comb_mask[s];
    const int t = cp.token(u);
    const int col = cp.col0(u) + ctid * 8;
    if (col < a.H) {
      const uint8_t* src = sm.ring + s * cp.stage_bytes + ctid * 16;
      float sum[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) sum[j] = 0.0f;
      // Slot order (routed 0..K-1, then shared), as combine_warp_units.
      for (int k = 0; k < cp.slots; ++k) {
        if (!((mask >> k) & 1)) continue;
        add_bf16x8(sum, *reinterpret_cast<const uint4*>(src + k * (kCombineCols * 2)));
      }
      *reinterpret_cast<uint4*>(a.y + size_t(t) * a.H + col) = bf16x8_encode(sum);
    }
    // Every thread arrives itself: with one arrival a warp (release_stage) racecheck did
    // not order the other lanes' reads before the next bulk copy into the stage.
    sm90::mbar_arrive(&sm.comb_empty[s]);
  }
}

// The warp-unit combine (expert parallelism, or where the bulk one does not fit): each
// consumer warp of the grid sums units of one token straight from global memory. Returns
// false where an expert-parallel peer timed out (the status is set; leave at once).
template <class S>
__device__ __forceinline__ bool combine_warp_units(const KernelArgs& a, const Sched& sc, int T, int E_total,
                                                   int ctid, int cwarp, int lane, uint32_t t_comb, Prof& pf) {
  // (t2 again from the shared tables: kept live across the tiles it cost a spill)
  if (ctid == 0)
    sm90::wait_geq_acquire_gpu(&a.counters[MoeWorkspaceLayout::kCounterDone2], a.n2 * sc.unit_off[E_total]);
  sm90::named_barrier(kConsumerBarrier, kConsumerThreads);
  pf.add(kPfDone2, t_comb);
  const uint16_t* ep_combine = nullptr;  // expert parallelism: routed slot rows, [T][K][H]
  if (S::kEp) {
    // Step 4's end: every GEMM2 tile of this rank is done (its rows are in the sources'
    // combine slots), so CTA 0 tells every source; step 5: wait for every owner.
    const int R = a.ep.ranks;
    const uint64_t epoch = a.ep.state[0];  // (re-read here: nothing kept live across the K loops)
    if (blockIdx.x == 0 && ctid < R) {
      __threadfence_system();
      sm90::st_release_sys(ep_signal(a.ep, ctid, EpLayout::kCombine, a.ep.rank), epoch);
    }
    const bool ok = ctid >= R || ep_wait_signal(a.ep, EpLayout::kCombine, ctid, epoch, EpStatus::kCombine);
    if (sm90::named_barrier_or(kConsumerBarrier, kConsumerThreads, !ok)) return false;
    ep_combine = ep_region<uint16_t>(a.ep.peer[a.ep.rank], a.ep.l.combine);
  }
  // Work unit: one token's 256 V-column slab (a lane: 8 V columns), over every consumer warp
  // of the grid, so a few tokens still spread over many SMs. A lane holds one slot's row
  // (shuffled to the others); all slots' loads are in flight at once and the next unit's
  // slot rows are loaded before this unit is summed: about one load round trip a unit.
  // Single device: a token's slot rows are adjacent in y_rows (gathering them from the
  // expert-sorted rows read one 512-byte piece per DRAM page).
  const int slots = a.K + a.has_shared;
  constexpr int V = kCombineVecs;  // uint4 (8 columns) a lane and slot: 32 V x 8 columns a unit
  const int slabs = (a.H + 256 * V - 1) / (256 * V);
  const int units = T * slabs;
  const int warps_total = gridDim.x * (kConsumerThreads / 32);
  int u = blockIdx.x * (kConsumerThreads / 32) + cwarp;
  int row = u < units ? combine_row<S::kEp>(a, sc, u / slabs, lane) : -1;
  for (; u < units; u += warps_total) {
    const int t = u / slabs;
    const int c8 = (u - t * slabs) * 32 * V + lane;  // uint4 of the row; + 32 v
    float sum[V][8];
#pragma unroll
    for (int v = 0; v < V; ++v)
#pragma unroll
      for (int i = 0; i < 8; ++i) sum[v][i] = 0.0f;
    for (int k0 = 0; k0 < slots; k0 += kCombineBatch) {
      uint4 x[kCombineBatch][V];
      int r[kCombineBatch];
#pragma unroll
      for (int i = 0; i < kCombineBatch; ++i) {
        r[i] = __shfl_sync(0xffffffffu, row, (k0 + i) & 31);
        if (k0 + i >= slots) r[i] = -1;
        const uint16_t* rows = S::kEp && k0 + i < a.K ? ep_combine : a.y_rows;  // (slot k0 + i's rows)
        const uint4* src = reinterpret_cast<const uint4*>(rows + size_t(r[i]) * a.H) + c8;
#pragma unroll
        for (int v = 0; v < V; ++v)
          x[i][v] = r[i] >= 0 && (c8 + 32 * v) * 8 < a.H ? __ldcg(src + 32 * v) : make_uint4(0, 0, 0, 0);
      }
      if (k0 + kCombineBatch >= slots) {  // the last batch: the next unit's rows load meanwhile
        const int un = u + warps_total;
        row = un < units ? combine_row<S::kEp>(a, sc, un / slabs, lane) : -1;
      }
      // Sum in slot order (routed 0..K-1, then shared): the bytes do not depend on the split.
#pragma unroll
      for (int i = 0; i < kCombineBatch; ++i) {
        if (r[i] < 0) continue;
#pragma unroll
        for (int v = 0; v < V; ++v) add_bf16x8(sum[v], x[i][v]);
      }
    }
#pragma unroll
    for (int v = 0; v < V; ++v) {
      if ((c8 + 32 * v) * 8 >= a.H) break;
      reinterpret_cast<uint4*>(a.y + size_t(t) * a.H)[c8 + 32 * v] = bf16x8_encode(sum[v]);
    }
  }
  return true;
}

// The consumers' combine after their last tile: the bulk one where CombinePlan allows it,
// else the warp-unit one. False: an expert-parallel peer timed out (leave at once).
template <class S>
__device__ __forceinline__ bool combine(const KernelArgs& a, const CtaSmem<S>& sm, int T, int E_total,
                                        int ctid, int cwarp, int lane, uint32_t t_start, Prof& pf) {
  const uint32_t t_comb = pf.now();
  const CombinePlan cp(a, T, S::kStages * S::kStageBytes, S::kEp);
  if (cp.bulk)
    combine_bulk<S>(a, sm, cp, ctid, t_comb, pf);
  else if (!combine_warp_units<S>(a, sm.sc, T, E_total, ctid, cwarp, lane, t_comb, pf))
    return false;
  pf.add(kPfCombine, t_comb);
  pf.add(kPfTotal, t_start);
  if (ctid == 0) pf.store(0, kPfProdTotal);
  return true;
}

// ============================================================================
// Producer warpgroup: the TMA producer (thread 0), the signal thread (thread 32), the
// expert-parallel pull warps and the combine's loads
// ============================================================================

// A stage's weights and its tokens are issued separately: the weights never depend on
// anything, the tokens on phase 0 (GEMM1) or on the tile's GEMM1 units (GEMM2), so weight
// loads start before those are done.
// w_tag (std::bool_constant): the tile's pair shares its weights (Tile::pair_weights); g_tag
// (std::integral_constant): the tile's GEMM; both decided once a tile (fill_tile's caller)
// so a stage's path has no branch on them. h: a GEMM1 tile's half (one-block stages).
template <class S, class WTag, class GTag>
__device__ __forceinline__ void issue_weights(WTag, GTag, const KernelArgs& a, const TensorMaps& tm,
                                              const CtaSmem<S>& sm, bool no_loads, const Tile& tl, int kb,
                                              int h, int stage) {
  constexpr bool kGemm1 = GTag::value == 1;
  if (no_loads) return;
  uint8_t* w_s = sm.ring + stage * S::kStageBytes;
  uint64_t* full = &sm.full_bar[stage];
  const bool shared = tl.e == a.E;
  if constexpr (S::kWide) {
    // Two blocks in one box: GEMM1 the tile's 16 8-row gate / up groups (both halves), GEMM2
    // output blocks nblk (even) and nblk + 1, 256 rows; block 1's rows start at 16 KB.
    if constexpr (kGemm1)
      sm90::tma_load_5d(w_s, shared ? &tm.sw13w : &tm.w13w, full, kb * 128, 0, 0, tl.nblk * 16,
                        shared ? 0 : tl.e);
    else
      sm90::tma_load_3d(w_s, shared ? &tm.sw2w : &tm.w2w, full, kb * 128, tl.nblk * 128, shared ? 0 : tl.e);
  } else if constexpr (WTag::value) {
    // A pair sharing its weights: this CTA's 64 of the stage's 128 weight rows into both
    // CTAs' stage (GEMM1: 4 of the half's 8 gate / up row groups of 16).
    const int part = int(sm90::cluster_ctarank());
    if constexpr (kGemm1)
      sm90::tma_load_5d_multicast(w_s + part * 64 * 128, shared ? &tm.sw13_part : &tm.w13_part, full,
                                  kb * 128, 0, 0, tl.nblk * 16 + h * 8 + part * 4, shared ? 0 : tl.e, 0x3);
    else
      sm90::tma_load_3d_multicast(w_s + part * 64 * 128, shared ? &tm.sw2_part : &tm.w2_part, full, kb * 128,
                                  tl.nblk * 128 + part * 64, shared ? 0 : tl.e, 0x3);
  } else if constexpr (kGemm1) {
    sm90::tma_load_5d(w_s, shared ? &tm.sw13 : &tm.w13, full, kb * 128, 0, 0, tl.nblk * 16 + h * 8,
                      shared ? 0 : tl.e);
  } else {
    sm90::tma_load_3d(w_s, shared ? &tm.sw2 : &tm.w2, full, kb * 128, tl.nblk * 128, shared ? 0 : tl.e);
  }
}

// A stage's token rows and their scales (K block kb of the tile).
template <class S, class WTag, class GTag>
__device__ __forceinline__ void issue_tokens(WTag, GTag, const TensorMaps& tm, const CtaSmem<S>& sm,
                                             bool no_loads, const Tile& tl, int kb, int stage) {
  if (no_loads) return;
  uint8_t* x_s = sm.ring + stage * S::kStageBytes + S::kWBytes;
  uint8_t* s_s = x_s + S::kXBytes;
  uint64_t* full = &sm.full_bar[stage];
  // Pair tiles: this CTA's 64 of the tile's token rows into both CTAs' stage (the
  // peer loads the other 64); the scales each CTA loads for itself.
  auto rows = [&](const CUtensorMap* map, const CUtensorMap* part_map) {
    if constexpr (S::kPairTile && !WTag::value) {
      const int part = int(sm90::cluster_ctarank());
      sm90::tma_load_2d_multicast(x_s + part * 64 * 128, part_map, full, kb * 128, tl.row0 + part * 64, 0x3);
    } else {
      sm90::tma_load_2d(x_s, map, full, kb * 128, tl.row0);
    }
  };
  if constexpr (GTag::value == 1) {
    rows(&tm.x, &tm.x_part);
    sm90::tma_load_2d(s_s, &tm.xs, full, tl.row0, kb);
  } else {
    rows(&tm.a2, &tm.a2_part);
    sm90::tma_load_2d(s_s, &tm.a2s, full, tl.row0, kb);
  }
}

// A CTA's next tile: its own list's, then claims of the pool (TileSchedule).
template <class S>
__device__ __forceinline__ int claim_next_tile(const KernelArgs& a, TileSchedule& sch, int tiles) {
  const int t = sch.next();
  if constexpr (S::kClusterPairs) return t;  // (no pool)
  return t == sch.pool_begin() && t < tiles ? t + atomicAdd(&a.counters[MoeWorkspaceLayout::kCounterPool], 1)
                                            : t;
}

// What the producer's functions share: the kernel's arguments and tensor maps, the CTA's
// shared memory, the GEMM1-done counters, whether loads are skipped (kSkipLoads) and a
// stage's bytes (stage_tx: computed by the kernel before phase 0), and the profile.
template <class S>
struct ProducerCtx {
  const KernelArgs& a;
  const TensorMaps& tm;
  const CtaSmem<S>& sm;
  int* done1;
  bool no_loads;
  uint32_t stage_tx;
  Prof& pf;
};

// The producer's loads of one tile's stages. ready: the tile's dependency (done1[unit] >=
// need) is met; until it is, stages go out with their weights only and their tokens are
// issued once it is (at most kStages of them deferred).
template <class S, class WTag, class GTag>
__device__ __forceinline__ void fill_tile(WTag w_tag, GTag g_tag, const ProducerCtx<S>& p, const Tile& tl,
                                          RingPos<S::kStages>& rp, bool& ready, int need) {
  const KernelArgs& a = p.a;
  const TensorMaps& tm = p.tm;
  const CtaSmem<S>& sm = p.sm;
  int* done1 = p.done1;
  const bool no_loads = p.no_loads;
  const uint32_t stage_tx = p.stage_tx;
  Prof& pf = p.pf;
  constexpr int kStages = S::kStages;
  constexpr bool kSwapAB = S::kSwapAB, kDecodePair = S::kDecodePair, kEp = S::kEp;
  // The stage's bytes of its weights (from stage_tx: one value less live in the producer's loop)
  const uint32_t weight_tx = stage_tx ? uint32_t(S::kWBytes) : 0u;
  // Stage i of the tile: K block i (of this CTA's half of a decode pair's GEMM1 tile), or
  // for a GEMM1 tile on one-block stages (kHalves) one K block of one half: decode tiles
  // half 0's K blocks, then half 1's; tokens in M the halves of a K block in turn. (On
  // one device only a GEMM2 tile defers its tokens, one stage a K block; with the
  // expert-parallel pull overlapped a routed GEMM1 tile also waits for its rows.)
  constexpr bool kHalves = GTag::value == 1 && !S::kWide && !kDecodePair;
  const int stages = (kHalves ? 2 : 1) * tl.kblocks;
  // Stage i's half and K block.
  auto half_of = [&](int i) {
    return !kHalves  ? (kDecodePair ? int(sm90::cluster_ctarank()) : 0)
           : kSwapAB ? (i >= tl.kblocks)
                     : (i & 1);
  };
  auto kblock_of = [&](int i) { return !kHalves ? i : kSwapAB ? i - half_of(i) * tl.kblocks : (i >> 1); };
  int deferred = 0;  // the last `deferred` stages filled: weights issued, tokens not yet
  for (int i = 0;; ++i) {
    // NOTE: at most kStages deferred stages: the next empty-wait must concern a stage
    // whose tokens were issued, or the consumers could never free it.
    if (!ready && (deferred == kStages || i == stages)) {
      const uint32_t t0 = pf.now();
      sm90::wait_geq_acquire_gpu(&done1[tl.unit], need);
      pf.add(kPfProdDep, t0);
      ready = true;
    }
    if (ready && deferred > 0) {
      sm90::fence_proxy_async_global();
      for (int d = 0; d < deferred; ++d) {
        int st = rp.stage - deferred + d;
        if (st < 0) st += kStages;
        if constexpr (kEp) sm90::mbar_arrive_expect_tx(&sm.full_bar[st], stage_tx - weight_tx);
        // (on one device only GEMM2 tiles defer: their stage is their K block)
        issue_tokens<S>(w_tag, g_tag, tm, sm, no_loads, tl,
                        kEp ? kblock_of(i - deferred + d) : i - deferred + d, st);
      }
      deferred = 0;
    }
    if (i == stages) break;
    const int stage = rp.stage;
    const uint32_t t0 = pf.now();
    sm90::mbar_wait(&sm.empty_bar[stage], rp.phase ^ 1);
    pf.add(kPfProdEmpty, t0);
    if (i == 0) sm.stage_tile[stage] = tl;  // published by the full barrier's completion
    // Expert parallelism: a stage arrives with its tokens (below, or when deferred ones
    // go out), so the arrival follows the acquire of their unit's count and the
    // consumers' generic reads of what the pull wrote beside the TMA data (row weights,
    // sources) are ordered after it. (One device defers only GEMM2 tiles, whose generic
    // reads phase 0 wrote before its grid barrier: one arrival with every byte.)
    if constexpr (kEp)
      sm90::mbar_expect_tx(&sm.full_bar[stage], weight_tx);
    else
      sm90::mbar_arrive_expect_tx(&sm.full_bar[stage], stage_tx);
    const int h = half_of(i), kb = kblock_of(i);
    issue_weights<S>(w_tag, g_tag, a, tm, sm, no_loads, tl, kb, h, stage);
    if (ready) {
      if constexpr (kEp) sm90::mbar_arrive_expect_tx(&sm.full_bar[stage], stage_tx - weight_tx);
      issue_tokens<S>(w_tag, g_tag, tm, sm, no_loads, tl, kb, stage);
    } else {
      ++deferred;
    }
    rp.advance();
  }
}

// The TMA producer (thread 0): every tile of the CTA's schedule, stage by stage, then a
// sentinel stage (Tile::gemm = 0) that ends the consumers' loop.
template <class S>
__device__ __forceinline__ void producer_thread(const ProducerCtx<S>& p, const TileIds& ids,
                                                TileSchedule& sched, int first_tile) {
  const KernelArgs& a = p.a;
  const CtaSmem<S>& sm = p.sm;
  int* done1 = p.done1;
  Prof& pf = p.pf;
  const int t1_routed = ids.t1_routed, t1 = ids.t1, tiles = ids.tiles();
  const uint32_t t_prod = pf.now();
  sm90::fence_proxy_async_global();
  sm90::fence_proxy_async_shared();  // the phase-0 tables (generic writes) before TMA fills the stage
  RingPos<S::kStages> rp;            // the next stage to fill
  int tile = first_tile;
  for (;;) {
    if (tile >= tiles) {
      // Sentinel stage: tells the consumers there is no further tile.
      sm90::mbar_wait(&sm.empty_bar[rp.stage], rp.phase ^ 1);
      sm.stage_tile[rp.stage].gemm = 0;
      sm90::mbar_arrive(&sm.full_bar[rp.stage]);
      pf.add(kPfProdTotal, t_prod);
      pf.store(kPfProdTotal, kPfSlots);
      break;
    }
    // (wide GEMM2 tiles: the pair's rank-0 tile, nblk even; the consumers add block nblk + 1)
    const Tile tl = decode_tile<S::BN>(a, sm.sc, tile, t1_routed, t1, S::sh1, S::sh2,
                                       S::kClusterPairs ? sm90::cluster_ctarank() : 0);
    // The tile after this one, chosen now: a pool claim's round trip overlaps this
    // tile's loads (it is used at the end of the loop).
    const int next = claim_next_tile<S>(a, sched, tiles);
    // GEMM2 needs every GEMM1 tile of its (expert, token block).
    // (decode pairs: each CTA publishes its half of a GEMM1 tile)
    // Expert parallelism with the pull overlapped: the unit's done1 counts its pulled rows
    // first (ep_pull_overlapped), so both GEMMs of a routed unit wait for those too.
    int need = (tl.e == a.E ? a.Is : a.I) / 128 * (S::kDecodePair ? 2 : 1);
    if constexpr (S::kEp) need = (tl.gemm == 1 ? 0 : need) + (a.ep_overlap && tl.e < a.E ? tl.rows : 0);
    // (timing only: what the dependency costs, the wait and the acquiring load both)
    if (a.debug.skip & kSkipDeps) need = 0;
    const uint32_t t0 = pf.now();
    bool ready = need == 0 || (!S::kEp && tl.gemm == 1) || sm90::ld_acquire_gpu(&done1[tl.unit]) >= need;
    if (!a.debug.early_weights && !ready) {
      sm90::wait_geq_acquire_gpu(&done1[tl.unit], need);
      ready = true;
    }
    pf.add(kPfProdDep, t0);
    // The tile's stages: the pairing and the GEMM are chosen once a tile, so a stage's path
    // has no branch on them.
    auto fill_gemm = [&](auto w_tag) {
      if (tl.gemm == 1)
        fill_tile<S>(w_tag, std::integral_constant<int, 1>{}, p, tl, rp, ready, need);
      else
        fill_tile<S>(w_tag, std::integral_constant<int, 2>{}, p, tl, rp, ready, need);
    };
    if constexpr (S::kPairTile) {
      if (tl.pair_weights)
        fill_gemm(std::true_type{});
      else
        fill_gemm(std::false_type{});
    } else {
      fill_gemm(std::false_type{});
    }
    tile = next;
  }
}

// The signal thread (thread 32): publishes each finished tile to the other CTAs.
// NOTE: the release runs here, off the consumers' path: they arrive on done_bar and go on
// (a release waits for their stores; on a consumer thread it cost ~1 us a tile).
// Cumulativity: the lanes' stores are ordered before their warp's mbarrier arrive
// (release.cta), observed by this thread's wait (acquire.cta), so its gpu-scope release
// covers them.
template <class S>
__device__ __forceinline__ void signal_thread(const KernelArgs& a, const CtaSmem<S>& sm) {
  for (int n = 0;; ++n) {
    const int slot = n % kTileSlots;
    sm90::mbar_wait(&sm.done_bar[slot], (n / kTileSlots) & 1);
    const int counter = sm.slot_counter[slot];
    if (counter < 0) break;  // the consumers saw the last tile
    sm90::red_release_gpu_add(&a.counters[counter], 1);
    sm90::mbar_arrive(&sm.free_bar[slot]);
  }
}

// Warpgroup 0 after phase 0: thread 0 the TMA producer, thread 32 the signal thread, with
// the expert-parallel pull overlapped warps 2-3 the pull; then warp kCombineWarp the bulk
// combine's loads. The other threads leave.
template <class S>
__device__ __forceinline__ void producer_warpgroup(const ProducerCtx<S>& p, const TileIds& ids,
                                                   TileSchedule& sched, int first_tile, int T, int E_total,
                                                   int tid, int warp, int lane) {
  const KernelArgs& a = p.a;
  const CtaSmem<S>& sm = p.sm;
  sm90::setmaxnreg_dec<kProducerRegs>();
  if (tid == kProducerThread)
    producer_thread<S>(p, ids, sched, first_tile);
  else if (S::kEp && a.ep_overlap && warp >= kPullFirstWarp)
    ep_pull_overlapped<S::BN>(a, sm.sc, p.done1, warp - kPullFirstWarp,
                              kPullWarps);  // step 3, beside the tiles
  else if (tid == kSignalThread)
    signal_thread<S>(a, sm);
  const CombinePlan cp(a, T, S::kStages * S::kStageBytes, S::kEp);
  if (warp == kCombineWarp && cp.bulk && a.debug.stop != 3) combine_load_rows<S>(a, sm, cp, E_total, lane);
}

// ============================================================================
// Consumer warpgroups: the K loops (fused_moe_mainloop.cuh) and the epilogues
// ============================================================================

// A consumer thread's place in the warpgroups' fragments and its counts of finished tiles,
// carried across the tiles.
template <class S>
struct Consumer {
  int lane;
  int ctid;   // 0..255
  int wg;     // warpgroup 0, 1
  int wwarp;  // warp inside the warpgroup
  int cwarp;  // 0..7
  int lrow;   // fragment row (and row + 8)
  int lcol;   // fragment column (and + 1), plus 8 * j
  // Pair tiles: a stage goes back to both CTAs (the peer's producer wrote half of its
  // token or weight rows here and waits for this CTA's consumers too).
  uint32_t peer_empty;
  int ntile = 0;   // tiles this CTA finished (the done_bar / free_bar slot sequence)
  int nsplit = 0;  // split wide GEMM1 tiles this CTA finished (their amax exchange's buffer)
  int nxchg = 0;   // decode pairs: amax exchanges with the peer CTA (their buffer and parity)
  int rank;        // pair tiles: this CTA's rank in its cluster
  // Decode pairs: the peer's exchange region, as a shared::cluster address.
  uint32_t peer_xchg;

  __device__ __forceinline__ Consumer(const CtaSmem<S>& sm, int tid, int lane_)
      : lane(lane_), ctid(tid - 128) {
    // Broadcast from lane 0: ptxas then knows wg is warp-uniform and keeps what derives from
    // it (the wgmma descriptors, the ring position) in uniform registers, not in vector
    // registers copied over by R2UR at every wgmma (see docs/performance-history.md).
    wg = __shfl_sync(0xffffffffu, ctid / 128, 0);
    wwarp = (ctid / 32) % 4;
    cwarp = ctid / 32;
    lrow = wwarp * 16 + lane / 4;
    lcol = (lane % 4) * 2;
    peer_empty =
        S::kPairTile ? sm90::mapa_shared(sm90::smem_u32(sm.empty_bar), sm90::cluster_ctarank() ^ 1u) : 0u;
    rank = S::kClusterPairs ? int(sm90::cluster_ctarank()) : 0;
    peer_xchg = S::kDecodePair ? sm90::mapa_shared(sm90::smem_u32(sm.xchg), uint32_t(rank) ^ 1u) : 0u;
  }

  // Half tiles (a.half_tiles, kHalfTileMaxAvgRows): a 128-token tile of at most 64 rows has
  // none in warpgroup 1's half, which then only hands the stages back (kSkipMma in
  // mainloop_tokens_m), so the tensor cores run warpgroup 0's chains alone; its epilogue
  // stores nothing. (The producer still loads all 128 token rows: choosing a 64-row box
  // there spilled its registers in the stage loop.) Tokens-in-M tiles only.
  __device__ __forceinline__ int wg_idle(const KernelArgs& a, const Tile& tl) const {
    return a.half_tiles && wg * 64 >= tl.rows ? kSkipMma : 0;
  }

  // This warp's outputs of the tile are written: hand the counter to release (index in
  // a.counters; -1 = no more tiles) to the signal thread.
  __device__ __forceinline__ void tile_written(const CtaSmem<S>& sm, int counter, Prof& pf) {
    const int slot = ntile % kTileSlots, use = ntile / kTileSlots;
    const uint32_t t0 = pf.now();
    if (use > 0) sm90::mbar_wait(&sm.free_bar[slot], (use - 1) & 1);  // the slot's last tile is published
    pf.add(kPfSlotWait, t0);
    if (cwarp == 0 && lane == 0) sm.slot_counter[slot] = counter;
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(&sm.done_bar[slot]);
    ++ntile;
  }
};

// GEMM1 epilogue, tokens in N (swap AB): SwiGLU x routing weight, 1x128 E4M3 quantization.
// In half h (acc[h * BN / 2 ..]) the thread holds gate (row lrow) and up (row lrow + 8)
// of intermediate column 64 h + wg * 32 + wwarp * 8 + lane / 4 for tokens j * 8 + lcol
// + {0, 1} (decode pairs: one half, the CTA's rank). swiglu_fast when the whole warp's
// gates allow it; straight-line code either way (columns past tl.rows are computed too,
// with weight 0, and never stored), so ptxas overlaps the thread's SwiGLUs.
template <class S>
__device__ __forceinline__ void epilogue1_swap_ab(const KernelArgs& a, const CtaSmem<S>& sm, Consumer<S>& cs,
                                                  const Tile& tl, float (&acc)[S::kAcc],
                                                  const float (&rw)[S::BN / 8][2]) {
  constexpr int BN = S::BN;
  constexpr bool kDecodePair = S::kDecodePair;
  constexpr int kHalf = BN / 2, kHeld = kDecodePair ? 1 : 2;
  const int lane = cs.lane, lcol = cs.lcol, ctid = cs.ctid;
  bool fast_ok = true;
#pragma unroll
  for (int h = 0; h < kHeld; ++h)
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        fast_ok &=
            (j * 8 + lcol + c >= tl.rows) | num::swiglu_fast_ok(acc[h * kHalf + j * 4 + c], a.swiglu_limit);
  auto swiglu_rows = [&](auto act, float limit) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int n = j * 8 + lcol + c;
        float m = 0.0f;
#pragma unroll
        for (int h = 0; h < kHeld; ++h) {
          const int i = h * kHalf + j * 4 + c;
          const float v = act(acc[i], acc[i + 2], limit, rw[j][c]);
          acc[i] = v;
          m = fmaxf(m, fabsf(v));
        }
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
        if (lane < 4) sm.red[cs.cwarp * BN + n] = m;
      }
    }
  };
  run_swiglu(swiglu_rows, __all_sync(0xffffffffu, fast_ok), a.swiglu_limit);
  sm90::named_barrier(kConsumerBarrier, kConsumerThreads);
  // One thread a token works out its scale (to act2_scale) and the reciprocal the stores
  // use, once (not every thread for each of its tokens: 8 loads and two divisions an element).
  if (ctid < BN) {
    float amax = sm.red[ctid];
#pragma unroll
    for (int w = 1; w < 8; ++w) amax = fmaxf(amax, sm.red[w * BN + ctid]);
    if constexpr (kDecodePair) {
      // The other half's maxima come from the peer CTA: each sends its own into the
      // peer's buffer (st.async, counted on the peer's exchange barrier) and waits for
      // the peer's in its own. Two buffers by the exchanges' parity: the peer sends the
      // next-but-one tile's maxima only after it received the next tile's from this CTA,
      // sent after this CTA read these.
      const int b = cs.nxchg & 1;
      if (ctid == 0) sm90::mbar_arrive_expect_tx(&sm.xchg_bar[b], BN * 4);
      sm90::st_async_cluster(cs.peer_xchg + uint32_t(SmemTail::kXchgAmax + (b * 64 + ctid) * 4), amax,
                             cs.peer_xchg + uint32_t(SmemTail::kXchgBar + b * 8));
      sm90::mbar_wait(&sm.xchg_bar[b], (cs.nxchg >> 1) & 1);
      amax = fmaxf(amax, sm.xchg_amax[b * 64 + ctid]);
    }
    const float s = num::act_scale(amax);
    sm.tok_inv_scale[ctid] = 1.0f / s;
    if (ctid < tl.rows && (!kDecodePair || cs.rank == 0))
      a.act2_scale[size_t(tl.nblk) * a.rows_cap + tl.row0 + ctid] = s;
  }
  if constexpr (kDecodePair) ++cs.nxchg;
  sm90::named_barrier(kConsumerBarrier, kConsumerThreads);
  const int col = tl.nblk * 128 + (kDecodePair ? cs.rank * 64 : 0) + cs.wg * 32 + cs.wwarp * 8 + lane / 4;
#pragma unroll
  for (int h = 0; h < kHeld; ++h)
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int n = j * 8 + lcol + c;
        if (n < tl.rows)
          a.act2[size_t(tl.row0 + n) * a.inter_pitch + col + h * 64] =
              to_e4m3(acc[h * kHalf + j * 4 + c] * sm.tok_inv_scale[n]);
      }
    }
}

// GEMM1, tokens in N (swap AB): the K loop, then epilogue1_swap_ab. Returns the epilogue's
// start (profile).
template <class S>
__device__ __forceinline__ uint32_t gemm1_swap_ab(const KernelArgs& a, const CtaSmem<S>& sm, Consumer<S>& cs,
                                                  const Tile& tl, const float* sg_row, const float* su_row,
                                                  float (&acc)[S::kAcc], RingPos<S::kStages>& rp, Prof& pf) {
  constexpr int BN = S::BN;
  // Routing weights of this thread's tokens, loaded before the K loop hides the latency.
  float rw[BN / 8][2];
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int n = j * 8 + cs.lcol + c;
      rw[j][c] = n < tl.rows ? __ldcg(a.row_weight + tl.row0 + n) : 0.0f;
    }
  mainloop_swap_ab<BN, 1, !S::kDecodePair>(acc, tl.kblocks, rp, sm.ring, sm.full_bar, sm.empty_bar, cs.wg,
                                           cs.lcol, sg_row, su_row, a.debug.skip, pf);
  const uint32_t t_epi = pf.now();
  epilogue1_swap_ab<S>(a, sm, cs, tl, acc, rw);
  return t_epi;
}

// SwiGLU x routing weight of one 64-column block, tokens in M (epilogue1_tokens_m); the
// rows' amax into m0, m1. swiglu_fast when the whole warp's gates allow it; straight-line
// code either way (rows past tl.rows are computed too, with weight 0, and never stored),
// so ptxas overlaps the thread's 32 SwiGLUs.
__device__ __forceinline__ void swiglu_block_tokens_m(float (&ac)[64], const Tile& tl, int n0, int n1r,
                                                      float rw0, float rw1, float swiglu_limit, float& m0,
                                                      float& m1) {
  bool ok0 = true, ok1 = true;
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      ok0 &= num::swiglu_fast_ok(ac[8 * i + c], swiglu_limit);
      ok1 &= num::swiglu_fast_ok(ac[8 * i + 2 + c], swiglu_limit);
    }
  const bool fast_ok = ((n0 >= tl.rows) | ok0) & ((n1r >= tl.rows) | ok1);
  auto swiglu_rows = [&](auto act, float limit) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float v0 = act(ac[8 * i + c], ac[8 * i + 4 + c], limit, rw0);
        const float v1 = act(ac[8 * i + 2 + c], ac[8 * i + 6 + c], limit, rw1);
        ac[8 * i + c] = v0;
        ac[8 * i + 2 + c] = v1;
        m0 = fmaxf(m0, fabsf(v0));
        m1 = fmaxf(m1, fabsf(v1));
      }
    }
  };
  run_swiglu(swiglu_rows, __all_sync(0xffffffffu, fast_ok), swiglu_limit);
}

// The E4M3 codes of one 64-column block, tokens in M, to act2 (columns col0..col0 + 63;
// scale: also the rows' act2_scale). A token's 64 codes of a block sit in one lane quad,
// two bytes a lane every 8 columns: a 4 x 4 word transpose inside the quad gives each lane
// 16 adjacent bytes, one 16-byte store a row and block.
__device__ __forceinline__ void store_block_tokens_m(const KernelArgs& a, const Tile& tl, float (&ac)[64],
                                                     int col0, bool scale, int n0, int n1r, int ql,
                                                     float inv0, float s0, float inv1, float s1) {
  auto store_row = [&](int n, int base, float inv, float s) {
    uint32_t w[4];  // w[k]: columns 16k + lcol + {0, 1} (lo) and 16k + 8 + lcol + {0, 1} (hi)
#pragma unroll
    for (int k = 0; k < 4; ++k)
      w[k] = uint32_t(pack_e4m3x2(ac[16 * k + base] * inv, ac[16 * k + base + 1] * inv)) |
             (uint32_t(pack_e4m3x2(ac[16 * k + 8 + base] * inv, ac[16 * k + 8 + base + 1] * inv)) << 16);
    quad_transpose(w, ql);  // w[m]: lane m's word ql
    if (n < tl.rows) {
      const uint4 v = make_uint4(__byte_perm(w[0], w[1], 0x5410), __byte_perm(w[2], w[3], 0x5410),
                                 __byte_perm(w[0], w[1], 0x7632), __byte_perm(w[2], w[3], 0x7632));
      *reinterpret_cast<uint4*>(a.act2 + size_t(tl.row0 + n) * a.inter_pitch + col0 + 16 * ql) = v;
      if (scale && ql == 0) a.act2_scale[size_t(tl.nblk) * a.rows_cap + tl.row0 + n] = s;
    }
  };
  store_row(n0, 0, inv0, s0);
  store_row(n1r, 2, inv1, s1);
}

// GEMM1 epilogue, tokens in M: SwiGLU x routing weight, 1x128 E4M3. The thread holds tokens
// n0 = rbase + lrow and n0 + 8; in half h (acc_block<h>) for i in 0..7 the gate (ac[8i + c],
// j = 2i) and up (ac[8i + 4 + c], j = 2i + 1) values of intermediate column 64 h + 8i + lcol
// + c. A token's 64 columns of a half sit in one lane quad. (A split wide tile: warpgroup wg
// holds half wg of rows 0..63.)
template <class S>
__device__ __forceinline__ void epilogue1_tokens_m(const KernelArgs& a, const CtaSmem<S>& sm, Consumer<S>& cs,
                                                   const Tile& tl, bool split, int n0p, float rw0, float rw1,
                                                   float (&acc)[S::kAcc]) {
  const int n0 = n0p, n1r = n0 + 8;
  const int ql = cs.lane % 4;
  float m0 = 0.0f, m1 = 0.0f;  // the rows' amax
  swiglu_block_tokens_m(acc_block<0>(acc), tl, n0, n1r, rw0, rw1, a.swiglu_limit, m0, m1);
  if (!split) swiglu_block_tokens_m(acc_block<1>(acc), tl, n0, n1r, rw0, rw1, a.swiglu_limit, m0, m1);
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, o));
    m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, o));
  }
  if (split) {
    // The other half's row maxima through shared memory, in one of two buffers by the
    // split tiles' parity: a warpgroup writes the next split tile's maxima only after
    // both passed this one's barrier, so after the other read these.
    const int wg = cs.wg;
    float* xm = sm.red + (cs.nsplit & 1) * 128;
    if (ql == 0) xm[wg * 64 + n0] = m0, xm[wg * 64 + n1r] = m1;
    sm90::named_barrier(kConsumerBarrier, kConsumerThreads);
    m0 = fmaxf(m0, xm[(wg ^ 1) * 64 + n0]);
    m1 = fmaxf(m1, xm[(wg ^ 1) * 64 + n1r]);
    ++cs.nsplit;
  }
  const float s0 = num::act_scale(m0), s1 = num::act_scale(m1);
  const float inv0 = 1.0f / s0, inv1 = 1.0f / s1;
  store_block_tokens_m(a, tl, acc_block<0>(acc), tl.nblk * 128 + (split ? cs.wg * 64 : 0),
                       !split || cs.wg == 0, n0, n1r, ql, inv0, s0, inv1, s1);
  if (!split)
    store_block_tokens_m(a, tl, acc_block<1>(acc), tl.nblk * 128 + 64, false, n0, n1r, ql, inv0, s0, inv1,
                         s1);
}

// GEMM1, tokens in M: the K loop (a wide tile's two halves, or a split wide tile's half of
// warpgroup wg), then epilogue1_tokens_m. Returns the epilogue's start (profile).
template <class S>
__device__ __forceinline__ uint32_t gemm1_tokens_m(const KernelArgs& a, const CtaSmem<S>& sm, Consumer<S>& cs,
                                                   const Tile& tl, bool split, int rbase, const float* sg_row,
                                                   const float* su_row, float (&acc)[S::kAcc],
                                                   RingPos<S::kStages>& rp, Prof& pf) {
  const int n0p = rbase + cs.lrow;
  const float rw0 = n0p < tl.rows ? __ldcg(a.row_weight + tl.row0 + n0p) : 0.0f;
  const float rw1 = n0p + 8 < tl.rows ? __ldcg(a.row_weight + tl.row0 + n0p + 8) : 0.0f;
  if constexpr (S::kWide) {
    if (split)
      mainloop_tokens_m<1, false, true>(acc_block<0>(acc), tl.kblocks, rp, sm.ring, sm.full_bar, sm.empty_bar,
                                        0, 0, cs.wg, cs.lrow, sg_row, su_row, a.debug.skip, pf);
    else
      mainloop_tokens_m_blocks<1, true, false>(acc, tl.kblocks, rp, sm.ring, sm.full_bar, sm.empty_bar, 0,
                                               rbase, cs.lrow, sg_row, su_row, nullptr,
                                               a.debug.skip | cs.wg_idle(a, tl), pf);
  } else {
    mainloop_tokens_m_blocks<1, false, S::kClusterPairs>(
        acc, tl.kblocks, rp, sm.ring, sm.full_bar, sm.empty_bar, cs.peer_empty, rbase, cs.lrow, sg_row,
        su_row, nullptr, a.debug.skip | cs.wg_idle(a, tl), pf);
  }
  const uint32_t t_epi = pf.now();
  epilogue1_tokens_m<S>(a, sm, cs, tl, split, n0p, rw0, rw1, acc);
  return t_epi;
}

// A GEMM1 tile: 128 intermediate columns of one expert into act2 and act2_scale, then its
// unit's done1 count (the signal thread's release).
template <class S>
__device__ __forceinline__ void gemm1_tile(const KernelArgs& a, const CtaSmem<S>& sm, Consumer<S>& cs,
                                           const Tile& tl, bool split, int rbase, float (&acc)[S::kAcc],
                                           RingPos<S::kStages>& rp, Prof& pf) {
  const bool shared = tl.e == a.E;
  const int I_e = shared ? a.Is : a.I;
  const float* wsc = shared ? a.sw13_scale : a.w13_scale + size_t(tl.e) * (2 * (a.I / 128)) * (a.H / 128);
  const float* sg_row = wsc + size_t(tl.nblk) * (a.H / 128);
  const float* su_row = wsc + size_t(I_e / 128 + tl.nblk) * (a.H / 128);
  uint32_t t_epi;
  if constexpr (S::kSwapAB)
    t_epi = gemm1_swap_ab<S>(a, sm, cs, tl, sg_row, su_row, acc, rp, pf);
  else
    t_epi = gemm1_tokens_m<S>(a, sm, cs, tl, split, rbase, sg_row, su_row, acc, rp, pf);
  // act2 is read next by other CTAs' TMA (async proxy): the proxy fence, then the
  // signal thread's release of done1 (see tile_written).
  pf.add(kPfEpi1, t_epi);
  const uint32_t t_fence = pf.now();
  sm90::fence_proxy_async_global();
  pf.add(kPfFence, t_fence);
  if constexpr (S::kSwapAB)
    sm90::named_barrier(kConsumerBarrier, kConsumerThreads);  // red[] is free for the next tile
  cs.tile_written(sm, a.units_base + tl.unit, pf);            // done1[unit]
}

// GEMM2, tokens in N (swap AB): the K loop, then the BF16 per-slot rows straight from the
// fragments. Returns the epilogue's start (profile).
template <class S>
__device__ __forceinline__ uint32_t gemm2_swap_ab(const KernelArgs& a, const CtaSmem<S>& sm, Consumer<S>& cs,
                                                  const Tile& tl, const float* wsc, float (&acc)[S::kAcc],
                                                  RingPos<S::kStages>& rp, Prof& pf) {
  constexpr int BN = S::BN;
  const int lane = cs.lane, lcol = cs.lcol;
  // Token n's row_src entry in lane n % 32 of src[n / 32], loaded before the K loop.
  int32_t src[(BN + 31) / 32];
#pragma unroll
  for (int h = 0; h < (BN + 31) / 32; ++h) src[h] = load_row_src(a, tl, h * 32 + lane);
  mainloop_swap_ab<BN, 2>(acc, tl.kblocks, rp, sm.ring, sm.full_bar, sm.empty_bar, cs.wg, lcol, wsc, wsc,
                          a.debug.skip, pf);
  const uint32_t t_epi = pf.now();
  // ---- GEMM2 epilogue: BF16 per-slot rows ----
  const int f = tl.nblk * 128 + cs.wg * 64 + cs.lrow;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int n = j * 8 + lcol + c;  // (j * 8 + 7 < 32 decides src[0] or src[1] at compile time)
      const int32_t s_n = __shfl_sync(0xffffffffu, src[j * 8 / 32], n % 32);
      if (n < tl.rows) {
        uint16_t* yr = out_row<S::kEp>(a, tl, tl.row0 + n, s_n);
        const uint32_t b = num::bf16x2_encode(acc[j * 4 + c], acc[j * 4 + 2 + c]);
        yr[f] = uint16_t(b);
        yr[f + 8] = uint16_t(b >> 16);
      }
    }
  }
  return t_epi;
}

// GEMM2 epilogue, tokens in M: the warp's 16 token rows x 128 columns of output block nblk
// from the accumulators ac (a wide tile runs it for both blocks). Out through the warp's
// shared-memory tile, 64 columns a pass: stmatrix takes the accumulator fragment as it is
// (16-byte chunks XOR-swizzled by row, so neither side has bank conflicts), then each lane
// stores whole 16-byte chunks, four rows of 128 bytes a warp instruction (4-byte stores
// straight from the fragment, 32 a thread, kept the epilogue waiting on the LSU queue).
template <class S>
__device__ __forceinline__ void epilogue2_tokens_m(const KernelArgs& a, const CtaSmem<S>& sm,
                                                   const Consumer<S>& cs, const Tile& tl, int rbase,
                                                   int32_t src, float (&ac)[64], int nblk) {
  const int lane = cs.lane;
  const uint8_t* warp_tile = sm.staging + cs.cwarp * SmemTail::kStagingWarpBytes;
  const uint32_t stg = sm90::smem_u32(warp_tile);
  const int chunk = lane % 8;
  uint16_t* dst[4];  // rows 4k + lane / 8 of the warp's 16
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int n = rbase + cs.wwarp * 16 + 4 * k + lane / 8;
    const int32_t s_n = __shfl_sync(0xffffffffu, src, 4 * k + lane / 8);
    dst[k] = n < tl.rows ? out_row<S::kEp>(a, tl, tl.row0 + n, s_n) + nblk * 128 + chunk * 8 : nullptr;
  }
  // stmatrix lane address: matrix q = lane / 8 is (row half q % 2, column block
  // q / 2 of the pair), its row lane % 8.
  const int st_row = (lane / 8) % 2 * 8 + lane % 8;
  const uint32_t st_addr = stg + st_row * 128;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int j = pass * 8 + 2 * m;  // column blocks j, j + 1 (8 columns each)
      const int c = 2 * m + lane / 16;
      sm90::stmatrix_x4(st_addr + ((c ^ (st_row % 8)) * 16), num::bf16x2_encode(ac[4 * j], ac[4 * j + 1]),
                        num::bf16x2_encode(ac[4 * j + 2], ac[4 * j + 3]),
                        num::bf16x2_encode(ac[4 * j + 4], ac[4 * j + 5]),
                        num::bf16x2_encode(ac[4 * j + 6], ac[4 * j + 7]));
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = 4 * k + lane / 8;
      const uint4 v = *reinterpret_cast<const uint4*>(warp_tile + r * 128 + ((chunk ^ (r % 8)) * 16));
      if (dst[k]) *reinterpret_cast<uint4*>(dst[k] + pass * 64) = v;
    }
    __syncwarp();  // the tile is free for the next pass (or tile)
  }
}

// GEMM2, tokens in M: the K loop (a wide tile's two output blocks, or a split wide tile's
// block wg), then epilogue2_tokens_m. Returns the epilogue's start (profile).
template <class S>
__device__ __forceinline__ uint32_t gemm2_tokens_m(const KernelArgs& a, const CtaSmem<S>& sm, Consumer<S>& cs,
                                                   const Tile& tl, bool split, int rbase, const float* wsc,
                                                   float (&acc)[S::kAcc], RingPos<S::kStages>& rp, Prof& pf) {
  const bool shared = tl.e == a.E;
  const int lane = cs.lane;
  // Lane i < 16 loads the row_src entry of the warp's row i before the K loop.
  // (the row from a fresh read of the thread index: kept in a register from the
  // kernel's start, it was the 128-token kernel's one spill)
  const int row_in_tile =
      (sm90::thread_index() - 128) / 32 * 16 + lane - (split ? cs.wg * 64 : 0);  // rbase + wwarp * 16 + lane
  const int32_t src = load_row_src(a, tl, lane < 16 ? row_in_tile : tl.rows);
  const float* wsc1 = wsc + (shared ? a.Is : a.I) / 128;  // (wide tiles: block nblk + 1's)
  if constexpr (S::kWide) {
    if (split)
      mainloop_tokens_m<2, false, true>(acc_block<0>(acc), tl.kblocks, rp, sm.ring, sm.full_bar, sm.empty_bar,
                                        0, 0, cs.wg, cs.lrow, cs.wg ? wsc1 : wsc, cs.wg ? wsc1 : wsc,
                                        a.debug.skip, pf);
    else
      mainloop_tokens_m_blocks<2, true, false>(acc, tl.kblocks, rp, sm.ring, sm.full_bar, sm.empty_bar, 0,
                                               rbase, cs.lrow, wsc, nullptr, wsc1,
                                               a.debug.skip | cs.wg_idle(a, tl), pf);
  } else {
    mainloop_tokens_m<2, S::kClusterPairs>(acc_block<0>(acc), tl.kblocks, rp, sm.ring, sm.full_bar,
                                           sm.empty_bar, cs.peer_empty, rbase, 0, cs.lrow, wsc, wsc,
                                           a.debug.skip | cs.wg_idle(a, tl), pf);
  }
  const uint32_t t_epi = pf.now();
  epilogue2_tokens_m<S>(a, sm, cs, tl, rbase, src, acc_block<0>(acc), tl.nblk + (split ? cs.wg : 0));
  if constexpr (S::kWide) {  // (two tiles in done2, as in GEMM1's done1)
    sm90::fence_proxy_async_global();
    cs.tile_written(sm, MoeWorkspaceLayout::kCounterDone2, pf);
    if (!split) epilogue2_tokens_m<S>(a, sm, cs, tl, rbase, src, acc_block<1>(acc), tl.nblk + 1);
  }
  return t_epi;
}

// A GEMM2 tile: 128 hidden outputs x the tile's token rows, BF16, into their slot rows
// (y_rows, or under expert parallelism the sources' combine slots), then done2.
template <class S>
__device__ __forceinline__ void gemm2_tile(const KernelArgs& a, const CtaSmem<S>& sm, Consumer<S>& cs,
                                           const Tile& tl, bool split, int rbase, float (&acc)[S::kAcc],
                                           RingPos<S::kStages>& rp, Prof& pf) {
  const bool shared = tl.e == a.E;
  const float* wsc = shared ? a.sw2_scale + size_t(tl.nblk) * (a.Is / 128)
                            : a.w2_scale + (size_t(tl.e) * (a.H / 128) + tl.nblk) * (a.I / 128);
  uint32_t t_epi;
  if constexpr (S::kSwapAB)
    t_epi = gemm2_swap_ab<S>(a, sm, cs, tl, wsc, acc, rp, pf);
  else
    t_epi = gemm2_tokens_m<S>(a, sm, cs, tl, split, rbase, wsc, acc, rp, pf);
  // The single-device combine reads y_rows by bulk copies (async proxy): the proxy
  // fence before the release, as for act2.
  if (!S::kEp) sm90::fence_proxy_async_global();
  pf.add(kPfEpi2, t_epi);
  cs.tile_written(sm, MoeWorkspaceLayout::kCounterDone2, pf);
}

// The consumers' tiles: each starts with the record its first stage carries (the
// producer's schedule, decoded), until the sentinel.
template <class S>
__device__ __forceinline__ void consumer_tiles(const KernelArgs& a, const CtaSmem<S>& sm, Consumer<S>& cs,
                                               Prof& pf) {
  float acc[S::kAcc];
  RingPos<S::kStages> rp;
  for (;;) {
    const uint32_t t_tile = pf.now();
    sm90::mbar_wait(&sm.full_bar[rp.stage], rp.phase);
    // NOTE: lane 0 reads the record and broadcasts it: lane 0 also hands the stage back
    // (release_stage), so the read is ordered before the producer's next write to it in
    // a way compute-sanitizer's racecheck follows too.
    int rec[6] = {};
    if (cs.lane == 0) {
      const int4* p = reinterpret_cast<const int4*>(&sm.stage_tile[rp.stage]);
      const int4 w0 = p[0], w1 = p[1];
      rec[0] = w0.x, rec[1] = w0.y, rec[2] = w0.z, rec[3] = w0.w, rec[4] = w1.x, rec[5] = w1.y;
    }
#pragma unroll
    for (int i = 0; i < 6; ++i) rec[i] = __shfl_sync(0xffffffffu, rec[i], 0);
    if (rec[0] == 0) {
      cs.tile_written(sm, -1, pf);
      break;
    }
    // (kblocks again from the kernel's constants: carried in a register through the tile,
    // it cost the 128-token kernel a 4-byte spill)
    const Tile tl{rec[0], rec[1], rec[2], rec[3], rec[4], rec[5], tile_kblocks(a, rec[0], rec[1]), 0};
    // A wide tile of at most 64 rows with half tiles on: each warpgroup computes one of its
    // two output blocks (block wg) on token rows 0..63 instead of warpgroup 1 idling.
    // (So wg_idle is 0 on a wide tile that is not split; the wide loop still takes it:
    // without that operand ptxas laid out the whole wide kernel anew.)
    const bool split = S::kWide && a.half_tiles && tl.rows <= 64;
    const int rbase = split ? 0 : cs.wg * 64;  // the warpgroup's first token row in the tile
#pragma unroll
    for (int i = 0; i < S::kAcc; ++i) acc[i] = 0.0f;
    pf.add(kPfTileStart, t_tile);
    pf.count(kPfTiles);
    if (tl.gemm == 1)
      gemm1_tile<S>(a, sm, cs, tl, split, rbase, acc, rp, pf);
    else
      gemm2_tile<S>(a, sm, cs, tl, split, rbase, acc, rp, pf);
    pf.add(kPfTile, t_tile);
  }
}

// ============================================================================
// Setup and phase 0 (every thread of the CTA)
// ============================================================================

// The CTA's mbarriers (kProducerThread) and the tensor maps' prefetch (kSignalThread). Touches only
// shared memory and the kernel's parameters (it runs before grid_dependency_wait).
template <class S>
__device__ __forceinline__ void init_cta(const TensorMaps& tm, const CtaSmem<S>& sm, int tid) {
  if (tid == kProducerThread) {
    for (int s = 0; s < S::kStages; ++s) {
      sm90::mbar_init(&sm.full_bar[s], 1);
      // One arrival per consumer warp (pair tiles: of both CTAs, release_stage_pair).
      sm90::mbar_init(&sm.empty_bar[s], (S::kPairTile ? 2 : 1) * kConsumerThreads / 32);
    }
    for (int s = 0; s < kTileSlots; ++s) {
      sm90::mbar_init(&sm.done_bar[s], kConsumerThreads / 32);
      sm90::mbar_init(&sm.free_bar[s], 1);
    }
    if (S::kDecodePair)
      for (int b = 0; b < 2; ++b) sm90::mbar_init(&sm.xchg_bar[b], 1);
    for (int s = 0; s < kCombineStages; ++s) {
      sm90::mbar_init(&sm.comb_full[s], 1);
      sm90::mbar_init(&sm.comb_empty[s], kConsumerThreads);  // every reader arrives (see combine_bulk)
    }
    sm90::mbar_init_fence();
  }
  if (tid == kSignalThread) {
    sm90::tma_prefetch_desc(&tm.w13);
    sm90::tma_prefetch_desc(&tm.w2);
    sm90::tma_prefetch_desc(&tm.x);
    sm90::tma_prefetch_desc(&tm.a2);
    if (S::kPairTile) sm90::tma_prefetch_desc(&tm.x_part), sm90::tma_prefetch_desc(&tm.a2_part);
    if (S::kWide) sm90::tma_prefetch_desc(&tm.w13w), sm90::tma_prefetch_desc(&tm.w2w);
  }
}

// Schedule tables: rows and token blocks per expert (one warp scans). Expert parallelism:
// this rank's local experts, from the counts its sources send (ep_exchange: steps 1-3 of
// ep_layout.h up to the pull). False: a peer did not arrive (status set; nothing is in
// flight yet).
template <class S>
__device__ __forceinline__ bool build_tables(const KernelArgs& a, const CtaSmem<S>& sm, const EpTables& et,
                                             int T, int E_total, int warp, int lane) {
  if (!S::kEp) {
    if (warp == 0)
      build_sched(
          sm.sc, E_total, S::BN, lane,
          [&](int e) { return e < a.E ? a.counters[MoeWorkspaceLayout::kCounterExperts + e] : T; }, 0, false);
    __syncthreads();
    // Pair tiles: the peer's barriers are initialized before this CTA multicasts into its
    // stages or arrives on them (and the reverse).
    if (S::kClusterPairs) sm90::cluster_arrive(), sm90::cluster_wait();
    return true;
  }
  return ep_exchange(a, sm.sc, et, T, a.ep.state[0], S::BN);
}

// The CTA's place in the tile schedule (thread 0): TileSchedule's balanced list of its
// unit, then the pool's claims; returns its first tile.
// NOTE: no weight load goes out before phase 0: with the ring full, the grid barrier's L2
// round trips waited behind them, and early stages measured slower at few tokens, level
// above (see docs/performance-history.md).
template <class S>
__device__ __forceinline__ int start_schedule(const KernelArgs& a, const TileIds& ids, TileSchedule& sched) {
  // (no tail pool for pairs: both CTAs of a cluster would have to claim the same tile)
  // (costs in weight bytes: a GEMM1 tile reads 256 rows x H, a GEMM2 tile 128 x I, a wide
  // GEMM2 tile 256 x I; a CTA of decode pairs half a GEMM1 tile)
  const int G = gridDim.x >> S::csh;
  const int t2 = ids.t2;
  sched.init(schedule_unit(a, S::csh), G, ids.t1, t2, a.H / 128 * (S::kWide || S::kDecodePair ? 1 : 2),
             a.I / 128, !a.debug.round_robin,
             a.debug.round_robin || S::kClusterPairs ? 0 : min(t2, a.tail_pool * int(gridDim.x)));
  return claim_next_tile<S>(a, sched, ids.tiles());
}

// Phase 0 on one device: quantize x (1x128 E4M3) and scatter each token to its rows.
// A warp task is 512 columns (four 128-column groups) of one token: each lane loads 16
// columns (32 bytes), eight lanes make a group (amax in three shuffles), and each slot
// row gets one 16-byte store a lane. The next task's loads (its x columns and its slot
// rows) are issued before this task is quantized and stored.
template <class S>
__device__ __forceinline__ void phase0_scatter(const KernelArgs& a, const Sched& sc, int T, int warp,
                                               int lane) {
  constexpr int kTaskGroups = 4;  // 32 lanes x 16 columns
  const int hb = a.H / 128;
  const int warps_total = gridDim.x * (kThreads / 32);
  const int chunks = (hb + kTaskGroups - 1) / kTaskGroups;
  const int tasks = T * chunks;
  const int slots = a.K + a.has_shared;
  const int lg = lane / 8;  // this lane's group within the task
  struct Task {
    int t, g;  // token; this lane's group (>= hb: none)
    uint4 raw[2];
    int row;  // this lane's slot row (-1: none)
    float w;  // its routing weight
  };
  auto load_task = [&](int task) {
    Task k;
    k.t = task / chunks;
    k.g = (task - k.t * chunks) * kTaskGroups + lg;
    const uint4* src = reinterpret_cast<const uint4*>(a.x + size_t(k.t) * a.H + k.g * 128 + (lane % 8) * 16);
    k.raw[0] = k.g < hb ? src[0] : make_uint4(0, 0, 0, 0);
    k.raw[1] = k.g < hb ? src[1] : make_uint4(0, 0, 0, 0);
    k.row = slot_row<S::kEp>(a, sc, k.t, lane, k.w);
    return k;
  };
  int task = blockIdx.x * (kThreads / 32) + warp;
  Task cur{};
  if (task < tasks) cur = load_task(task);
  for (; task < tasks; task += warps_total) {
    const int next = task + warps_total;
    Task nxt{};
    if (next < tasks) nxt = load_task(next);
    const uint32_t raw[8] = {cur.raw[0].x, cur.raw[0].y, cur.raw[0].z, cur.raw[0].w,
                             cur.raw[1].x, cur.raw[1].y, cur.raw[1].z, cur.raw[1].w};
    uint32_t qw[4];
    float scale;
    quantize_group<8>(raw, qw, scale);
    const uint4 q = make_uint4(qw[0], qw[1], qw[2], qw[3]);
    const bool mine = cur.g < hb;
    for (int k = 0; k < slots; ++k) {
      const int r = __shfl_sync(0xffffffffu, cur.row, k);
      const float w = __shfl_sync(0xffffffffu, cur.w, k);
      if (r < 0) continue;
      if (mine) {
        *reinterpret_cast<uint4*>(a.x_sorted + size_t(r) * a.H + cur.g * 128 + (lane % 8) * 16) = q;
        if (lane % 8 == 0) a.x_sorted_scale[size_t(cur.g) * a.rows_cap + r] = scale;
      }
      if (lane == 0 && cur.g == 0) {
        a.row_weight[r] = w;
        a.row_src[r] = cur.t * slots + k;  // the token's slot in y_rows
      }
    }
    cur = nxt;
  }
}

// Phase 0's grid barrier: every sorted row is written before any TMA reads one. (With the
// expert-parallel pull overlapped, each unit's done1 counts its rows instead:
// ep_pull_overlapped.) False: an expert-parallel peer timed out (leave at once).
template <class S>
__device__ __forceinline__ bool phase0_grid_barrier(const KernelArgs& a, int tid) {
  sm90::fence_proxy_async_global();
  __threadfence();
  __syncthreads();
  if (!S::kEp) {
    if (tid == 0) {
      atomicAdd(&a.counters[MoeWorkspaceLayout::kCounterBarrier], 1);
      sm90::wait_geq_acquire_gpu(&a.counters[MoeWorkspaceLayout::kCounterBarrier], int(gridDim.x));
    }
    __syncthreads();
    return true;
  }
  // (the second barrier of the rank's CTAs: ep_exchange met at gridDim.x). With the pull
  // overlapped it guards no rows, but it keeps a peer's timeout all-or-nothing: a CTA
  // that gave up in ep_exchange never arrives, so every CTA leaves here (the barrier
  // itself is all or nothing: ep_grid_barrier) instead of one starting tiles whose rows
  // that CTA's pull warps would have brought.
  const bool ok =
      tid != 0 || ep_grid_barrier(a.ep, &a.counters[MoeWorkspaceLayout::kCounterBarrier], 2 * gridDim.x);
  return !__syncthreads_or(!ok);  // (nothing is in flight: no load went out yet)
}

// kEp: expert parallelism (a separate instantiation, so the single-device kernel keeps
// its registers: the EP paths' extra live values spill four ints at BN = 128, stored
// once and reloaded once a tile, never inside the K loops -- checked in the SASS).
// kClusterPairs: pair tiles (FusedMoeConfig::pair_tiles), launched in clusters of two CTAs; its
// own instantiation, so the other kernels' registers do not move. 128-token tiles share
// their stages (kPairTile: the token or weight rows multicast); decode pairs (kDecodePair,
// BN <= kDecodePairsMaxBlockN) give the two CTAs a GEMM1 tile's two halves, and the
// epilogues exchange the tokens' amax (so a GEMM1 tile costs a CTA 64 columns' weights),
// and GEMM2 token pairs (output blocks 2j, 2j + 1).
// kWide: wide tiles (FusedMoeConfig::wide_tiles): 256 weight rows a stage, a GEMM1 tile's
// two halves, or a GEMM2 token pair's two tiles (mainloop_tokens_m_blocks); no cluster.
// NOTE: its consumers hold 128 accumulators through the epilogues, and ptxas spills 4 bytes
// there (nvcc 13.0): a value of the consumers' start, reloaded at each tile, never in the
// K loops (checked in the SASS). Chosen: the K loops are what the wide tiles are for.
// (The expert-parallel wide kernel, kEpWideTiles, allocates without a spill.)
template <int BN, bool kEp, bool kClusterPairs = false, bool kWide = false>
__global__ void __launch_bounds__(kThreads, 1)
    fused_moe_kernel(const __grid_constant__ KernelArgs a, const __grid_constant__ TensorMaps tm) {
  using S = KernelShape<BN, kEp, kClusterPairs, kWide>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // NOTE: offset the __shared__ array itself (not a cast integer) so the compiler keeps
  // the shared address space and emits LDS for the scale reads.
  uint8_t* smem = smem_raw + ((1024 - (sm90::smem_u32(smem_raw) & 1023)) & 1023);
  const CtaSmem<S> sm(smem);

  Prof pf;
  const uint32_t t_start = pf.now();
  pf.stamp(kPfStartNs);
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int E_total = a.E + a.has_shared;
  int* done1 = a.counters + a.units_base;

  init_cta<S>(tm, sm, tid);
  // Launched programmatically (FusedMoeConfig::programmatic_launch), the CTA got here while
  // route_topk ran: everything above touches only shared memory and the kernel's parameters;
  // the routing's outputs, the counters and the token count are read from here on.
  sm90::grid_dependency_wait();
  const int T = device_token_count(a.num_tokens, a.tokens_cap);
  // (expert parallelism: the exchange's tables, in the ring's last stage)
  EpTables et(reinterpret_cast<int*>(smem + (S::kStages - 1) * S::kStageBytes));
  if (!build_tables<S>(a, sm, et, T, E_total, warp, lane)) return;
  if (a.debug.stop == 1) return;
  pf.add(kPfSched, t_start);
  const uint32_t t_tasks = pf.now();

  // The tile schedule (identical in every role).
  const TileIds ids = tile_ids(a, sm.sc, S::sh1, S::sh2);
  const int tiles = ids.tiles();
  // The producer's stage bytes: weights, tokens and the tokens' scales of its K block (either
  // GEMM); none with kSkipLoads. (Here, before phase 0, as in the one-body kernel: computed in
  // producer_thread they moved ptxas's allocation of the whole kernel.)
  const bool no_loads = a.debug.skip & kSkipLoads;
  const uint32_t stage_tx = no_loads ? 0 : S::kWBytes + S::kXBytes + S::BN * 4;
  TileSchedule sched;
  int first_tile = tiles;
  if (tid == kProducerThread) first_tile = start_schedule<S>(a, ids, sched);

  // ---- Phase 0 ----
  if (!kEp)
    phase0_scatter<S>(a, sm.sc, T, warp, lane);
  else if (!a.ep_overlap)
    ep_pull(a, et);  // step 3: the rows of the local experts into the ring (else ep_pull_overlapped)
  pf.add(kPfTasks, t_tasks);
  pf.stamp(kPfArriveNs);
  if (!phase0_grid_barrier<S>(a, tid)) return;
  if (a.debug.stop == 2) return;
  pf.add(kPfPhase0, t_start);
  pf.stamp(kPfPassNs);

  // ---- Producer warpgroup ----
  if (warp < kProducerWarps) {
    producer_warpgroup<S>(ProducerCtx<S>{a, tm, sm, done1, no_loads, stage_tx, pf}, ids, sched, first_tile, T,
                          E_total, tid, warp, lane);
    return;
  }

  // ---- Consumer warpgroups: the tiles, then the combine ----
  sm90::setmaxnreg_inc<kConsumerRegs>();
  Consumer<S> cs(sm, tid, lane);
  consumer_tiles<S>(a, sm, cs, pf);
  // Pair tiles: this CTA's consumers are done with the peer's barriers; the CTA leaves
  // once the peer's consumers are done with its own (cluster_wait, at every exit below).
  if (kClusterPairs) sm90::cluster_arrive();
  if (a.debug.stop == 3) {
    if (kClusterPairs) sm90::cluster_wait();
    return;
  }
  if (!combine<S>(a, sm, T, E_total, cs.ctid, cs.cwarp, lane, t_start, pf)) return;  // (kEp: no cluster)
  if (kClusterPairs) sm90::cluster_wait();
}

}  // namespace
}  // namespace megamoe::kernels
