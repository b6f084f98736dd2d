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
    for (const int per_cta : {1, 2, 4, 16, 100}) {  // (kTailPool, kTailPoolWide)
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

// The kernel's tile ids (TileIds::decode, as fused_moe.cu counts them): every (GEMM, expert,
// output block, token block) exactly once, for every rank of a pair, and inside an expert
// the token blocks by chunks in increasing id order.
struct IdCase {
  int E, S, H, I, BN, T, K;  // S shared experts (Is = S * I); T tokens, K routed slots each
  int sh;                    // 1: pair tiles, in both GEMMs (2: wide tiles, GEMM2's output blocks in pairs)
  uint64_t seed;
  int pair_weights = 0;  // pair tiles sharing the weight tile
};

void check_tile_ids(const IdCase& k) {
  std::mt19937_64 rng(k.seed);
  const int E_total = k.E + (k.S > 0 ? 1 : 0);
  std::vector<int> rows(E_total, 0);
  for (int i = 0; i < k.T * k.K; ++i) ++rows[rng() % k.E];  // uneven, some experts empty
  if (k.S > 0) rows[k.E] = k.T;
  std::vector<int> unit_off(E_total + 1, 0);
  for (int e = 0; e < E_total; ++e) unit_off[e + 1] = unit_off[e] + (rows[e] + k.BN - 1) / k.BN;
  const int n1 = k.I / 128, n1s = k.S * k.I / 128, n2 = k.H / 128, chunk = 16;
  const int sh1 = k.sh == 1 ? 1 : 0, sh2 = k.sh ? 1 : 0;
  const auto ids =
      kernels::TileIds::count(n1, n1s, n2, k.E, E_total, chunk, sh1, sh2, unit_off.data(), k.pair_weights);
  // seen[gemm - 1][unit][nblk]
  std::vector<std::vector<int>> seen[2];
  for (int g = 0; g < 2; ++g)
    for (int e = 0; e < E_total; ++e)
      for (int b = unit_off[e]; b < unit_off[e + 1]; ++b)
        seen[g].push_back(std::vector<int>(g == 1 ? n2 : e == k.E ? n1s : n1, 0));
  std::vector<int> last_chunk(2 * E_total, -1);
  int weight_pairs = 0;
  for (int tile = 0; tile < ids.tiles(); ++tile) {
    const int sh = tile < ids.t1 ? sh1 : sh2;  // this id names 1 << sh tiles
    if (sh) {
      // The two ranks of a pair share a tile's token block (output blocks 2j, 2j + 1) or,
      // with pair_weights, its weights (token blocks 2p, 2p + 1 of one output block).
      const kernels::TileCoord c0 = ids.decode(tile, 0), c1 = ids.decode(tile, 1);
      ASSERT_EQ(c0.pair_weights, c1.pair_weights) << "tile " << tile;
      ASSERT_TRUE(c0.gemm == c1.gemm && c0.e == c1.e) << "tile " << tile;
      if (c0.pair_weights) {
        ASSERT_TRUE(k.pair_weights) << "tile " << tile;
        EXPECT_TRUE(c0.nblk == c1.nblk && c0.block % 2 == 0 && c1.block == c0.block + 1) << "tile " << tile;
        ++weight_pairs;
      } else {
        EXPECT_TRUE(c0.block == c1.block && c0.nblk % 2 == 0 && c1.nblk == c0.nblk + 1) << "tile " << tile;
      }
    }
    for (int rank = 0; rank < (1 << sh); ++rank) {
      const kernels::TileCoord c = ids.decode(tile, rank);
      ASSERT_TRUE(c.gemm == 1 || c.gemm == 2) << "tile " << tile;
      ASSERT_TRUE(c.e >= 0 && c.e < E_total && (c.gemm == 2 || c.e < k.E || k.S > 0)) << "tile " << tile;
      const int nb = unit_off[c.e + 1] - unit_off[c.e];
      ASSERT_TRUE(c.block >= 0 && c.block < nb) << "tile " << tile << " expert " << c.e;
      auto& row = seen[c.gemm - 1][unit_off[c.e] + c.block];
      ASSERT_TRUE(c.nblk >= 0 && c.nblk < int(row.size())) << "tile " << tile << " expert " << c.e;
      ++row[c.nblk];
      int& lc = last_chunk[(c.gemm - 1) * E_total + c.e];
      EXPECT_GE(c.block / chunk, lc) << "tile " << tile << ": chunks out of order";
      lc = c.block / chunk;
    }
  }
  for (int g = 0; g < 2; ++g)
    for (const auto& row : seen[g])
      for (int v : row) ASSERT_EQ(v, 1) << "GEMM" << g + 1 << ": a tile decoded " << v << " times";
  // Every token-block pair of a chunk shares its weights (only a chunk's odd last block
  // pairs its output blocks): count them.
  if (k.pair_weights) {
    int expect = 0;
    for (int e = 0; e < E_total; ++e) {
      const int nb = unit_off[e + 1] - unit_off[e], n = e == k.E ? n1s : n1;
      for (int b0 = 0; b0 < nb; b0 += chunk) expect += ((nb - b0 < chunk ? nb - b0 : chunk) / 2) * (n + n2);
    }
    EXPECT_EQ(weight_pairs, expect);
  }
}

TEST(TileSchedule, TileIdsCoverEveryTileOnce) {
  const IdCase cases[] = {
      {256, 1, 6144, 2048, 128, 16384, 8, 0, 1},     // GLM-5 prefill: 4-5 blocks an expert
      {256, 1, 6144, 2048, 128, 16384, 8, 1, 2},     // ... pair tiles
      {256, 1, 6144, 2048, 128, 16384, 8, 2, 2},     // ... wide tiles
      {256, 1, 6144, 2048, 128, 16384, 8, 1, 2, 1},  // ... sharing the weight tile
      {256, 1, 6144, 2048, 128, 4096, 8, 1, 8, 1},   // ... 1-3 blocks an expert
      {256, 1, 6144, 2048, 8, 1, 8, 0, 3},           // decode: most experts empty
      {32, 2, 1024, 512, 128, 2600, 4, 0, 4},        // two shared experts (Is = 2I), 21 shared blocks
      {32, 2, 1024, 512, 128, 2600, 4, 1, 5},        // ... pair tiles
      {32, 2, 1024, 512, 128, 2600, 4, 2, 5},        // ... wide tiles
      {32, 2, 1024, 512, 128, 2600, 4, 1, 5, 1},     // ... sharing the weight tile (odd last chunk)
      {32, 0, 1152, 384, 16, 300, 4, 0, 6},          // no shared expert, odd H / 128
      {8, 3, 256, 128, 32, 700, 2, 0, 7},            // three shared experts, chunks of 16 blocks and more
  };
  for (const IdCase& k : cases) check_tile_ids(k);
}

// The SM-unit table (fused_moe.cu's probe_sm_units): the H100's plain-launch order
// (ab/placement_probe_v43.log) at two starting SMs gives each SM its place; a CTA twice on one
// SM, an SM id past the table, a blockIdx pair across two TPCs or a grid the table cannot
// hold gives no table at all.
TEST(TileSchedule, SmUnitTable) {
  constexpr int kSlots = 256;
  constexpr uint8_t kNone = 255;
  const int G = 132;
  // The order's pattern: TPC pairs 16 SM ids apart, then the next pair of ids.
  std::vector<uint32_t> order = {124, 125, 126, 127, 128, 129, 130, 131};
  for (uint32_t base = 0; order.size() < size_t(G); base += 2)
    for (uint32_t sm = base; sm < 124 && order.size() < size_t(G); sm += 16) {
      if (std::find(order.begin(), order.end(), sm) != order.end()) continue;
      order.push_back(sm), order.push_back(sm + 1);
    }
  ASSERT_EQ(order.size(), size_t(G));
  for (int start : {0, 4}) {  // (a later launch starts a few SMs further on)
    std::vector<uint32_t> sm(G);
    for (int b = 0; b < G; ++b) sm[b] = order[(b + start) % G];
    uint8_t table[kSlots];
    ASSERT_EQ(kernels::sm_unit_table(sm.data(), G, table, kSlots, kNone), -1) << "start " << start;
    std::vector<int> units;
    for (int id = 0; id < kSlots; ++id)
      if (table[id] != kNone) units.push_back(table[id]);
    std::sort(units.begin(), units.end());
    ASSERT_EQ(units.size(), size_t(G));
    for (int u = 0; u < G; ++u) EXPECT_EQ(units[u], u);
    for (int b = 0; b < G; ++b) EXPECT_EQ(table[sm[b]], b);
  }
  auto broken = [&](std::vector<uint32_t> sm, int grid, int expect, const char* what) {
    uint8_t table[kSlots];
    EXPECT_EQ(kernels::sm_unit_table(sm.data(), grid, table, kSlots, kNone), expect) << what;
    EXPECT_TRUE(std::all_of(table, table + kSlots, [&](uint8_t v) { return v == kNone; })) << what;
  };
  std::vector<uint32_t> twice = order;
  twice[41] = twice[40];
  broken(twice, G, 41, "an SM twice");
  std::vector<uint32_t> past = order;
  past[7] = 300;
  broken(past, G, 7, "an SM id past the table");
  std::vector<uint32_t> split = order;
  std::swap(split[11], split[12]);  // blockIdx 10, 11 and 12, 13 each across two TPCs
  broken(split, G, 11, "a pair across two TPCs");
  broken(order, G - 1, G - 1, "an odd grid");
  broken(order, 0, 0, "no grid");
}

}  // namespace
}  // namespace megamoe
