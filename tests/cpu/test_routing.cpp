// Routing (docs/numerics.md §6) against an independent, deliberately plain implementation
// written here: sort-based top-k instead of repeated argmax, exact ids and
// weights to 1e-6 on tie-free random inputs; ties go to the lower id.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "megamoe/reference/moe.h"
#include "megamoe/weights/host_weights.h"
#include "support.h"

namespace megamoe {
namespace {

// Straightforward routing of one token from its logits.
void naive_route(const MoeShape& s, const float* z, const float* bias, int32_t* ids, float* wts) {
  const int E = s.experts, K = s.topk;
  std::vector<double> score(E), c(E);
  double mx = *std::max_element(z, z + E), den = 0.0;
  for (int e = 0; e < E; ++e) den += std::exp(double(z[e]) - mx);
  for (int e = 0; e < E; ++e) {
    const double v = z[e];
    switch (s.score) {
      case ScoreFunc::kSigmoid: score[e] = 1.0 / (1.0 + std::exp(-v)); break;
      case ScoreFunc::kSoftmax: score[e] = std::exp(v - mx) / den; break;
      case ScoreFunc::kSqrtSoftplus: score[e] = std::sqrt(std::log(1.0 + std::exp(v))); break;
    }
    c[e] = score[e] + (bias ? bias[e] : 0.0);
  }
  std::vector<int> order(E);
  if (s.n_group > 1) {
    const int per = E / s.n_group;
    std::vector<double> gs(s.n_group);
    for (int g = 0; g < s.n_group; ++g) {
      std::vector<double> v(c.begin() + g * per, c.begin() + (g + 1) * per);
      std::sort(v.rbegin(), v.rend());
      gs[g] = v[0] + v[1];
    }
    std::vector<int> gorder(s.n_group);
    std::iota(gorder.begin(), gorder.end(), 0);
    std::stable_sort(gorder.begin(), gorder.end(), [&](int a, int b) { return gs[a] > gs[b]; });
    for (int i = s.topk_group; i < s.n_group; ++i)
      for (int e = gorder[i] * per; e < (gorder[i] + 1) * per; ++e) c[e] = -INFINITY;
  }
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return c[a] > c[b]; });
  double sum = 0.0;
  for (int k = 0; k < K; ++k) sum += score[order[k]];
  for (int k = 0; k < K; ++k) {
    ids[k] = order[k];
    const double w = s.norm_topk_prob ? score[order[k]] / (sum + 1e-20) : score[order[k]];
    wts[k] = float(w * s.routed_scaling);
  }
}

void check_against_naive(const MoeShape& s, uint64_t seed) {
  const HostMoeWeights w = make_random_weights(s, seed);
  const int T = 64;
  const auto x = test::random_bf16(size_t(T) * s.hidden, seed + 1);
  std::vector<int32_t> ids(T * s.topk), nids(T * s.topk);
  std::vector<float> wts(T * s.topk), nwts(T * s.topk), logits(T * s.experts);
  ref::route(s, w.view(), x.data(), T, ids.data(), wts.data(), logits.data());
  // The logits are checked separately (independent double dot products).
  const MoeWeightsView v = w.view();
  for (int t = 0; t < T; ++t)
    for (int e = 0; e < s.experts; ++e) {
      double z = 0.0;
      for (int h = 0; h < s.hidden; ++h) {
        const double r = s.router_dtype == RouterDtype::kF32
                             ? double(static_cast<const float*>(v.router)[size_t(e) * s.hidden + h])
                             : double(num::bf16_decode(
                                   static_cast<const num::bf16_t*>(v.router)[size_t(e) * s.hidden + h]));
        z += double(num::bf16_decode(x[size_t(t) * s.hidden + h])) * r;
      }
      ASSERT_EQ(logits[size_t(t) * s.experts + e], float(z)) << "token " << t << " expert " << e;
    }
  for (int t = 0; t < T; ++t) {
    naive_route(s, logits.data() + size_t(t) * s.experts, s.correction_bias ? v.bias : nullptr,
                nids.data() + t * s.topk, nwts.data() + t * s.topk);
    for (int k = 0; k < s.topk; ++k) {
      ASSERT_EQ(ids[t * s.topk + k], nids[t * s.topk + k]) << "token " << t << " slot " << k;
      ASSERT_NEAR(wts[t * s.topk + k], nwts[t * s.topk + k], 1e-6 * s.routed_scaling) << "token " << t;
    }
  }
}

TEST(Routing, SigmoidMatchesNaive) { check_against_naive(test::small_glm_shape(), 11); }

TEST(Routing, SoftmaxMatchesNaive) {
  MoeShape s = test::small_glm_shape();
  s.score = ScoreFunc::kSoftmax;
  s.correction_bias = false;
  s.norm_topk_prob = false;
  s.routed_scaling = 1.0f;
  check_against_naive(s, 12);
}

TEST(Routing, SqrtSoftplusMatchesNaive) {
  MoeShape s = test::small_glm_shape();
  s.score = ScoreFunc::kSqrtSoftplus;
  check_against_naive(s, 13);
}

TEST(Routing, GroupedTopkMatchesNaive) {
  MoeShape s = test::small_deepseek_shape();
  check_against_naive(s, 14);
  s.score = ScoreFunc::kSoftmax;
  check_against_naive(s, 15);
}

TEST(Routing, GroupedTopkKeepsOnlyBestGroups) {
  const MoeShape s = test::small_deepseek_shape();
  const HostMoeWeights w = make_random_weights(s, 21);
  const int T = 32, per = s.experts / s.n_group;
  const auto x = test::random_bf16(size_t(T) * s.hidden, 22);
  std::vector<int32_t> ids(T * s.topk);
  std::vector<float> wts(T * s.topk);
  ref::route(s, w.view(), x.data(), T, ids.data(), wts.data());
  for (int t = 0; t < T; ++t) {
    std::vector<int> groups;
    for (int k = 0; k < s.topk; ++k) groups.push_back(ids[t * s.topk + k] / per);
    std::sort(groups.begin(), groups.end());
    groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
    EXPECT_LE(int(groups.size()), s.topk_group);
  }
}

TEST(Routing, TiesGoToLowerId) {
  // A zero router makes every logit 0: all scores tie, so the lowest ids win
  // and (normalized) weights are equal.
  MoeShape s = test::small_glm_shape();
  HostMoeWeights w = make_random_weights(s, 31);
  std::memset(w.region(w.layout.router), 0, w.layout.router.bytes);
  std::memset(w.region(w.layout.bias), 0, w.layout.bias.bytes);
  const auto x = test::random_bf16(s.hidden * 2, 32);
  std::vector<int32_t> ids(2 * s.topk);
  std::vector<float> wts(2 * s.topk);
  ref::route(s, w.view(), x.data(), 2, ids.data(), wts.data());
  for (int t = 0; t < 2; ++t)
    for (int k = 0; k < s.topk; ++k) {
      EXPECT_EQ(ids[t * s.topk + k], k);
      EXPECT_FLOAT_EQ(wts[t * s.topk + k], s.routed_scaling / s.topk);
    }
  // Grouped: all groups tie, the lower groups are kept, then the lower ids.
  MoeShape g = test::small_deepseek_shape();
  HostMoeWeights wg = make_random_weights(g, 33);
  std::memset(wg.region(wg.layout.router), 0, wg.layout.router.bytes);
  std::memset(wg.region(wg.layout.bias), 0, wg.layout.bias.bytes);
  // Make expert 5 (group 1) the best: group 1 is then kept first.
  reinterpret_cast<float*>(wg.region(wg.layout.bias))[5] = 0.5f;
  std::vector<int32_t> gid(g.topk);
  std::vector<float> gw(g.topk);
  ref::route(g, wg.view(), x.data(), 1, gid.data(), gw.data());
  EXPECT_EQ(gid[0], 5);
  for (int k = 1; k < g.topk; ++k) EXPECT_EQ(gid[k], k - 1);
}

TEST(Routing, BiasSelectsButDoesNotWeight) {
  // A huge bias on one expert must select it with its unbiased score.
  MoeShape s = test::small_glm_shape();
  s.norm_topk_prob = false;
  s.routed_scaling = 1.0f;
  HostMoeWeights w = make_random_weights(s, 41);
  reinterpret_cast<float*>(w.region(w.layout.bias))[7] = 100.0f;
  const auto x = test::random_bf16(s.hidden, 42);
  std::vector<int32_t> ids(s.topk);
  std::vector<float> wts(s.topk), logits(s.experts);
  ref::route(s, w.view(), x.data(), 1, ids.data(), wts.data(), logits.data());
  EXPECT_EQ(ids[0], 7);
  EXPECT_FLOAT_EQ(wts[0], 1.0f / (1.0f + std::exp(-logits[7])));
}

}  // namespace
}  // namespace megamoe
