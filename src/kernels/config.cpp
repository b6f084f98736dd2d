// The one configuration step (config.h): pure functions of the shape, the token count, the
// card and the switches; the rules they apply and their reasons are heuristics.h.
#include "config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <stdexcept>

namespace megamoe::kernels {
namespace {

// The tile rule (docs/kernel.md, "How a configuration is chosen"): the token block (wgmma N)
// is the smallest of kBlockNs that holds the average rows per routed expert plus its spread,
// so decode tiles waste few columns and nearly every expert takes one block, up to the 64- and
// 128-token edges of heuristics.h; the switches replace single choices. `tokens`: as many as
// one device holding all experts would see (an expert-parallel rank's count times R).
FusedMoeConfig choose_tiles(const MoeShape& s, int tokens, int grid, int local_experts,
                            double read_gbps_per_sm, const Overrides& ov) {
  FusedMoeConfig c;
  c.read_gbps_per_sm = ov.read_gbps_per_sm.value_or(read_gbps_per_sm);
  const bool fast_read = c.read_gbps_per_sm >= kFastReadGBpsPerSm;
  // Rows an expert receives are about Poisson(avg) under balanced routing: a block of
  // max(1.5 avg, avg + 2.5 sqrt(avg)) rows (at most 2 avg) holds all but ~0.5 % of the
  // experts, whose weights are then streamed twice; a wider block only adds tensor work.
  // Gives 8 up to 4 rows, 16 up to 8, 32 up to 20, 48 below kTile64MinAvgRows.
  const double avg_rows = double(tokens) * s.topk / s.experts;
  const double need =
      std::min(2.0 * avg_rows, std::max(1.5 * avg_rows, avg_rows + 2.5 * std::sqrt(avg_rows)));
  const double tile128_min_rows =
      local_experts < kTile128ManyExperts
          ? (fast_read ? kTile128MinAvgRowsFewExpertsFastRead : kTile128MinAvgRowsFewExperts)
          : (fast_read ? kTile128MinAvgRowsFastRead : kTile128MinAvgRows);
  c.block_n = avg_rows < tile128_min_rows ? 64 : 128;
  if (avg_rows < kTile64MinAvgRows) {
    for (int bn : kBlockNs) {
      if (bn >= need) {
        c.block_n = bn;
        break;
      }
    }
  }
  c.block_n = ov.block_n.value_or(c.block_n);
  c.half_tiles = ov.half_tiles.value_or(c.block_n == 128 && avg_rows <= kHalfTileMaxAvgRows);
  c.pair_tiles =
      ov.pair_tiles.value_or(kPairTiles && local_experts >= kPairTilesMinExperts) && c.block_n == 128;
  c.pair_weights = ov.pair_weights.value_or(kPairWeights);
  if (c.block_n <= kDecodePairsMaxBlockN) {
    // GEMM1 tiles (128 columns of an expert hit) at most: every routed row another expert.
    const int64_t hit = std::min<int64_t>(s.experts, int64_t(tokens) * s.topk);
    const int64_t tiles1 = hit * (s.inter / 128) + s.shared_inter() / 128;
    c.decode_pairs = ov.decode_pairs.value_or(tiles1 < int64_t(kDecodePairsMaxTilesPerCta) * grid);
  }
  c.wide_tiles = ov.wide_tiles.value_or(kWideTiles && !c.half_tiles) && c.block_n == 128;
  c.num_sms = grid;
  c.programmatic_launch =
      ov.programmatic_launch.value_or(kProgrammaticLaunch && tokens <= kProgrammaticLaunchMaxTokens);
  return c;
}

// Clusters of two CTAs at a block_n (pair tiles at 128, decode pairs at 8 and 16): every
// GEMM's output blocks in pairs where the pair splits them (I / 128, Is / 128 and H / 128
// even for pair tiles, H / 128 for decode pairs), one device, an even grid, and the grid's
// clusters resident at once (the kernel's grid barrier waits for every CTA).
bool pairs_allowed(const ConfigInputs& in, int grid, int block_n) {
  const MoeShape& s = in.shape;
  const bool even_h = (s.hidden / 128) % 2 == 0;
  const bool even_blocks = even_h && (s.inter / 128) % 2 == 0 && (s.shared_inter() / 128) % 2 == 0;
  if (in.ep_ranks || grid % 2 != 0 || !in.card.clusters_resident) return false;
  static_assert(kDecodePairsMaxBlockN == 16, "the decode pair kernels: block_n 8 and 16");
  if (block_n == 128) return even_blocks;
  return (block_n == 8 || block_n == 16) && even_h;
}

// Wide tiles pair GEMM2's output blocks (H / 128 even); under expert parallelism where
// kEpWideTiles says so.
bool wide_allowed(const ConfigInputs& in) {
  const bool even_h = (in.shape.hidden / 128) % 2 == 0;
  return even_h && (!in.ep_ranks || in.switches.ep_wide_tiles.value_or(kEpWideTiles));
}

// Expert parallelism: the overlapped pull keeps its tables beside the schedule's
// (EpPullTables): where they do not fit, the pull runs before the tiles.
bool ep_overlap_for(const ConfigInputs& in) {
  if (!in.ep_ranks) return false;
  const MoeShape& s = in.shape;
  const int local = s.experts / in.ep_ranks + (s.has_shared() ? 1 : 0);
  const bool fits = s.experts + local <= kMaxExpertsTotal;
  const bool overlap = in.switches.ep_overlap.value_or(kEpOverlap && fits);
  if (overlap && !fits)
    throw std::invalid_argument(
        fmt::format("MEGAMOE_EP_OVERLAP=1: {} routing + {} local experts exceed the {} table entries of the "
                    "overlapped pull",
                    s.experts, local, kMaxExpertsTotal));
  return overlap;
}

}  // namespace

int resolve_grid(const ConfigInputs& in) {
  int grid = in.card.sms;
  if (in.grid_cap > 0) grid = std::min(grid, in.grid_cap);
  if (in.switches.num_sms) grid = std::min(*in.switches.num_sms, grid);
  return grid;
}

bool sm_units_wanted(const ConfigInputs& in) {
  return !in.switches.unit_stride && in.switches.sm_units.value_or(kSmUnits) &&
         resolve_grid(in) == in.card.sms;
}

DebugArgs resolve_debug(const ConfigInputs& in) {
  const Overrides& ov = in.switches;
  DebugArgs d;
  d.stop = ov.debug_stop;
  d.skip = ov.debug_skip;
  d.round_robin = ov.round_robin.value_or(false) ? 1 : 0;
  d.early_weights = ov.early_weights.value_or(true) ? 1 : 0;
  if (ov.unit_stride) {
    const int grid = resolve_grid(in);
    d.unit_stride = *ov.unit_stride;
    if (!(d.unit_stride == 0 || std::gcd(d.unit_stride, grid) == 1))
      throw std::invalid_argument(
          fmt::format("MEGAMOE_UNIT_STRIDE={}: expected 0 or a stride coprime to the grid's {} CTAs",
                      d.unit_stride, grid));
  } else if (sm_units_wanted(in)) {
    d.unit_turn = ov.unit_turn.value_or(0);
  }
  return d;
}

FusedMoeConfig resolve_config(const ConfigInputs& in, int tokens) {
  const MoeShape& s = in.shape;
  const Overrides& ov = in.switches;
  // Expert parallelism: a local expert receives from every rank, as many rows as one
  // device holding all experts would see for R times the tokens.
  const int R = std::max(1, in.ep_ranks);
  const int64_t all_tokens = int64_t(tokens) * R;
  const int local_experts = in.ep_ranks ? s.experts / in.ep_ranks : s.experts;
  const int grid = resolve_grid(in);
  FusedMoeConfig c = choose_tiles(s, int(std::min<int64_t>(all_tokens, 1 << 30)), grid, local_experts,
                                  in.card.read_gbps_per_sm, ov);
  c.router_ksplit = kRouterSlices;
  c.wide_tiles = c.wide_tiles && c.block_n == 128 && wide_allowed(in);
  // (wide tiles take the pair tiles' place: one CTA computes both tiles of a token pair)
  const bool pairs_ok = pairs_allowed(in, grid, c.block_n);
  c.pair_tiles = c.pair_tiles && c.block_n == 128 && pairs_ok && !c.wide_tiles;
  c.pair_weights = c.pair_weights && c.pair_tiles;
  c.decode_pairs = c.decode_pairs && c.block_n <= kDecodePairsMaxBlockN && pairs_ok;
  c.stages = stages_for(c.block_n, c.wide_tiles);
  c.ep_overlap = ep_overlap_for(in);
  // (clusters keep blockIdx: the hardware places a pair; two CTAs on one SM would take one unit)
  c.sm_units = sm_units_wanted(in) && in.card.sm_unit_table && !c.pair_tiles && !c.decode_pairs &&
               all_tokens <= ov.sm_units_max_tokens.value_or(kSmUnitsMaxTokens) &&
               2 * smem_bytes(c.block_n, c.wide_tiles) > in.card.smem_per_sm;
  c.tail_pool = ov.tail_pool.value_or(tail_pool_for(c.wide_tiles));
  return c;
}

ConfigInputs with_forward_switches(const ConfigInputs& plan, const Overrides& now) {
  ConfigInputs in = plan;
  Overrides& o = in.switches;
  o.block_n = now.block_n, o.half_tiles = now.half_tiles, o.wide_tiles = now.wide_tiles;
  o.pair_tiles = now.pair_tiles, o.pair_weights = now.pair_weights, o.decode_pairs = now.decode_pairs;
  o.programmatic_launch = now.programmatic_launch, o.read_gbps_per_sm = now.read_gbps_per_sm;
  o.route_tile = now.route_tile;
  o.print_config = now.print_config;
  return in;
}

std::string describe(const FusedMoeConfig& c) {
  // (each mechanism under its one name: docs/kernel.md's glossary)
  return fmt::format(
      "block_m={} block_n={} block_k={} stages={} smem={}B num_sms={} read_gbps_per_sm={:.0f} "
      "router_ksplit={}{}{}{}{}{}{}{}{}{}",
      kBlockM, c.block_n, kBlockK, c.stages, smem_bytes(c.block_n, c.wide_tiles), c.num_sms,
      c.read_gbps_per_sm, c.router_ksplit, c.half_tiles ? " half_tiles" : "",
      c.wide_tiles ? " wide_tiles" : "", c.pair_tiles ? " pair_tiles" : "",
      c.pair_tiles && c.pair_weights ? " pair_weights" : "", c.decode_pairs ? " decode_pairs" : "",
      c.ep_overlap ? " ep_overlap" : "", c.programmatic_launch ? " programmatic_launch" : "",
      c.sm_units ? " sm_units" : "",
      // (the tail pool where it is not kTailPool: kTailPoolWide, or MEGAMOE_TAIL_POOL)
      c.tail_pool != kTailPool ? fmt::format(" tail_pool={}", c.tail_pool) : std::string());
}

void maybe_print_config(const ConfigInputs& in, int tokens, const FusedMoeConfig& c) {
  if (in.switches.print_config)
    std::fprintf(stderr, "megamoe: T=%d %s: %s\n", tokens, in.shape.describe().c_str(), describe(c).c_str());
}

}  // namespace megamoe::kernels
