// Tuning choices of the Hopper MoE kernels, in one place. Set
// MEGAMOE_PRINT_CONFIG=1 to print the chosen configuration; benchmarks record it.
#pragma once

#include <string>

#include "megamoe/kernels/fused_moe.h"

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
// and promoting it to 128 (not 256) bytes measured -2 % at T = 8 and 64 tokens, -0.2 to
// -1 % at 1 and 256, level at 1024 and 16384 (GLM-5 and DeepSeek-V3, interleaved rounds,
// v18, bench/results/ab/v18_l2_promotion.log and v18_bench_b3b1f72.log's call; no promotion
// measured the same as 128). The token maps keep 256 (no promotion there measured level).
constexpr int kWeightL2PromotionBytes = 128;
// Finished tiles that may wait for the signal thread's release (fused_moe.cu) before
// a consumer warp blocks on it.
constexpr int kTileSlots = 4;
// GEMM2 tiles per CTA at the end of the schedule that no CTA owns: whoever is done
// with its own list claims the next (TileSchedule), so the tail evens out. v14:
// against a static tail (0) -1.0 to -1.7 % for T = 8..256, T=4096 -1.5 %; 2 gained
// less, 8 about as much (bench/results/ab/v14_pool.log).
constexpr int kTailPool = 4;
// ... and with wide tiles (prefill: kWideTiles), 16. v44 (H100, bench/results/ab/v44_tail_pool*_h100.log,
// MEGAMOE_TAIL_POOL=16 against 4, five rounds in two calls): GLM-5.3-Flash 4096 -1.5 / -1.6 % in
// both calls, GLM-5 and DeepSeek-V3 4096 level (-0.1 / -0.2 %) in one and -1.0 / -1.1 % in the
// other, 16384 -0.5..-1.6 % (a case that spreads ~3 %); 8 level. (The profile's combine waited
// 1-3 % of the 4096-token kernel for the last GEMM2 tile, ab/v37_h100_prof_4096_pdl.log.)
constexpr int kTailPoolWide = 16;
constexpr int tail_pool_for(bool wide_tiles) { return wide_tiles ? kTailPoolWide : kTailPool; }
// Tile order inside an expert: output blocks major, its token blocks minor, in chunks of
// kTokenChunk token blocks (decode_tile in fused_moe_device.cuh). One chunk's tokens stay in L2
// while the chunk walks the output blocks; a weight block is read once a chunk. With
// one chunk for all of an expert's blocks (the order up to v21) the shared expert at
// 16384 tokens (128 blocks, 100 MB of GEMM1 tokens) re-read its tokens from HBM for
// each of its 32 output blocks (ncu: 21 GB read against ~12.9 GB of distinct bytes; now 17.7 GB).
constexpr int kTokenChunk = 16;
// Slots whose rows a combine lane loads at once, kCombineVecs x 16 bytes each: every
// slot of the presets (top-8 + shared) in one batch. (v13, rows gathered from the
// expert-sorted order: two units a warp at once, twice the loads in flight, did not
// move the combine's time. v15: the slots of a token are adjacent rows.)
constexpr int kCombineBatch = 12;
constexpr int kCombineVecs = 2;
// Single device (v19): the combine's slot rows come into the free stage ring by bulk
// copies (warp 3 of the producer warpgroup issues them, the consumers sum from shared
// memory), a unit being one token's kCombineCols columns of every slot (8 columns a
// consumer thread), up to kCombineStages units in flight a CTA. (The warp-unit combine
// above, now for expert parallelism only, had one unit's loads in flight a warp and
// waited for them before the next.) v19 (bench/results/ab/v19_combine_route.log, two
// rounds): GLM-5 16384 -1.8 %, 4096 -4 % (the old binary bimodal there), 1024 -0.5 %,
// DeepSeek-V3 16384 -2.0 %, decode level; the profile's combine at 16384 5.6 -> 4.8 %.
constexpr int kCombineCols = 2048;
constexpr int kCombineStages = 8;
// Tile layout by token block: up to 64 tokens "swap AB" (weights in the wgmma M,
// tokens in N: a decode tile wastes no rows), 128 tokens in M and weights in N
// (prefill: the fold needs four scale products per thread, not one per token).
// Both give the same bytes (fused_moe.cu). The tile schedule is static and
// byte-balanced (TileSchedule) up to its last kTailPool tiles a CTA, claimed from a
// counter (v14); an atomic counter for every tile was measured ~5 % slower at
// T >= 64 (bench/results/NOTES.md, v4) and is gone.
constexpr bool swap_ab(int block_n) { return block_n < 128; }
// The token blocks the kernel is built for (one instantiation each). 48 sat between
// 32 and 64 for ~32 rows an expert (GLM-5 and DeepSeek-V3 at 1024 tokens): the decode
// loop is bound by its own instructions there (v13), which scale with block_n, and
// 32 splits half of the experts into two blocks (v13: +14 %). choose_config picks 48
// for 21-23 rows, 64 from kTile64MinAvgRows (24) and 128 from kTile128MinAvgRows (38; 60
// on few local experts).
constexpr int kBlockNs[] = {8, 16, 32, 48, 64, 128};
constexpr int kNumBlockNs = 6;
// Half tiles: a 128-token tile with at most 64 rows (an expert's last block) leaves
// warpgroup 1 idle (it hands the stages back; warpgroup 0 has the tensor cores to itself),
// up to this many rows an expert on average. v20 (bench/results/ab/v20_half_tiles_*.log,
// interleaved with the old binary): GLM-5 1536 -11 %, 2048 -7 %, 3072 -0.7 %, DeepSeek-V3
// 1536 -10 %, 2048 -7 %, GLM-5.3-Flash 2048 -10 %, 3072 -2 %; but on at 4096 and 16384
// tokens it cost +4..+8 % and +6..+12 % (not explained; the warpgroups kept in step at
// each half tile measured the same), so it stops at 96.
constexpr double kHalfTileMaxAvgRows = 96.0;
// ... and from this many rows an expert on average, the 64-token tile replaces the rule's
// 48 (choose_config). v20 (bench/results/ab/v20_block_n_half.log, forced 128 against the
// old rule's 48 / 64): GLM-5 768 -1.8 %, 1024 -3.6 %, 1280 -6.5 %; DeepSeek-V3 -2.8 / -3.7 /
// -6.0 %; GLM-5.3-Flash 1024 -4.7 %, 1280 -7.3 %. So 128 took over from 24 rows; since
// then the decode tiles changed (v26-v27 128-column GEMM1 tiles, v31's 8-stage rings), and v35 (H100,
// bench/results/ab/v35_bn64_edge.log and v35_h100_t1024_knobs.log, two interleaved rounds)
// measured the 64-token tile ahead of 128 from 24 rows: GLM-5 768 -1.3 %, 1024 -1.9 %,
// 1152 -0.7 %, DeepSeek-V3 768 and 1024 -0.6 %, GLM-5.3-Flash 1024 -1.6 %, 1280 -0.9 %;
// but behind 48 at 21 rows (GLM-5.3-Flash 768 +0.5 %).
constexpr double kTile64MinAvgRows = 24.0;
// ... and from this many, 128-token tiles with half tiles replace the 64-token one: v35
// measured GLM-5 1280 (40 rows) level, DeepSeek-V3 1280 +0.7 % and GLM-5 1536 (48) +1.5 %
// for the 64-token tile.
constexpr double kTile128MinAvgRows = 38.0;
// ... except on a card whose peak DRAM bandwidth per SM is at least kFastReadGBpsPerSm
// (FusedMoeConfig::read_gbps_per_sm: H200 4.8 TB/s / 132 SMs = 36, H100 SXM 3.35 TB/s / 132 =
// 25): there the 128-token tiles (half tiles in pairs) take over from kTile64MinAvgRows, as v20
// had it on the H200. v41 (H200, bench/results/ab/v41_h200_bn128_band.log, forced 128 against
// the rule, two rounds): GLM-5 768 (24 rows) -1.6 %, 1024 (32) -2.4 %; DeepSeek-V3 -1.7 / -2.4 %;
// GLM-5.3-Flash 1024 (28) -1.5 %; below 24 rows the rule's tiles stay ahead (Flash 768, 21
// rows, 48: 128 +2.3 %; 512 tokens, 16-14 rows, 32: +0.9..+3.4 %). What moves the edge between
// the cards is not measured; the faster read needs more bytes a cycle into each SM, which the
// pairs' multicast halves for the token tile.
constexpr double kTile128MinAvgRowsFastRead = kTile64MinAvgRows;
constexpr double kFastReadGBpsPerSm = 30.0;
// With fewer local experts than kTile128ManyExperts (an expert-parallel rank's share; the
// bench's 8-way shares) the edge lies higher: v35 (H100, bench/results/ab/v35_share_bn64.log,
// v35_h100_v4flash_share.log) measured the 64-token tile against 128 at 48 rows (the
// DeepSeek-V4-Flash share, 32 experts) -4.3 %, 57 rows (GLM-5.3-Flash, 36) -2.3 %, but at 64
// rows (GLM-5 and DeepSeek-V3, 32) +2.3 % and at 96 +14 %.
constexpr double kTile128MinAvgRowsFewExperts = 60.0;
// ... and on a card reading at least kFastReadGBpsPerSm a SM, from 48: v42 (H200,
// bench/results/ab/v42_shares_h200.log, forced 128 against the rule's 64) GLM-5.3-Flash's share (36
// experts) at 57 rows -7.9 % (310 against 337 us, p10-p90 within 0.5 % each), at 43 rows level
// (+0.4 %), the GLM-5 and DeepSeek-V3 shares (32) at 48 rows level (+0.1 / -0.6 %); the H100
// measured 57 rows level the same day (-0.9 %, ab/v42_shares_h100.log; v41 +0.4 %).
constexpr double kTile128MinAvgRowsFewExpertsFastRead = 48.0;
constexpr int kTile128ManyExperts = 128;
// Pair tiles (FusedMoeConfig::pair_tiles): 128-token tiles run in clusters of two CTAs,
// output blocks 2j and 2j + 1 of one token block, each CTA loading 64 of the 128 token
// rows into both (TMA multicast): 24 KB a stage from L2 instead of 32 (v22's probe of the
// prefill K loop: 580-660 cycles a stage against 750-850). v23, interleaved against the
// same binary without pairs (bench/results/ab/v23_pairs*.log): GLM-5 16384 -3.4 %, 4096
// -2..-6 % (unpaired 4096 is bimodal), DeepSeek-V3 16384 -3..-4 %, GLM-5.3-Flash 16384
// -6 %, 1024..3072 level to -1.4 %; energy a layer -1.6..-6.6 % (DeepSeek-V3 level). So
// on with every 128-token tile (the tail pool is off for pairs), where the shape allows.
// (ncu: GLM-5 16384 reads 24.5 GB from DRAM with pairs against 17.6 without: the weight
// tiles' reuse across token blocks through L2 needs neighbouring units to run in step, and
// 66 clusters keep it less well than 132 CTAs; NOTES v23 item 8.)
constexpr bool kPairTiles = true;
// ... on at least this many local experts. On fewer (a single device's small expert set; the
// bench's 8-way shares, which stand for an expert-parallel rank, whose kernel runs no pairs)
// v36 measured them behind single CTAs (H100, bench/results/ab/v36_share_knobs.log and
// v36_pairs_off.log, MEGAMOE_PAIR_TILES=0 against the rule, two interleaved rounds): 32
// experts (GLM-5 / DeepSeek-V3 shapes) at 64, 80 and 96 rows an expert -0.7..-1.2 %, the
// GLM-5.3-Flash shape's 36 at 71 and 85 rows -1.8 / -1.9 % (57 rows level), 128 rows (wide
// tiles, no pairs) level; on the full layers (256 / 288 experts) at 40-96 rows the pairs stay
// ahead (without them GLM-5 +0.1..+1.6 %, DeepSeek-V3 +0.4..+1.6 %, GLM-5.3-Flash level). Off,
// the tail pool (kTailPool) evens out the last tiles, which clusters cannot claim.
constexpr int kPairTilesMinExperts = 128;
// Pair tiles sharing the weight tile (FusedMoeConfig::pair_weights): the pair takes token
// blocks 2p, 2p + 1 of one output block, each CTA loading 64 of the 128 weight rows into
// both (an expert's odd last token block keeps the shared token tile, TileIds). The same
// 24 KB a stage from L2, but a weight tile is read once for two token blocks whether or not
// neighbouring clusters run in step (v24's probe, bench/probes/kloop_probe.cu: with
// weights from HBM a stage takes 738 cycles against 989-1017 sharing the tokens; from L2
// both 731-737). v24 (bench/results/ab/v24_pair_weights_per_tile.log, interleaved with the
// previous binary): GLM-5 4096 -2..-4 %, 16384 -1..-3 %, 1024 level, DeepSeek-V3 and
// GLM-5.3-Flash level; GLM-5 16384 reads 25.0 GB from DRAM against 29.7 sharing tokens.
constexpr bool kPairWeights = true;
// Decode pairs (FusedMoeConfig::pair_tiles at block_n <= kDecodePairsMaxBlockN): clusters of
// two CTAs that share each GEMM1 tile, one 64-column half each, exchanging the tokens' amax
// through shared memory (the 1x128 act2 group spans both halves). v27 made a GEMM1 tile 128
// columns (num::kInterGroup): at one token that is 144 tiles of 1.5 MB for 132 CTAs on
// GLM-5, so 12 CTAs stream two while the mean is 1.1 (+9 % at T = 1 against v26's 288 tiles
// of 0.75 MB). With the pairs (bench/results/ab/v27_decode_pairs_ab.log, interleaved): T = 1
// GLM-5 125.5 -> 116 us, DeepSeek-V3 141 -> 131 (v26's kernel: 115 / 129). Chosen where the
// GEMM1 tiles would be fewer than kDecodePairsMaxTilesPerCta a CTA: there a tile more or less
// is most of a CTA's work, and the pairs' lost tail pool (TileSchedule's claims need one CTA)
// matters least; forced on at 8-256 tokens they measured -0.6..+0.9 % (v27_decode_pairs_forced_ab.log).
constexpr int kDecodePairsMaxBlockN = 16;
constexpr int kDecodePairsMaxTilesPerCta = 2;
// Wide tiles (FusedMoeConfig::wide_tiles): a 128-token tile against two neighbouring output
// blocks in one CTA (the token pair's two tiles of TileIds, without a cluster): a stage holds
// 256 weight rows and the 128 token rows (48 KB, four stages), and each consumer warpgroup
// runs block 0's chain, folds it, then block 1's, through one wgmma buffer (192 registers of
// accumulators and buffer). One full wait, one release and three TMA issues a stage for two
// blocks' work, and 24 KB from L2 a block, as the pairs. v25's probe
// (bench/probes/kloop_probe.cu, ab/v25_kloop_probe1.log): 603 cycles a 128 x 128 x 128 block
// from L2 against 731-749 for the six-stage ring of one block a stage (pairs included);
// GEMM2's four 64-deep steps a stage 800-810 against 825-848. v25, interleaved with the
// previous binary (bench/results/ab/v25_wide_ab*.log): GLM-5 4096 -4 %, 16384 -2..-4 %,
// DeepSeek-V3 16384 -4..-5 %, GLM-5.3-Flash 16384 -3 % (the K loops' cycles -9 % at 16384,
// the rest is the power cap). With half tiles (up to kHalfTileMaxAvgRows) a wide tile of at
// most 64 rows gives each warpgroup one block (fused_moe.cu's `split`): level at 1024 and
// 2048 (+0.5 %; the four-stage ring waits for data there: 33 % of the K loops at 1024), so
// wide tiles are chosen where half tiles are not. Since v27 (1x128 act2 groups) a GEMM1 tile
// is 128 intermediate columns: a wide stage holds both its halves, the other 128-token
// tiles take the halves in consecutive stages, and GEMM2 folds once a block and stage.
constexpr bool kWideTiles = true;

// Expert parallelism: the row pull (phase 0's step 3) beside the tiles instead of before
// them (KernelArgs::ep_overlap, ep_pull_overlapped): warps 2-3 of the producer warpgroup
// pull the rows in the GEMM1 tiles' order and count them into the units' done1 counters,
// which a tile's token loads wait for. On paper (NOTES v32, bench/results/ab/v32_ep_model.py,
// v32_overlap_sim.py): 8192 tokens a rank of the DeepSeek-V4-Flash shape over 8 H200s pull
// ~180 MB over NVLink, ~0.5 ms before the first tile at ~350 GB/s, of a ~3.1 ms layer. Not
// measured on NVLink yet (issue 6), so off; MEGAMOE_EP_OVERLAP=1 turns it on for the A/B.
// v35 on virtual ranks (one H100: the pull is an HBM copy, and a rank has 1/R of the SMs, so
// two warps a CTA pull for 16 CTAs): with wide tiles, R = 2 at 4096 / 8192 tokens a rank
// -3 % / -5 %; without, R = 8 at 1024 a rank +42 % (13.2 against 9.3 ms), 8 and 256 level.
constexpr bool kEpPullOverlap = false;
// Expert parallelism with wide tiles (kWideTiles; the EP kernels had only the plain 128-token
// tiles): where one device gains from them (avg rows > kHalfTileMaxAvgRows), so does a rank's
// share of the work at prefill sizes (one device at 4096 and 16384 tokens: -2..-5 %, v25).
// The instantiation allocates without spills (v32). v35 (H100, virtual ranks,
// bench/results/ab/v35_h100_ep_overlap.log, two rounds): R = 2 of the DeepSeek-V4-Flash
// shape, 4096 tokens a rank -8.2 %, 8192 -11.6 %, the bytes equal; so on (MEGAMOE_EP_WIDE=0
// turns it off).
constexpr bool kEpWideTiles = true;

// Programmatic dependent launch (FusedMoeConfig::programmatic_launch): route_topk and the
// fused kernel start while the kernel before them runs (their prologues, launch latency) and
// wait for its end (griddepcontrol) before reading what it wrote; up to
// kProgrammaticLaunchMaxTokens tokens. v37 (H100, bench/results/ab/v37_pdl_only.log, one
// binary with MEGAMOE_PDL=0 / 1, two interleaved rounds): T = 1 GLM-5 -0.4 %, DeepSeek-V3
// -1.2 %, GLM-5.3-Flash -0.9 % (v37_pdl.log: -0.6 / -1.1 / -1.2 %), 8 and 64 tokens level to
// -0.3 %; but 256 and 1024 +0.5..+1.0 % and 4096 +19..+26 %. Why 4096: launched while the
// routing holds SMs, the CTAs land on them in another order (ab/v37_placement_probe.log: the
// plain launch puts blockIdx 2k, 2k + 1 on one TPC, every time; the programmatic one 1-3
// pairs of 66), and the prefill layer depends on which SM runs which schedule unit (units
// permuted over the CTAs, MEGAMOE_UNIT_STRIDE: +4..+33 % at 4096, ab/v37_unit_stride.log).
// With the units taken by SM id (MEGAMOE_UNIT_STRIDE=0) the programmatic launch costs only
// +0.2..+1.2 % from 256 tokens (ab/v37_unit_smid.log), so it gains nothing there either.
// MEGAMOE_PDL=0 / 1 overrides the rule.
constexpr bool kProgrammaticLaunch = true;
constexpr int kProgrammaticLaunchMaxTokens = 64;
// The schedule's units by SM (FusedMoeConfig::sm_units, fused_moe.cu's schedule_unit): at
// plan creation a probe kernel records the order in which a plain launch on an idle GPU fills
// the SMs (one cyclic order, TPC mates in turn), and each CTA then takes its SM's place in it
// as its unit, so the layer keeps the idle launch's placement when its CTAs land elsewhere:
// behind a programmatic launch (v37 above), or behind another stream's kernels still holding
// SMs, as an engine overlapping its communication with the layer has them. Off where a probe
// run breaks a TPC pair, an SM id passes the table, the grid is smaller than the card or
// clusters place the CTAs (pair tiles); MEGAMOE_UNIT_STRIDE turns it off.
// v43 (H100, bench/results/ab/v43_sm_units_h100.log, two rounds against 93adc63's units by
// blockIdx): behind a programmatic launch (MEGAMOE_PDL=1) 4096 tokens +10..+15 % ->
// +0.1..+0.7 % against each binary's plain launch, 1024 +1.2..+1.5 % -> -0.2..+0.4 %; plain
// launches level from 1 to 4096 tokens (-0.5..+0.5 %). At 16384 plain launches measured
// +0.9..+2.2 % with the table (ten rounds, ab/v43_sm_units_16k*_h100.log; a bimodal case, 16
// of 25 pairs slower; v37's units by %smid +1.7 / +1.9 %), behind a programmatic launch
// -2.5..-5 %: so the table runs up to kSmUnitsMaxTokens, where plain launches lose nothing.
// (Why a fixed table costs at 16384 is not known; a plain launch starts a few SMs further
// on in the cyclic order each time, so units by blockIdx move from launch to launch.)
constexpr bool kSmUnits = true;
constexpr int kSmUnitsMaxTokens = 4096;
// (Tried and removed, v39-v41: the wide tiles' GEMM1 token rows gathered by one producer warp
// with cp.async from one quantized copy of each token, where phase 0 writes a copy a slot.
// Without loads the gathered layer was 3-5 % faster, with them +44..74 % at 4096 and 16384
// tokens, whether the warp waited for each stage or its lanes arrived asynchronously:
// bench/results/NOTES.md v40-v41.)

// Router GEMM tile by token hint (route.cu): up to kRouteSmallTokens tokens 16x16
// tiles (decode: 64+ blocks stream the router weight at once), up to
// kRouteMediumTokens 64x32, above 128x64 (fewer L2 re-reads). Every tile computes
// the same bits, so these only move time. Measured (v12, bench/results/ab/v12_route_tiles.log,
// v12_route_threshold.log; GLM-5 / DeepSeek-V3 / GLM-5.3-Flash route us): 512 tokens medium 38.3 /
// 32.8 / 35.5 against large 47.4 / 35.3 / 37.2; 1024 tokens medium 69.3 / 51.1 / 53.6 against
// large 51.4 / 39.6 / 57.3; the small tiles only win up to 64. With fewer than
// kRouteLargeMinExperts experts (the 8-way shares: 32, 36) the large tile's 64 expert rows
// are half empty: 1024 tokens took 46 / 32 / 36 us there against 32 / 25 / 27 medium.
// Up to kRouteWideTokens the 64x32 tile runs its group's four K slices side by side (16
// warps; v19, bench/results/ab/v19_combine_route.log: GLM-5 128 tokens 24.3 -> 17.6 us of
// route_logits, 256 24.8 -> 18.9, DeepSeek-V3 256 level; at 512 level on GLM-5 and +3 us on
// DeepSeek-V3, so not above 256).
constexpr int kRouteSmallTokens = 64;
constexpr int kRouteWideTokens = 256;
constexpr int kRouteMediumTokens = 512;
constexpr int kRouteMediumTokensFewExperts = 1024;
constexpr int kRouteLargeMinExperts = 128;
// The largest token hint the 64x32 router tile takes for `experts` experts.
constexpr int route_medium_max_tokens(int experts) {
  return experts >= kRouteLargeMinExperts ? kRouteMediumTokens : kRouteMediumTokensFewExperts;
}

// Pipeline depth for a token block: as many stages as fit the budget, at most kMaxStages.
// 8: the decode tiles' 9th-12th stages bought nothing (v31: capped at 8, interleaved
// rounds at 128..512 tokens on three presets, level or up to 1.3 % faster; v30 level at
// 8 and 64 tokens), and a shorter ring is less shared memory to wait on.
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
#ifdef MEGAMOE_STAGES_CAP  // timing-only builds of bench/results/ab/v29_stage_sweep.sh
  return s > MEGAMOE_STAGES_CAP ? MEGAMOE_STAGES_CAP : s;
#else
  return s > kMaxStages ? kMaxStages : s;
#endif
}
constexpr int smem_bytes(int block_n, bool wide = false) {
  return fixed_smem_bytes(block_n) + stages_for(block_n, wide) * stage_bytes(block_n, wide);
}
#ifndef MEGAMOE_STAGES_CAP
// The GEMM2 staging (v15) fits beside the six prefill stages v14 had.
static_assert(stages_for(128) == 6, "prefill stages");
static_assert(stages_for(128, true) == 4, "wide tile stages");
// Every decode ring is the capped one (the decode pairs' exchange fits beside it).
static_assert(stages_for(8) == kMaxStages && stages_for(48) == kMaxStages && stages_for(64) == kMaxStages,
              "decode stages");
#endif

// Token block (wgmma N): the smallest of kBlockNs that holds the average rows per
// routed expert plus its spread (choose_config), so decode tiles waste few columns,
// nearly every expert takes one block, and prefill tiles reuse each weight tile over
// up to 128 tokens. `tokens`: as many as one device holding all experts would see (an
// expert-parallel rank's count times R); `local_experts`: the experts this device computes
// (s.experts on one device, E / R on a rank); `read_gbps_per_sm`: the card's peak DRAM
// bandwidth per SM (FusedMoeConfig::read_gbps_per_sm; device_read_gbps_per_sm).
FusedMoeConfig choose_config(const MoeShape& s, int tokens, int num_sms, int local_experts,
                             double read_gbps_per_sm);
// The current device's peak DRAM bandwidth per SM in GB/s: 2 (double data rate) x its memory
// clock x its bus width / its SMs; 0 where the driver reports no clock.
double device_read_gbps_per_sm(int device);

std::string describe(const FusedMoeConfig& c);
void maybe_print_config(const MoeShape& s, int tokens, const FusedMoeConfig& c);

}  // namespace megamoe::kernels
