// Tuning choices of the Hopper MoE kernels, in one place: each rule with its reason, the
// measurements in docs/performance-history.md (by theme), the mechanisms in docs/kernel.md.
// MEGAMOE_PRINT_CONFIG=1 prints the chosen configuration (describe()); docs/tuning.md lists
// the switches that override it (megamoe/kernels/overrides.h). No choice here changes the
// output bytes.
#pragma once

#include <string>

#include "megamoe/kernels/config.h"
#include "megamoe/kernels/overrides.h"

namespace megamoe::kernels {

// Weight rows per GEMM tile (two consumer warpgroups x wgmma M=64) and K depth
// per pipeline stage (= the 128-wide block of the checkpoint's scales).
constexpr int kBlockM = 128;
constexpr int kBlockK = 128;
constexpr int kThreads = 384;  // warpgroup 0: TMA producer + signal thread; 1-2: wgmma consumers
constexpr int kConsumerThreads = 256;
// setmaxnreg split of the registers: the consumers' 128-token tiles hold the
// accumulator and both halves' wgmma buffers (3 x 64 floats: spills at 216), the
// producer's schedule state spills at 48.
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 224;
// NOTE: setmaxnreg moves registers inside the CTA's launch allocation (384 threads x
// 168, the __launch_bounds__ cap), not the SM's 64K: a larger sum would hang the inc.
static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <= kThreads * 168, "register budget");
constexpr int kMaxExpertsTotal = 512;  // routed + shared, bounded by shared-memory tables
constexpr int kSmemBudget = 227 * 1024;
// Expert row segments start on multiples of 8 rows: the scale tensor maps put the
// row index innermost and a TMA box must start 16-byte aligned in global memory.
constexpr int kRowAlign = 8;
// L2 promotion of the expert weights' TMA loads: a box row is 128 bytes of one weight row,
// and 128-byte promotion beat 256 at decode sizes (level at prefill; none measured as 128).
// The token maps keep 256. (docs/performance-history.md, "Decode: the weight stream")
constexpr int kWeightL2PromotionBytes = 128;
// Finished tiles that may wait for the signal thread's release (fused_moe.cu) before
// a consumer warp blocks on it.
constexpr int kTileSlots = 4;
// The tail pool: GEMM2 tiles per CTA at the end of the schedule that no CTA owns; whoever is
// done with its own list claims the next (TileSchedule), so the tail evens out; wide tiles
// (prefill) take a deeper pool, where the combine otherwise waits for the last GEMM2 tile.
// (docs/performance-history.md, "Schedule and placement")
constexpr int kTailPool = 4;
constexpr int kTailPoolWide = 16;
constexpr int tail_pool_for(bool wide_tiles) { return wide_tiles ? kTailPoolWide : kTailPool; }
// Tile order inside an expert: output blocks major, its token blocks minor, in chunks of
// kTokenChunk token blocks (decode_tile in fused_moe_device.cuh). One chunk's tokens stay in L2
// while the chunk walks the output blocks; a weight block is read once a chunk (one chunk for
// all blocks re-read the shared expert's tokens from HBM for each output block at 16384 tokens).
constexpr int kTokenChunk = 16;
// Slots whose rows a combine lane loads at once, kCombineVecs x 16 bytes each: every
// slot of the presets (top-8 + shared) in one batch (the expert-parallel warp-unit combine).
constexpr int kCombineBatch = 12;
constexpr int kCombineVecs = 2;
// Single device: the combine's slot rows come into the free stage ring by bulk copies (warp 3
// of the producer warpgroup issues them, the consumers sum from shared memory), a unit being
// one token's kCombineCols columns of every slot, up to kCombineStages units in flight a CTA:
// more loads in flight than the warp-unit combine's one unit a warp.
constexpr int kCombineCols = 2048;
constexpr int kCombineStages = 8;
// Tile layout by token block: up to 64 tokens "swap AB" (weights in the wgmma M, tokens in
// N: a decode tile wastes no rows), 128 tokens in M and weights in N (prefill: the fold needs
// four scale products per thread, not one per token). Both give the same bytes. The schedule
// is static and byte-balanced (TileSchedule) up to the tail pool: an atomic counter for every
// tile measured slower. (docs/performance-history.md, "Schedule and placement")
constexpr bool swap_ab(int block_n) { return block_n < 128; }
// The token blocks the kernel is built for (one instantiation each). 48 sits between 32 and
// 64 for ~21-23 rows an expert: the decode loop is bound by its own instructions there, which
// scale with block_n, and 32 would split half of the experts into two blocks.
constexpr int kBlockNs[] = {8, 16, 32, 48, 64, 128};
constexpr int kNumBlockNs = 6;
// Half tiles: a 128-token tile with at most 64 rows (an expert's last block) runs on
// warpgroup 0 alone (warpgroup 1 hands the stages back), up to this many rows an expert on
// average: faster there, slower above (not explained).
// (docs/performance-history.md, "Prefill tiles")
constexpr double kHalfTileMaxAvgRows = 96.0;
// The 64-token tile from this many rows an expert on average (below it, the smallest of
// kBlockNs that holds the rows, resolve_config): it measured ahead of both 48 and 128 from 24
// rows, behind 48 at 21. (docs/performance-history.md, "Prefill tiles")
constexpr double kTile64MinAvgRows = 24.0;
// ... and 128-token tiles (with half tiles) from this many: level with 64 at 40 rows, ahead
// from 48.
constexpr double kTile128MinAvgRows = 38.0;
// ... from kTile64MinAvgRows on a card whose peak DRAM bandwidth per SM is at least
// kFastReadGBpsPerSm (FusedMoeConfig::read_gbps_per_sm: the H200's 36 GB/s, the H100 SXM's
// 25): there the 128-token pair tiles measured ahead of 64 from kTile64MinAvgRows. Why the
// edge moves with the card is not measured; the pairs' multicast halves the token tile's
// bytes a stage into each SM. (docs/performance-history.md, "Prefill tiles")
constexpr double kTile128MinAvgRowsFastRead = kTile64MinAvgRows;
constexpr double kFastReadGBpsPerSm = 30.0;
// With fewer local experts than kTile128ManyExperts (an expert-parallel rank's share) the
// edge lies higher: the 64-token tile stayed ahead to just below it on the H100; on a
// fast-read card 128 took over from 48.
// (docs/performance-history.md, "Expert parallelism")
constexpr double kTile128MinAvgRowsFewExperts = 60.0;
constexpr double kTile128MinAvgRowsFewExpertsFastRead = 48.0;
constexpr int kTile128ManyExperts = 128;
// Pair tiles (FusedMoeConfig::pair_tiles): 128-token tiles in clusters of two CTAs, each
// loading its part of the operand both need into both by TMA multicast: 24 KB a stage from
// L2 instead of 32, faster at prefill sizes. Off, the tail pool evens out the last tiles (a
// cluster cannot claim them). (docs/performance-history.md, "Prefill tiles")
constexpr bool kPairTiles = true;
// ... on at least this many local experts: on fewer (an expert-parallel rank's share) single
// CTAs measured ahead; on the full layers the pairs stay ahead.
constexpr int kPairTilesMinExperts = 128;
// What a pair tile shares (FusedMoeConfig::pair_weights): the weight tile (the pair takes
// token blocks 2p, 2p + 1 of one output block), so a weight tile is read once for two token
// blocks whether or not neighbouring clusters run in step; sharing the token tile instead
// read more from DRAM. (docs/performance-history.md, "Prefill tiles")
constexpr bool kPairWeights = true;
// Decode pairs (FusedMoeConfig::decode_pairs, block_n <= kDecodePairsMaxBlockN): clusters
// of two CTAs that share each GEMM1 tile, one 64-column half each, exchanging the tokens'
// amax through shared memory (the 1x128 act2 group spans both halves). Where the GEMM1 tiles
// number fewer than kDecodePairsMaxTilesPerCta a CTA (one token on GLM-5: 144 tiles for 132
// CTAs), a tile more or less is most of a CTA's work; forced on at more tiles they measured
// level. (docs/performance-history.md, "Decode: the weight stream")
constexpr int kDecodePairsMaxBlockN = 16;
constexpr int kDecodePairsMaxTilesPerCta = 2;
// Wide tiles (FusedMoeConfig::wide_tiles): a 128-token tile against two neighbouring output
// blocks in one CTA (a pair tile's two tiles without a cluster): a stage holds 256 weight rows
// and the 128 token rows (48 KB, four stages), one wait, one release and three TMA issues a
// stage for two blocks' work: faster than pairs at prefill sizes. Chosen where half tiles are
// not (level with them below kHalfTileMaxAvgRows). (docs/performance-history.md, "Prefill tiles")
constexpr bool kWideTiles = true;

// Expert parallelism, the row pull beside the tiles (KernelArgs::ep_overlap): warps 2-3 of the
// producer warpgroup pull the rows in the GEMM1 tiles' order and count them into the units'
// done1 counters, which a tile's token loads wait for. Off until measured over NVLink (on
// virtual ranks it helped large batches and hurt small ones). (docs/performance-history.md, "Expert
// parallelism")
constexpr bool kEpOverlap = false;
// Expert parallelism with wide tiles (kWideTiles) where one device takes them: faster at
// prefill sizes a rank (virtual ranks), the bytes equal.
constexpr bool kEpWideTiles = true;

// Programmatic launch (FusedMoeConfig::programmatic_launch): route_topk and the fused kernel
// start while the kernel before them runs (prologues, launch latency) and wait for its end
// (griddepcontrol) before reading what it wrote; up to kProgrammaticLaunchMaxTokens tokens
// (decode, where the launch latency counts). From 256 tokens it gains nothing: launched behind busy SMs the
// CTAs land on other SMs, and the prefill layer depends on which SM runs which schedule unit
// (sm_units below). (docs/performance-history.md, "Schedule and placement")
constexpr bool kProgrammaticLaunch = true;
constexpr int kProgrammaticLaunchMaxTokens = 64;
// The schedule's units by SM (FusedMoeConfig::sm_units, fused_moe.cu's schedule_unit): at
// plan creation a probe kernel records the order in which a plain launch on an idle GPU fills
// the SMs (one cyclic order, TPC mates in turn), and each CTA takes its SM's place in it as
// its unit, so the layer keeps the idle launch's placement when its CTAs land elsewhere (behind
// a programmatic launch or another stream's kernels), which otherwise costs the prefill layer
// much of its speed. Up to kSmUnitsMaxTokens: above, a fixed table measured slower on plain
// launches (not understood). Off where a probe run breaks a TPC pair, an SM id
// passes the table, the grid is smaller than the card or clusters place the CTAs.
// (docs/performance-history.md, "Schedule and placement")
constexpr bool kSmUnits = true;
constexpr int kSmUnitsMaxTokens = 4096;

// The router's K is cut into this many slices, summed in order kSlicesPerGroup at a time
// into kRouterGroups partial logits (route.cu's NOTE). Fixed per shape, never chosen
// from the token count.
constexpr int kRouterSlices = 16;
constexpr int kSlicesPerGroup = 4;
constexpr int kRouterGroups = kRouterSlices / kSlicesPerGroup;

// Router GEMM tile by token hint (route.cu; every tile computes the same bits): up to
// kRouteSmallTokens 16x16 tiles (decode: many blocks stream the router weight at once), up to
// kRouteWideTokens the 64x32 tile with its group's four K slices side by side (16 warps), up
// to route_medium_max_tokens 64x32, above 128x64 (fewer L2 re-reads). With fewer than
// kRouteLargeMinExperts experts (a rank's share) the large tile's 64 expert rows are half
// empty, so the medium one holds to 1024. (docs/performance-history.md, "Routing")
constexpr int kRouteSmallTokens = 64;
constexpr int kRouteWideTokens = 256;
constexpr int kRouteMediumTokens = 512;
constexpr int kRouteMediumTokensFewExperts = 1024;
constexpr int kRouteLargeMinExperts = 128;
// The largest token hint the 64x32 router tile takes for `experts` experts.
constexpr int route_medium_max_tokens(int experts) {
  return experts >= kRouteLargeMinExperts ? kRouteMediumTokens : kRouteMediumTokensFewExperts;
}

// Pipeline depth for a token block: as many stages as fit the budget, at most kMaxStages:
// the decode tiles' further stages bought nothing.
// (docs/performance-history.md, "Decode: the weight stream")
constexpr int kMaxStages = 8;
// wide: a wide tile's stage (kWideTiles), two output blocks' weight rows.
// A stage: weight rows, token rows, the tokens' float32 scales of the K block (either GEMM).
constexpr int stage_bytes(int block_n, bool wide = false) {
  return (((wide ? 2 : 1) * kBlockM * kBlockK + block_n * kBlockK + block_n * 4) + 1023) / 1024 * 1024;
}
// Shared memory after the stage ring (byte offsets; fused_moe.cu places its regions
// by these, so the size below and the kernel cannot drift apart).
struct SmemTail {
  static constexpr int kFullBar = 0;                                 // uint64 [16]
  static constexpr int kEmptyBar = kFullBar + 16 * 8;                // uint64 [16]
  static constexpr int kDoneBar = kEmptyBar + 16 * 8;                // uint64 [kTileSlots]
  static constexpr int kFreeBar = kDoneBar + kTileSlots * 8;         // uint64 [kTileSlots]
  static constexpr int kSlotCounter = kFreeBar + kTileSlots * 8;     // int [kTileSlots]: counter to release
  static constexpr int kStageTile = kSlotCounter + kTileSlots * 4;   // int [16][8]: the tile a stage starts
  static constexpr int kCombFull = kStageTile + 16 * 8 * 4;          // uint64 [kCombineStages]
  static constexpr int kCombEmpty = kCombFull + kCombineStages * 8;  // uint64 [kCombineStages]
  static constexpr int kCombMask = kCombEmpty + kCombineStages * 8;  // int [kCombineStages]: slots loaded
  static constexpr int kTables = kCombMask + kCombineStages * 4;     // int [3][kMaxExpertsTotal + 1]
  static constexpr int kRed = kTables + 3 * (kMaxExpertsTotal + 1) * 4;  // float [8 warps][block_n]
  // float [block_n]: a decode GEMM1 tile's reciprocal token scales
  static constexpr int inv_scales(int block_n) { return kRed + 8 * block_n * 4; }
  // Tokens-in-M tiles: each consumer warp's 16 rows x 64 BF16 columns of a GEMM2
  // epilogue pass (fused_moe.cu), 128-byte aligned.
  static constexpr int kStagingWarpBytes = 16 * 128;
  static constexpr int staging(int block_n) { return (inv_scales(block_n) + block_n * 4 + 127) / 128 * 128; }
  // Decode tiles, at the same place: the decode pairs' amax exchange (fused_moe.cu), two
  // mbarriers and two buffers of a token block's maxima from the peer CTA.
  static constexpr int kXchgBar = 0;    // uint64 [2]
  static constexpr int kXchgAmax = 16;  // float [2][64]
  static constexpr int kXchgBytes = kXchgAmax + 2 * 64 * 4;
  static constexpr int xchg(int block_n) { return staging(block_n); }
  static constexpr int bytes(int block_n) {
    return staging(block_n) + (swap_ab(block_n) ? kXchgBytes : 8 * kStagingWarpBytes);
  }
};
constexpr int fixed_smem_bytes(int block_n) { return 1024 + SmemTail::bytes(block_n); }  // + alignment slack
constexpr int stages_for(int block_n, bool wide = false) {
  const int s = (kSmemBudget - fixed_smem_bytes(block_n)) / stage_bytes(block_n, wide);
#ifdef MEGAMOE_STAGES_CAP  // timing-only builds (the CMake cache variable, docs/tuning.md)
  return s > MEGAMOE_STAGES_CAP ? MEGAMOE_STAGES_CAP : s;
#else
  return s > kMaxStages ? kMaxStages : s;
#endif
}
constexpr int smem_bytes(int block_n, bool wide = false) {
  return fixed_smem_bytes(block_n) + stages_for(block_n, wide) * stage_bytes(block_n, wide);
}
#ifndef MEGAMOE_STAGES_CAP
// The GEMM2 staging fits beside six prefill stages.
static_assert(stages_for(128) == 6, "prefill stages");
static_assert(stages_for(128, true) == 4, "wide tile stages");
// Every decode ring is the capped one (the decode pairs' exchange fits beside it).
static_assert(stages_for(8) == kMaxStages && stages_for(48) == kMaxStages && stages_for(64) == kMaxStages,
              "decode stages");
#endif

// The current device's peak DRAM bandwidth per SM in GB/s: 2 (double data rate) x its memory
// clock x its bus width / its SMs; 0 where the driver reports no clock (CardInfo::read_gbps_per_sm).
double device_read_gbps_per_sm(int device);

}  // namespace megamoe::kernels
