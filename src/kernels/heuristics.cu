#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "cuda_check.h"
#include "heuristics.h"

namespace megamoe::kernels {

FusedMoeConfig choose_config(const MoeShape& s, int tokens, int num_sms, int local_experts,
                             double read_gbps_per_sm) {
  FusedMoeConfig c;
  // Rows an expert receives are about Poisson(avg) under balanced routing: a block of
  // max(1.5 avg, avg + 2.5 sqrt(avg)) rows holds all but ~0.5 % of the experts (whose
  // weights are then streamed twice), and a wider block only adds tensor work and
  // folds (the decode loop is bound by its instructions from ~32 rows, v13). Never
  // wider than twice the average (the rule before v14). Gives 8 up to 4 rows, 16 up
  // to 8, 32 up to 20, 48 below kTile64MinAvgRows (24), 64 from there (the rule's
  // 48 up to 32 rows: the 64-token tile measured faster, v35), and 128-token tiles with
  // half tiles from kTile128MinAvgRows (38; kTile128MinAvgRowsFewExperts, 60, on fewer than
  // kTile128ManyExperts local experts; on a card reading at least kFastReadGBpsPerSm
  // kTile128MinAvgRowsFastRead, 24, and kTile128MinAvgRowsFewExpertsFastRead, 48), in CTA
  // pairs on kPairTilesMinExperts or more.
  c.read_gbps_per_sm = read_gbps_per_sm;
  if (const char* env = std::getenv("MEGAMOE_READ_GBPS_PER_SM")) c.read_gbps_per_sm = std::atof(env);
  const bool fast_read = c.read_gbps_per_sm >= kFastReadGBpsPerSm;
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
  if (const char* env = std::getenv("MEGAMOE_BLOCK_N")) c.block_n = std::atoi(env);
  c.half_tiles = c.block_n == 128 && avg_rows <= kHalfTileMaxAvgRows;
  if (const char* env = std::getenv("MEGAMOE_HALF_TILES")) c.half_tiles = std::atoi(env) != 0;
  c.pair_tiles = kPairTiles && c.block_n == 128 && local_experts >= kPairTilesMinExperts;
  if (c.block_n <= kDecodePairsMaxBlockN) {
    // GEMM1 tiles (128 columns of an expert hit) at most: every routed row another expert.
    const int64_t hit = std::min<int64_t>(s.experts, int64_t(tokens) * s.topk);
    const int64_t tiles1 = hit * (s.inter / 128) + s.shared_inter() / 128;
    c.pair_tiles = tiles1 < int64_t(kDecodePairsMaxTilesPerCta) * num_sms;
  }
  if (const char* env = std::getenv("MEGAMOE_PAIR_TILES")) c.pair_tiles = std::atoi(env) != 0;
  c.pair_weights = kPairWeights && c.block_n == 128;
  if (const char* env = std::getenv("MEGAMOE_PAIR_WEIGHTS")) c.pair_weights = std::atoi(env) != 0;
  c.wide_tiles = kWideTiles && c.block_n == 128 && !c.half_tiles;
  if (const char* env = std::getenv("MEGAMOE_WIDE_TILES")) c.wide_tiles = std::atoi(env) != 0;
  c.stages = stages_for(c.block_n, c.wide_tiles);
  c.tail_pool = tail_pool_for(c.wide_tiles);
  c.num_sms = num_sms;
  c.programmatic_launch = kProgrammaticLaunch && tokens <= kProgrammaticLaunchMaxTokens;
  if (const char* env = std::getenv("MEGAMOE_PDL")) c.programmatic_launch = std::atoi(env) != 0;
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
  return fmt::format(
      "block_m={} block_n={} block_k={} stages={} smem={}B sms={} read={:.0f}GB/s/SM "
      "router_ksplit={}{}{}{}{}{}{}{}{}",
      kBlockM, c.block_n, kBlockK, c.stages, smem_bytes(c.block_n, c.wide_tiles), c.num_sms,
      c.read_gbps_per_sm, c.router_ksplit, c.half_tiles ? " half_tiles" : "",
      c.wide_tiles ? " wide_tiles" : "", c.pair_tiles ? " pair_tiles" : "",
      c.pair_tiles && c.pair_weights ? " pair_weights" : "", c.ep_overlap ? " ep_overlap" : "",
      c.programmatic_launch ? " pdl" : "", c.sm_units ? " sm_units" : "",
      // (the tail pool where it is not kTailPool: kTailPoolWide, or MEGAMOE_TAIL_POOL)
      c.tail_pool != kTailPool ? fmt::format(" tail_pool={}", c.tail_pool) : std::string());
}

void maybe_print_config(const MoeShape& s, int tokens, const FusedMoeConfig& c) {
  const char* env = std::getenv("MEGAMOE_PRINT_CONFIG");
  if (env && env[0] == '1')
    std::fprintf(stderr, "megamoe: T=%d %s: %s\n", tokens, s.describe().c_str(), describe(c).c_str());
}

}  // namespace megamoe::kernels
