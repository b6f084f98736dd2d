// The fused kernel's static tile schedule (include/megamoe/kernels/tile_schedule.h):
// every tile exactly once, each CTA's tiles in increasing order with GEMM1 before
// GEMM2 (the deadlock-freedom argument), and the weight bytes balanced.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "megamoe/kernels/tile_schedule.h"

namespace megamoe {
namespace {

struct Case {
  int G, t1, t2, cost1, cost2;
  bool balanced = true;
};

struct Costs {
  double max = 0, mean = 0;
};

// Checks coverage and order; returns the largest per-CTA cost and the mean.
Costs check_schedule(const Case& k) {
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
  Costs r;
  r.mean = (double(k.t1) * k.cost1 + double(k.t2) * k.cost2) / k.G;
  r.max = double(*std::max_element(cost.begin(), cost.end()));
  return r;
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

TEST(TileSchedule, PoolTilesClaimedAfterEachList) {
  // The kernel's claims: a CTA whose own list is done takes pool_begin() + k for the
  // k-th claim of the grid, in any interleaving of the CTAs (here a random one). Every
  // tile once, each CTA's tiles in increasing order, the pool only GEMM2 tiles.
  const Case cases[] = {{132, 288, 432, 48, 16}, {132, 1920, 2880, 48, 16}, {132, 40, 40, 8, 4},
                        {132, 0, 0, 48, 16},     {1, 7, 5, 3, 2},           {132, 135, 3, 56, 16}};
  for (const Case& k : cases) {
    for (const int per_cta : {1, 2, 4, 100}) {
      const int pool = std::min(k.t2, per_cta * k.G);
      std::vector<kernels::TileSchedule> s(k.G);
      std::vector<int> prev(k.G, -1), seen(size_t(k.t1) + k.t2, 0);
      std::vector<bool> done(k.G, false);
      for (int c = 0; c < k.G; ++c) s[c].init(c, k.G, k.t1, k.t2, k.cost1, k.cost2, true, pool);
      EXPECT_EQ(s[0].pool_begin(), k.t1 + k.t2 - pool);
      std::mt19937 rng(7);
      int claims = 0, active = k.G;
      while (active > 0) {
        const int c = int(rng() % unsigned(k.G));
        if (done[c]) continue;
        int t = s[c].next();
        if (t == s[c].pool_begin() && t < k.t1 + k.t2) t += claims++;
        if (t >= k.t1 + k.t2) {
          done[c] = true, --active;
          continue;
        }
        EXPECT_GT(t, prev[c]) << "CTA " << c << " takes tiles out of order";
        if (t >= s[c].pool_begin()) {
          EXPECT_GE(t, k.t1) << "a GEMM1 tile in the pool";
        }
        prev[c] = t;
        ++seen[t];
      }
      for (size_t t = 0; t < seen.size(); ++t) EXPECT_EQ(seen[t], 1) << "tile " << t << " pool " << pool;
    }
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
  // Decode shapes at T = 1 (9 experts): GLM-5 (H 6144: GEMM1 tiles of 48 stages, 48
  // GEMM2 tiles of 16 per expert), GLM-5.3-Flash (H 4096), DeepSeek-V3 (H 7168).
  // Balanced means: no CTA more than one GEMM2 tile above the mean, where one
  // round-robin over all tiles is not.
  const Case cases[] = {{132, 288, 432, 48, 16}, {132, 288, 288, 32, 16}, {132, 288, 504, 56, 16}};
  for (Case k : cases) {
    const Costs bal = check_schedule(k);
    EXPECT_LE(bal.max, bal.mean + k.cost2) << "t1 " << k.t1 << " t2 " << k.t2;
    k.balanced = false;
    const Costs rr = check_schedule(k);
    EXPECT_GT(rr.max, rr.mean + k.cost2) << "the case does not need balancing";
  }
}

}  // namespace
}  // namespace megamoe
