// The fused kernel's static tile schedule (include/megamoe/kernels/tile_schedule.h):
// every tile exactly once, each CTA's tiles in increasing order with GEMM1 before
// GEMM2 (the deadlock-freedom argument), and the weight bytes balanced.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "megamoe/kernels/tile_schedule.h"

namespace megamoe {
namespace {

struct Case {
  int G, t1, t2, cost1, cost2;
  bool balanced = true;
};

// Returns the max per-CTA cost over the mean.
double check_schedule(const Case& k) {
  std::vector<int> seen(size_t(k.t1) + k.t2, 0);
  std::vector<long> cost(k.G, 0);
  for (int c = 0; c < k.G; ++c) {
    kernels::TileSchedule s;
    s.init(c, k.G, k.t1, k.t2, k.cost1, k.cost2, k.balanced);
    int prev = -1;
    for (int t = s.next(); t < k.t1 + k.t2; t = s.next()) {
      EXPECT_GT(t, prev) << "CTA " << c << " takes tiles out of order";
      EXPECT_GE(t, 0);
      prev = t;
      ++seen[t];
      cost[c] += t < k.t1 ? k.cost1 : k.cost2;
    }
    EXPECT_EQ(s.next(), k.t1 + k.t2) << "the end stays the end";
  }
  for (size_t t = 0; t < seen.size(); ++t) EXPECT_EQ(seen[t], 1) << "tile " << t;
  const double mean = (double(k.t1) * k.cost1 + double(k.t2) * k.cost2) / k.G;
  return mean > 0 ? *std::max_element(cost.begin(), cost.end()) / mean : 1.0;
}

TEST(TileSchedule, EveryTileOnceInOrder) {
  const Case cases[] = {
      {132, 288, 432, 48, 16},    // GLM-5, T = 1
      {132, 1920, 2880, 48, 16},  // GLM-5, T = 8
      {132, 40, 40, 8, 4},        // reduced shape, T = 1: fewer GEMM1 tiles than CTAs
      {132, 264, 400, 48, 16},    // t1 % G == 0
      {132, 0, 0, 48, 16},        // T = 0
      {1, 7, 5, 3, 2},            // one CTA
      {132, 135, 3, 56, 16},      // fewer GEMM2 tiles than the light CTAs want
      {78, 4096 * 32, 4096 * 48, 48, 16},
  };
  for (Case k : cases) {
    check_schedule(k);
    k.balanced = false;
    check_schedule(k);
  }
}

TEST(TileSchedule, RoundRobinIsOneRoundRobinOverAllTiles) {
  const int G = 132, t1 = 288, t2 = 432;
  for (int c = 0; c < G; ++c) {
    kernels::TileSchedule s;
    s.init(c, G, t1, t2, 48, 16, false);
    for (int t = c; t < t1 + t2; t += G) EXPECT_EQ(s.next(), t) << "CTA " << c;
    EXPECT_EQ(s.next(), t1 + t2);
  }
}

TEST(TileSchedule, BalancesDecodeBytes) {
  // GLM-5 at T = 1: 9 experts x 32 GEMM1 tiles (48 stages) and x 48 GEMM2 tiles (16).
  EXPECT_LE(check_schedule({132, 288, 432, 48, 16}), 1.02);
  // GLM-5.3-Flash at T = 1 (H 4096: 32 stages), DeepSeek-V3 (H 7168: 56 stages).
  EXPECT_LE(check_schedule({132, 288, 288, 32, 16}), 1.10);
  EXPECT_LE(check_schedule({132, 288, 504, 56, 16}), 1.10);
}

}  // namespace
}  // namespace megamoe
