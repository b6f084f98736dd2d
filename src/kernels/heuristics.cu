#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "cuda_check.h"
#include "heuristics.h"
#include "megamoe/kernels/overrides.h"

namespace megamoe::kernels {

FusedMoeConfig choose_config(const MoeShape& s, int tokens, int num_sms, int local_experts,
                             double read_gbps_per_sm) {
  const Overrides& ov = overrides();
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
    c.decode_pairs = ov.decode_pairs.value_or(tiles1 < int64_t(kDecodePairsMaxTilesPerCta) * num_sms);
  }
  c.wide_tiles = ov.wide_tiles.value_or(kWideTiles && !c.half_tiles) && c.block_n == 128;
  c.stages = stages_for(c.block_n, c.wide_tiles);
  c.tail_pool = tail_pool_for(c.wide_tiles);
  c.num_sms = num_sms;
  c.programmatic_launch =
      ov.programmatic_launch.value_or(kProgrammaticLaunch && tokens <= kProgrammaticLaunchMaxTokens);
  return c;
}

double device_read_gbps_per_sm(int device) {
  int clock_khz = 0, bus_bits = 0, sms = 0;
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device));
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (clock_khz <= 0 || bus_bits <= 0 || sms <= 0) return 0;
  return 2.0 * clock_khz * 1e3 * (bus_bits / 8) / 1e9 / sms;
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

void maybe_print_config(const MoeShape& s, int tokens, const FusedMoeConfig& c) {
  if (overrides().print_config)
    std::fprintf(stderr, "megamoe: T=%d %s: %s\n", tokens, s.describe().c_str(), describe(c).c_str());
}

}  // namespace megamoe::kernels
