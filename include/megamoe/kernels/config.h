// The tile configuration of the fused kernel: plain values, no CUDA (the decision table test
// reads it on any machine).
#pragma once

namespace megamoe::kernels {

// Tile configuration of the fused kernel, decided once by one pure function
// (src/kernels/config.h, resolve_config; its rules in heuristics.h) and printed by describe()
// under the same names; each field is one mechanism
// of docs/kernel.md's glossary, and the environment switch of the same name overrides it
// (megamoe/kernels/overrides.h, docs/tuning.md). Every choice keeps the output bytes.
struct FusedMoeConfig {
  int block_n = 8;  // tokens a tile (wgmma N): 8, 16, 32, 48, 64 or 128
  int stages = 8;   // depth of the shared-memory stage ring
  int num_sms = 0;  // CTAs of the persistent grid
  int router_ksplit = 1;
  // 128-token tiles of at most 64 rows run on one consumer warpgroup.
  bool half_tiles = false;
  // 128-token tiles in clusters of two CTAs (TMA multicast of the operand both need): by
  // default the two take neighbouring token blocks of one output block and share the weight
  // tile (pair_weights); without pair_weights, neighbouring output blocks of one token block
  // sharing the token tile. Only where the shape and grid allow it (resolve_config).
  bool pair_tiles = false;
  // What a pair tile shares: the weight tile (true; an expert's odd last token block still
  // shares its token tile) or the token tile. Meaningful with pair_tiles only.
  bool pair_weights = false;
  // Decode tiles (block_n 8 or 16) in clusters of two CTAs: each computes one 64-column half
  // of a GEMM1 tile, the two exchange the tokens' amax through shared memory.
  bool decode_pairs = false;
  // 128-token tiles against 256 weight rows in one CTA: a stage holds a GEMM1 tile's two
  // halves or two neighbouring GEMM2 output blocks, the token rows once. Takes the pair
  // tiles' place where the shape allows it (resolve_config).
  bool wide_tiles = false;
  // Expert parallelism: the rank's row pull runs beside its tiles (a property of the plan,
  // reported here with the rest).
  bool ep_overlap = false;
  // route_topk and the fused kernel launched as programmatic dependents of the kernel before
  // them: their CTAs start while it runs and wait for its end before reading its outputs.
  bool programmatic_launch = false;
  // The schedule's units by SM: the CTA on an SM takes the SM's place in the order a plain
  // launch on an idle GPU fills the SMs (probed at plan creation), wherever a launch behind
  // busy SMs puts the CTAs. Where the plan allows it (one CTA an SM, the grid covering the
  // card, no clusters), up to kSmUnitsMaxTokens tokens.
  bool sm_units = false;
  // GEMM2 tiles a CTA leaves to claims at the schedule's end (the tail pool).
  int tail_pool = 4;
  // The card's peak DRAM bandwidth per SM in GB/s (0: unknown), an input of the rule's
  // 64 / 128-token edge.
  double read_gbps_per_sm = 0;
};

}  // namespace megamoe::kernels
