// Expert parallelism (docs/numerics.md §8): the R-rank simulation must give the same bytes
// as the single-rank kernel-faithful layer on the concatenated batch, for any
// R dividing E, uneven and empty batches, and skewed routing.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "megamoe/reference/moe.h"
#include "megamoe/weights/host_weights.h"
#include "support.h"

namespace megamoe {
namespace {

// Runs EP over `sizes` (tokens per rank) and single-rank on the concatenation;
// asserts identical routing and output bytes. Returns the EP stats.
ref::EpStats check_ep(const MoeShape& s, const HostMoeWeights& w, const std::vector<int>& sizes,
                      uint64_t seed) {
  const int R = int(sizes.size()), H = s.hidden, K = s.topk;
  const int T = std::accumulate(sizes.begin(), sizes.end(), 0);
  const auto x = test::random_bf16(size_t(T) * H, seed);
  std::vector<int32_t> ids(size_t(T) * K);
  std::vector<float> wts(size_t(T) * K), y(size_t(T) * H);
  ref::route(s, w.view(), x.data(), T, ids.data(), wts.data());
  ref::moe_layer(s, w.view(), x.data(), T, ids.data(), wts.data(), ref::Mode::kKernelFaithful, y.data());

  std::vector<ref::RankBatch> batches(R);
  std::vector<float*> ys(R);
  std::vector<int32_t*> idp(R);
  std::vector<float*> wp(R);
  std::vector<float> y_ep(y.size(), -1.0f);
  std::vector<int32_t> ids_ep(ids.size(), -7);
  std::vector<float> wts_ep(wts.size(), -1.0f);
  int off = 0;
  for (int r = 0; r < R; ++r) {
    batches[r] = {x.data() + size_t(off) * H, sizes[r]};
    ys[r] = y_ep.data() + size_t(off) * H;
    idp[r] = ids_ep.data() + size_t(off) * K;
    wp[r] = wts_ep.data() + size_t(off) * K;
    off += sizes[r];
  }
  const ref::EpStats st = ref::moe_layer_ep(s, w.view(), R, batches, ys, idp, wp);
  EXPECT_EQ(ids_ep, ids);
  EXPECT_EQ(std::memcmp(wts_ep.data(), wts.data(), wts.size() * sizeof(float)), 0);
  EXPECT_TRUE(test::same_bytes(y_ep, y, H)) << "R = " << R;

  // The same ranks on rank-local weights (what CudaEpMoeLayer uploads): each rank's
  // buffer poisoned, then filled by region_copies, so a region the copies miss shows.
  std::vector<std::vector<uint8_t>> local(R);
  std::vector<MoeWeightsView> views(R);
  for (int r = 0; r < R; ++r) {
    const MoeWeightLayout l = MoeWeightLayout::compute(s, ExpertRange{r * (s.experts / R), s.experts / R});
    local[r].assign(l.total_bytes, 0x7E);
    for (const RegionCopy& c : region_copies(w.layout, l))
      std::memcpy(local[r].data() + c.dst_offset, w.data() + c.src_offset, c.bytes);
    views[r] = MoeWeightsView::at(local[r].data(), l, s);
  }
  std::vector<float> y_local(y.size(), -1.0f);
  for (int r = 0, o = 0; r < R; o += sizes[r], ++r) ys[r] = y_local.data() + size_t(o) * H;
  ref::moe_layer_ep(s, views, batches, ys);
  EXPECT_TRUE(test::same_bytes(y_local, y, H)) << "rank-local weights, R = " << R;
  // Every (token, expert) row is computed exactly once somewhere.
  EXPECT_EQ(std::accumulate(st.rows_received.begin(), st.rows_received.end(), int64_t(0)), int64_t(T) * K);
  const int64_t sent = std::accumulate(st.tokens_sent.begin(), st.tokens_sent.end(), int64_t(0));
  EXPECT_LE(sent, int64_t(T) * std::min(K, R));
  EXPECT_GE(sent, T);
  return st;
}

TEST(Ep, MatchesSingleRankForEveryR) {
  const MoeShape s = test::small_glm_shape();
  const HostMoeWeights w = make_random_weights(s, 201);
  check_ep(s, w, {23}, 202);
  check_ep(s, w, {9, 14}, 203);
  check_ep(s, w, {5, 0, 11, 3}, 204);
  check_ep(s, w, {4, 1, 0, 7, 2, 0, 6, 3}, 205);
}

TEST(Ep, GroupedTopkShape) {
  const MoeShape s = test::small_deepseek_shape();
  const HostMoeWeights w = make_random_weights(s, 211);
  check_ep(s, w, {7, 0, 12, 1}, 212);
  check_ep(s, w, {3, 3, 0, 5, 8, 0, 2, 1}, 213);
}

TEST(Ep, ClampActiveShape) {
  MoeShape s = test::small_glm_shape();
  s.swiglu_limit = 1.0f;
  const HostMoeWeights w = make_random_weights(s, 221);
  check_ep(s, w, {6, 10}, 222);
  check_ep(s, w, {0, 0, 9, 0}, 223);
}

TEST(Ep, AllTokensToOneRank) {
  // A large bias on rank 2's experts (of 4) makes them win for every token:
  // rank 2 computes every routed row and receives one copy of every token.
  const MoeShape s = test::small_glm_shape();  // E = 16, K = 4: 4 experts per rank
  HostMoeWeights w = make_random_weights(s, 231);
  auto* bias = reinterpret_cast<float*>(w.region(w.layout.bias));
  for (int e = 8; e < 12; ++e) bias[e] = 10.0f;
  const std::vector<int> sizes{5, 8, 0, 3};
  const ref::EpStats st = check_ep(s, w, sizes, 232);
  const int T = 16;
  EXPECT_EQ(st.rows_received, (std::vector<int64_t>{0, 0, int64_t(T) * s.topk, 0}));
  EXPECT_EQ(st.tokens_sent, (std::vector<int64_t>{5, 8, 0, 3}));
}

TEST(Ep, RankLocalLayout) {
  // A rank's layout holds its E/R routed experts (a quarter of their bytes here), the
  // shared expert and the whole router; copies refuse experts the source lacks.
  const MoeShape s = test::small_glm_shape();  // E = 16
  const MoeWeightLayout all = MoeWeightLayout::compute(s);
  const MoeWeightLayout r2 = MoeWeightLayout::compute(s, ExpertRange{8, 4});
  EXPECT_EQ(r2.experts.first, 8);
  EXPECT_EQ(r2.experts.count, 4);
  EXPECT_EQ(r2.w13.bytes * 4, all.w13.bytes);
  EXPECT_EQ(r2.w2_scale.bytes * 4, all.w2_scale.bytes);
  EXPECT_EQ(r2.shared_w13.bytes, all.shared_w13.bytes);
  EXPECT_EQ(r2.router.bytes, all.router.bytes);
  EXPECT_EQ(r2.bias.bytes, all.bias.bytes);
  EXPECT_LT(r2.total_bytes, all.total_bytes / 2);
  // The w13 copy starts at expert 8 of the whole layer.
  const std::vector<RegionCopy> c = region_copies(all, r2);
  ASSERT_FALSE(c.empty());
  EXPECT_EQ(c[0].src_offset, all.w13.offset + 8 * (all.w13.bytes / 16));
  EXPECT_EQ(c[0].bytes, r2.w13.bytes);
  // From a rank's layout, only that rank's experts (or fewer) can be filled.
  EXPECT_NO_THROW(region_copies(r2, MoeWeightLayout::compute(s, ExpertRange{9, 2})));
  EXPECT_THROW(region_copies(r2, MoeWeightLayout::compute(s, ExpertRange{4, 4})), std::invalid_argument);
  EXPECT_THROW(region_copies(r2, all), std::invalid_argument);
  for (ExpertRange bad : {ExpertRange{0, 0}, ExpertRange{-1, 4}, ExpertRange{13, 4}, ExpertRange{16, 1}})
    EXPECT_THROW(MoeWeightLayout::compute(s, bad), std::invalid_argument) << bad.first << "+" << bad.count;
}

TEST(Ep, RejectsRNotDividingE) {
  const MoeShape s = test::small_glm_shape();
  const HostMoeWeights w = make_random_weights(s, 241);
  std::vector<ref::RankBatch> b(3);
  std::vector<float*> y(3, nullptr);
  EXPECT_THROW(ref::moe_layer_ep(s, w.view(), 3, b, y), std::invalid_argument);
  EXPECT_THROW(ref::moe_layer_ep(s, w.view(), 0, {}, {}), std::invalid_argument);
  const std::vector<MoeWeightsView> three(3, w.view());
  EXPECT_THROW(ref::moe_layer_ep(s, three, b, y), std::invalid_argument);
}

}  // namespace
}  // namespace megamoe
