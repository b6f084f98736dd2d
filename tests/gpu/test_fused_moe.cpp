// GPU tests of the fused Hopper MoE path against the kernel-faithful CPU
// reference (run on the device machine; skipped without an sm_90 device).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "megamoe/api/forward.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/kernels/overrides.h"
#include "megamoe/reference/moe.h"
#include "megamoe/weights/host_weights.h"

namespace megamoe {
namespace {

using kernels::Overrides;
using kernels::ScopedOverrides;
using testutil::have_device;
using testutil::odd_blocks_shape;
using testutil::random_x;
using testutil::reduced_shape;

#define CK(call) ASSERT_EQ((call), cudaSuccess) << #call

struct Compare {
  double rel_l2 = 0;
  int64_t bad = 0;
  int64_t nonfinite = 0;
  int64_t differ = 0;  // outputs whose bits are not the reference's
  std::string first_differ;
  std::string first;
};

// y (bf16 from the GPU) vs ref (float holding bf16): atol + rtol*|ref| per
// element with atol scaled to the output's RMS, plus the relative L2.
Compare compare(const std::vector<num::bf16_t>& y, const std::vector<float>& ref, int H, double rtol = 0.05,
                double atol_rms = 0.05) {
  Compare c;
  double num = 0, den = 0, sq = 0;
  for (float r : ref) sq += double(r) * r;
  const double rms = std::sqrt(sq / std::max<size_t>(1, ref.size()));
  const double atol = atol_rms * rms;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double a = num::bf16_decode(y[i]), r = ref[i];
    if (!std::isfinite(a)) {
      ++c.nonfinite;
      if (c.first.empty())
        c.first = "non-finite at token " + std::to_string(i / H) + " col " + std::to_string(i % H);
      continue;
    }
    num += (a - r) * (a - r);
    den += r * r;
    if (a != r && c.differ++ == 0)
      c.first_differ = "token " + std::to_string(i / H) + " col " + std::to_string(i % H) + ": got " +
                       std::to_string(a) + " want " + std::to_string(r);
    if (std::fabs(a - r) > atol + rtol * std::fabs(r)) {
      if (c.bad == 0)
        c.first = "token " + std::to_string(i / H) + " col " + std::to_string(i % H) + ": got " +
                  std::to_string(a) + " want " + std::to_string(r);
      ++c.bad;
    }
  }
  c.rel_l2 = den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0);
  if (c.nonfinite) c.rel_l2 = INFINITY;
  return c;
}

// Runs the CUDA layer on x and returns y, ids, weights (y poisoned first).
struct GpuRun {
  std::vector<num::bf16_t> y;
  std::vector<int32_t> ids;
  std::vector<float> w;
};

GpuRun run_gpu(api::CudaMoeLayer& layer, const std::vector<num::bf16_t>& x, int T) {
  const MoeShape& s = layer.shape();
  GpuRun r;
  const size_t n = size_t(T) * s.hidden;
  num::bf16_t *dx = nullptr, *dy = nullptr;
  EXPECT_EQ(cudaMalloc(&dx, std::max<size_t>(16, n * 2)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dy, std::max<size_t>(16, n * 2)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(dx, x.data(), n * 2, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemset(dy, 0xFF, std::max<size_t>(16, n * 2)), cudaSuccess);  // poison: bf16 NaN
  layer.forward(dx, dy, T, nullptr, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  r.y.resize(n);
  r.ids.resize(size_t(T) * s.topk);
  r.w.resize(size_t(T) * s.topk);
  EXPECT_EQ(cudaMemcpy(r.y.data(), dy, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  if (T > 0) {
    EXPECT_EQ(cudaMemcpy(r.ids.data(), layer.topk_ids(), r.ids.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpy(r.w.data(), layer.topk_weights(), r.w.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  cudaFree(dx);
  cudaFree(dy);
  return r;
}

// Random weights (seed) and T tokens (seed + 1) of shape s, and the CUDA layer built
// from those weights for up to max_tokens (it uploads them).
struct TestCase {
  HostMoeWeights w;
  std::vector<num::bf16_t> x;
  std::unique_ptr<api::CudaMoeLayer> layer;
};
TestCase make_case(const MoeShape& s, uint64_t seed, int T, int max_tokens) {
  TestCase c{make_random_weights(s, seed), random_x(size_t(T) * s.hidden, seed + 1), nullptr};
  api::MoeLayerOptions opt;
  opt.max_tokens = max_tokens;
  c.layer = std::make_unique<api::CudaMoeLayer>(c.w, opt);
  return c;
}

// The MoE part is compared given the kernel's own routing (ids equal to the CPU's,
// weights within 1e-5: the router's tensor-core sums are not modeled), and must then
// be the reference's bits: the reference runs the tensor cores' accumulation model
// (num::fp8_mma_step) and the same SwiGLU (num::exp_fma), so any differing output is
// a bug (v16; before the model the relative L2 was 3e-3 to 6e-3).
void check_against_reference(const MoeShape& s, int T, uint64_t seed) {
  const TestCase tc = make_case(s, seed, T, std::max(T, 1));
  const HostMoeWeights& w = tc.w;
  const auto& x = tc.x;
  api::CudaMoeLayer& layer = *tc.layer;
  const GpuRun g = run_gpu(layer, x, T);

  std::vector<int32_t> ids(size_t(T) * s.topk);
  std::vector<float> wts(size_t(T) * s.topk);
  ref::route(s, w.view(), x.data(), T, ids.data(), wts.data());
  ASSERT_EQ(g.ids, ids) << "routing ids differ from the CPU reference";
  for (size_t i = 0; i < wts.size(); ++i)
    ASSERT_NEAR(g.w[i], wts[i], 1e-5 * std::fabs(wts[i]) + 1e-7) << "routing weight " << i;

  std::vector<float> ref(size_t(T) * s.hidden);
  ref::moe_layer(s, w.view(), x.data(), T, ids.data(), g.w.data(), ref::Mode::kKernelFaithful, ref.data());
  const Compare c = compare(g.y, ref, s.hidden);
  std::printf("  %s T=%d: rel_l2 %.3e, bad %lld, differ %lld / %zu, config %s\n", s.describe().c_str(), T,
              c.rel_l2, (long long)c.bad, (long long)c.differ, ref.size(), layer.config_for(T).c_str());
  EXPECT_EQ(c.nonfinite, 0) << c.first;
  EXPECT_LE(c.rel_l2, 1e-3) << c.first;  // (implied by differ == 0; kept for its message)
  EXPECT_EQ(c.bad, 0) << c.first;
  EXPECT_EQ(c.differ, 0) << c.first_differ;
}

class FusedMoe : public ::testing::Test {
 protected:
  // Every test starts with no switch set, whatever the environment says; `ov` holds the
  // switches a test sets, in force from set() until the next set() or the test's end.
  void SetUp() override {
    if (!have_device()) GTEST_SKIP() << "no sm_90 device";
    set();
  }
  void TearDown() override { scope.reset(); }
  void set() {
    scope.reset();
    scope.emplace(ov);
  }
  Overrides ov;
  std::optional<ScopedOverrides> scope;
};

TEST_F(FusedMoe, ReducedShapeSmallT) {
  for (int T : {1, 3, 8, 64}) check_against_reference(reduced_shape(), T, 100 + T);
}

TEST_F(FusedMoe, ReducedShapeLargeT) {
  // 2600: the shared expert's 21 token blocks take two chunks of the tile order
  // (kTokenChunk = 16), the second one short.
  for (int T : {512, 2048, 2600}) check_against_reference(reduced_shape(), T, 200 + T);
}

TEST_F(FusedMoe, TopkWarpsTakeSeveralTokens) {
  // route_topk runs one wave of resident blocks: past ~2,600 tokens (132 SMs x 5 blocks x 4
  // warps at 32 experts) a warp ranks several tokens in its pipeline, each token's row
  // positions stored one token later; a wrong or lost position moves a slot's row.
  MoeShape s = reduced_shape();
  s.hidden = 256, s.inter = 128;
  check_against_reference(s, 6001, 300);
}

TEST_F(FusedMoe, MoreThan256Experts) {
  // route_topk holds 16 experts a lane past 256 experts (8 up to 256): 320 experts, top-8,
  // at a count where a warp ranks one token and at one where it ranks several.
  MoeShape s = reduced_shape();
  s.hidden = 256, s.inter = 128, s.experts = 320, s.topk = 8;
  for (int T : {64, 6001}) check_against_reference(s, T, 400 + T);
}

TEST_F(FusedMoe, PairTilesSmall) {
  // 128-token tiles in CTA pairs (clusters of two) against the reference, with half tiles
  // and without: a small case for compute-sanitizer (PairTilesByTheRule runs them by the
  // heuristic's choice). Both pairings: the token tile shared, and the weight tile shared
  // (T = 200: a token block a routed expert, the shared expert's two make a weight pair;
  // 8 experts at T = 300: one to three blocks an expert, so routed weight pairs and odd
  // last blocks).
  ov.block_n = 128, ov.wide_tiles = false, ov.pair_tiles = true;
  for (const bool weights : {false, true}) {
    ov.pair_weights = weights;
    for (const bool half : {true, false}) {
      ov.half_tiles = half;
      set();
      check_against_reference(reduced_shape(), 200, 500);
    }
    MoeShape few = reduced_shape();
    few.experts = 8;
    check_against_reference(few, 300, 501);
    const std::string cfg = make_case(reduced_shape(), 500, 200, 200).layer->config_for(200);
    EXPECT_NE(cfg.find("pair_tiles"), std::string::npos) << "pair tiles did not run: " << cfg;
    EXPECT_EQ(cfg.find("pair_weights") != std::string::npos, weights) << cfg;
  }
}

TEST_F(FusedMoe, DecodePairsSmall) {
  // Decode pairs (clusters of two CTAs, each computing one 64-column half of a GEMM1 tile,
  // the tokens' amax exchanged through shared memory) against the reference, forced on and
  // off at block_n 8 and 16: a small case for compute-sanitizer. T = 5: a token block an
  // expert; T = 40: up to 16 rows an expert.
  const TestCase tc = make_case(reduced_shape(), 600, 40, 40);
  for (const bool pairs : {true, false}) {
    ov.decode_pairs = pairs;
    for (const int bn : {8, 16}) {
      ov.block_n = bn;
      set();
      for (int T : {5, 40}) check_against_reference(reduced_shape(), T, 600 + T);
      const std::string cfg = tc.layer->config_for(40);
      EXPECT_EQ(cfg.find("decode_pairs") != std::string::npos, pairs) << cfg;
      EXPECT_EQ(cfg.find("pair_tiles"), std::string::npos) << cfg;
    }
  }
}

TEST_F(FusedMoe, DecodePairsWhereGemm1TilesAreFew) {
  // The heuristic: decode pairs where an expert's GEMM1 tiles (I / 128 each, the shared
  // expert's too) would number fewer than two a CTA. 128 experts of I = 512 (four tiles):
  // 8 tokens hit at most 32 experts (132 tiles), 64 tokens up to 128 (516).
  MoeShape s = reduced_shape();
  s.hidden = 256, s.experts = 128;
  const TestCase tc = make_case(s, 602, 8, 64);
  const std::string few = tc.layer->config_for(8), many = tc.layer->config_for(64);
  EXPECT_NE(few.find("block_n=8"), std::string::npos) << few;
  EXPECT_NE(few.find("decode_pairs"), std::string::npos) << few;
  EXPECT_NE(many.find("block_n=8"), std::string::npos) << many;
  EXPECT_EQ(many.find("decode_pairs"), std::string::npos) << many;
}

TEST_F(FusedMoe, WideTilesSmall) {
  // 128-token tiles against two output blocks in one CTA, with half tiles and without,
  // against the reference: a small case for compute-sanitizer (the large-T cases run wide
  // tiles by the heuristic's choice). 8 experts at T = 300: one to three token blocks an
  // expert.
  ov.block_n = 128, ov.wide_tiles = true;
  const TestCase tc = make_case(reduced_shape(), 502, 200, 200);
  for (const bool half : {true, false}) {
    ov.half_tiles = half;
    set();
    check_against_reference(reduced_shape(), 200, 502);
    // (half tiles on: the split, each warpgroup one block)
    const std::string cfg = tc.layer->config_for(200);
    EXPECT_NE(cfg.find(half ? "half_tiles wide_tiles" : " wide_tiles"), std::string::npos)
        << "wide tiles did not run (half_tiles " << half << "): " << cfg;
  }
  MoeShape few = reduced_shape();
  few.experts = 8;
  check_against_reference(few, 300, 503);
}

TEST_F(FusedMoe, WideTilesWhereHalfTilesAreOff) {
  // The heuristic's choice (reduced shape: T / 8 rows an expert on average): wide tiles (four
  // stages) above 96 rows, where half tiles stop; below, from 60 rows (32 experts: heuristics.h
  // kTile128MinAvgRowsFewExperts) on a card reading less than kFastReadGBpsPerSm a SM, from 48
  // on one reading more (kTile128MinAvgRowsFewExpertsFastRead), half tiles without pairs
  // (kPairTilesMinExperts); from 24 rows to there the 64-token tile.
  const TestCase tc = make_case(reduced_shape(), 1, 8, 2048);
  ov.read_gbps_per_sm = 25;
  set();
  for (int T : {1024, 2048}) {
    const std::string cfg = tc.layer->config_for(T);
    EXPECT_NE(cfg.find("stages=4"), std::string::npos) << T << ": " << cfg;
    EXPECT_NE(cfg.find("wide_tiles"), std::string::npos) << T << ": " << cfg;
    EXPECT_EQ(cfg.find("half_tiles"), std::string::npos) << T << ": " << cfg;
  }
  for (int T : {480, 640}) {
    const std::string cfg = tc.layer->config_for(T);
    EXPECT_NE(cfg.find("block_n=128"), std::string::npos) << T << ": " << cfg;
    EXPECT_NE(cfg.find("half_tiles"), std::string::npos) << T << ": " << cfg;
    EXPECT_EQ(cfg.find("pair_tiles"), std::string::npos) << T << ": " << cfg;
    EXPECT_EQ(cfg.find("wide_tiles"), std::string::npos) << T << ": " << cfg;
  }
  for (int T : {192, 296, 472}) {
    const std::string cfg = tc.layer->config_for(T);
    EXPECT_NE(cfg.find("block_n=64 "), std::string::npos) << T << ": " << cfg;
  }
  ov.read_gbps_per_sm = 37;
  set();
  for (int T : {384, 472}) {  // 48 and 59 rows
    const std::string cfg = tc.layer->config_for(T);
    EXPECT_NE(cfg.find("block_n=128"), std::string::npos) << T << ": " << cfg;
    EXPECT_NE(cfg.find("half_tiles"), std::string::npos) << T << ": " << cfg;
    EXPECT_EQ(cfg.find("pair_tiles"), std::string::npos) << T << ": " << cfg;
  }
  for (int T : {192, 376}) {  // 24 and 47 rows
    const std::string cfg = tc.layer->config_for(T);
    EXPECT_NE(cfg.find("block_n=64 "), std::string::npos) << T << ": " << cfg;
  }
}

TEST_F(FusedMoe, PairTilesByTheRule) {
  // Pair tiles as the heuristic picks them: 128-token half tiles in CTA pairs on 128 or more
  // local experts (kPairTilesMinExperts), none on fewer. 128 experts of the reduced shape get
  // T / 32 rows an expert: 2000 tokens 62.5 (half tiles from 38 rows on 128 experts, from 60
  // on fewer), against the reference.
  MoeShape s = reduced_shape();
  s.experts = 128;
  const TestCase tc = make_case(s, 700, 2000, 2000);
  const std::string cfg = tc.layer->config_for(2000);
  EXPECT_NE(cfg.find("half_tiles pair_tiles pair_weights"), std::string::npos) << cfg;
  check_against_reference(s, 2000, 701);
  s.experts = 127;  // one fewer: about the same rows, no pairs
  const std::string few = make_case(s, 702, 2000, 2000).layer->config_for(2000);
  EXPECT_NE(few.find("half_tiles"), std::string::npos) << few;
  EXPECT_EQ(few.find("pair_tiles"), std::string::npos) << few;
}

TEST_F(FusedMoe, TileEdgeFollowsReadBandwidth) {
  // On many local experts the 64-token tile holds from 24 to 38 rows an expert on a card
  // reading less than kFastReadGBpsPerSm a SM (the H100), and the 128-token half tiles in
  // pairs take over from 24 rows on one reading more (the H200; heuristics.h
  // kTile128MinAvgRowsFastRead). 128 experts of the reduced shape get T / 32 rows: 960
  // tokens 30 rows, 704 tokens 22 (the 48-token tile on both).
  MoeShape s = reduced_shape();
  s.experts = 128;
  const TestCase tc = make_case(s, 710, 960, 960);
  // Without the override the plan passes the card's own figure (nonzero on any sm_90 card)
  // and the tile at 30 rows follows it.
  const std::string own = tc.layer->config_for(960);
  const size_t at = own.find(" read_gbps_per_sm=");
  ASSERT_NE(at, std::string::npos) << own;
  const double own_gbps = std::atof(own.c_str() + at + 18);
  EXPECT_GT(own_gbps, 0) << own;
  EXPECT_NE(own.find(own_gbps >= 30 ? "block_n=128 " : "block_n=64 "),
            std::string::npos)  // (kFastReadGBpsPerSm)
      << own;
  ov.read_gbps_per_sm = 25;
  set();
  std::string cfg = tc.layer->config_for(960);
  EXPECT_NE(cfg.find("block_n=64 "), std::string::npos) << cfg;
  cfg = tc.layer->config_for(704);
  EXPECT_NE(cfg.find("block_n=48 "), std::string::npos) << cfg;
  ov.read_gbps_per_sm = 37;
  set();
  cfg = tc.layer->config_for(960);
  EXPECT_NE(cfg.find("block_n=128 "), std::string::npos) << cfg;
  EXPECT_NE(cfg.find("half_tiles pair_tiles pair_weights"), std::string::npos) << cfg;
  cfg = tc.layer->config_for(704);
  EXPECT_NE(cfg.find("block_n=48 "), std::string::npos) << cfg;
  check_against_reference(s, 960, 711);  // (the fast card's tiles at 30 rows)
}

TEST_F(FusedMoe, TwoSharedExperts) {
  // S = 2: the shared MLP has 2I columns, twice the routed experts' output blocks in
  // GEMM1 (decode_tile's chunks count them apart; 2600 tokens: 21 blocks, two chunks).
  MoeShape s = reduced_shape();
  s.shared_experts = 2;
  // (300 tokens: the 64-token tile; 520: half tiles.)
  for (int T : {5, 300, 520, 2600}) check_against_reference(s, T, 400 + T);
}

TEST_F(FusedMoe, OddKBlockCounts) {
  // Decode (swap AB, two stages an iteration plus an odd last one) and prefill tiles.
  // (300 tokens: the 64-token tile; 520: half tiles.)
  for (int T : {3, 40, 300, 520}) check_against_reference(odd_blocks_shape(), T, 300 + T);
}

TEST_F(FusedMoe, DeepSeekStyleGroupedBf16Router) {
  MoeShape s = reduced_shape();
  s.n_group = 8, s.topk_group = 4, s.router_dtype = RouterDtype::kBF16, s.swiglu_limit = 0;
  check_against_reference(s, 96, 7);
}

TEST_F(FusedMoe, NoSharedExpertSoftmax) {
  MoeShape s = reduced_shape();
  s.shared_experts = 0, s.score = ScoreFunc::kSoftmax, s.correction_bias = false;
  check_against_reference(s, 40, 8);
}

TEST_F(FusedMoe, PresetShapesSmallT) {
  for (const char* name : {"glm-4.7-flash", "glm-5.3-flash", "glm-5", "deepseek-v3"}) {
    const MoeShape s = find_preset(name).shape;
    check_against_reference(s, 8, 11);
  }
}

TEST_F(FusedMoe, ZeroTokens) {
  HostMoeWeights w = make_random_weights(reduced_shape(), 3);
  api::MoeLayerOptions opt;
  opt.max_tokens = 16;
  api::CudaMoeLayer layer(w, opt);
  const GpuRun g = run_gpu(layer, {}, 0);
  EXPECT_TRUE(g.y.empty());
}

TEST_F(FusedMoe, DeterministicAndTileIndependent) {
  for (const MoeShape& s : {reduced_shape(), odd_blocks_shape()}) {
    const int T = 200;
    const TestCase tc = make_case(s, 21, T, T);
    const auto& x = tc.x;
    api::CudaMoeLayer& layer = *tc.layer;
    const GpuRun a = run_gpu(layer, x, T);
    const GpuRun b = run_gpu(layer, x, T);
    EXPECT_EQ(0, std::memcmp(a.y.data(), b.y.data(), a.y.size() * 2)) << s.describe() << ": two runs differ";
    // A forward with each value of one switch gives a's bytes; the switch is unset after.
    auto same_bytes_each = [&](const char* name, auto field, auto values) {
      for (const auto v : values) {
        ov.*field = v;
        set();
        const GpuRun c = run_gpu(layer, x, T);
        EXPECT_EQ(0, std::memcmp(a.y.data(), c.y.data(), a.y.size() * 2))
            << s.describe() << ": " << name << "=" << v << " changes the bytes (" << layer.config_for(T)
            << ")";
      }
      ov.*field = std::nullopt;
      set();
    };
    same_bytes_each("block_n", &Overrides::block_n, std::initializer_list<int>{8, 16, 32, 48, 64, 128});
    // Decode pairs (block_n 8 and 16; the odd shape's H / 128 = 9 output blocks cannot pair)
    // and the same tiles alone: the same bytes.
    for (const int bn : {8, 16})
      for (const bool pairs : {false, true}) {
        ov.block_n = bn, ov.decode_pairs = pairs;
        set();
        const GpuRun c = run_gpu(layer, x, T);
        EXPECT_EQ(0, std::memcmp(a.y.data(), c.y.data(), a.y.size() * 2))
            << s.describe() << ": block_n " << bn << " decode_pairs " << pairs << " changes the bytes ("
            << layer.config_for(T) << ")";
      }
    ov.decode_pairs = std::nullopt;
    // 128-token tiles with warpgroup 1 idle on tiles of <= 64 rows (T = 200: ~25 rows an
    // expert, so every routed tile) and with both warpgroups computing (without half tiles
    // the rule takes wide tiles where the shape allows them): the same bytes.
    ov.block_n = 128;
    same_bytes_each("half_tiles", &Overrides::half_tiles, std::initializer_list<bool>{false, true});
    ov.block_n = std::nullopt;  // (the rule's tiles for the launch switches below)
    // route_topk and the fused kernel launched as programmatic dependents (their CTAs start
    // while the kernel before them runs; the rule takes it up to 64 tokens) and not: the same bytes.
    same_bytes_each("programmatic_launch", &Overrides::programmatic_launch,
                    std::initializer_list<bool>{false, true});
    // 128-token tiles in CTA pairs (clusters of two) and alone: the same bytes (the odd
    // shape's H / 128 = 9 output blocks cannot pair: it runs alone). Pairs sharing the token
    // tile or the weight tile, and wide tiles (both tiles of a token pair in one CTA; the odd
    // shape cannot take them either).
    struct Tiles {
      const char* name;
      bool wide, pairs, pair_weights;
    };
    for (const Tiles& v :
         {Tiles{"alone", false, false, false}, Tiles{"pairs sharing tokens", false, true, false},
          Tiles{"pairs sharing weights", false, true, true}, Tiles{"wide tiles", true, false, false}}) {
      ov.block_n = 128, ov.wide_tiles = v.wide, ov.pair_tiles = v.pairs, ov.pair_weights = v.pair_weights;
      set();
      const GpuRun c = run_gpu(layer, x, T);
      EXPECT_EQ(0, std::memcmp(a.y.data(), c.y.data(), a.y.size() * 2))
          << s.describe() << ": 128-token tiles " << v.name << " change the bytes (" << layer.config_for(T)
          << ")";
    }
    ov = Overrides{};
    set();
  }
}

TEST_F(FusedMoe, UnitsBySmKeepTheBytes) {
  // The schedule's units by SM (kSmUnits: the unit table the plan's probe found) against
  // units by blockIdx (Overrides::unit_stride = 1, read when the layer is made), launched plainly
  // and as programmatic dependents (which move the CTAs to other SMs): the same bytes. The
  // table must hold on the test machine's idle card wherever no cluster places the CTAs, up
  // to kSmUnitsMaxTokens (4096) tokens.
  const MoeShape s = reduced_shape();
  const int max_tokens = 5000;
  const TestCase tc = make_case(s, 31, max_tokens, max_tokens);
  api::MoeLayerOptions opt;
  opt.max_tokens = max_tokens;
  ov.unit_stride = 1;
  set();
  api::CudaMoeLayer by_block(tc.w, opt);
  // The measurement switches (read when the layer is made): the table at every token count,
  // turned by 38 units a forward.
  ov = Overrides{};
  ov.sm_units_max_tokens = 1000000, ov.unit_turn = 38;
  set();
  api::CudaMoeLayer turned(tc.w, opt);
  ov = Overrides{};
  for (const bool pdl : {false, true}) {
    ov.programmatic_launch = pdl;
    set();
    for (int T : {40, 600, 2600, 5000}) {
      const std::vector<num::bf16_t> x(tc.x.begin(), tc.x.begin() + size_t(T) * s.hidden);
      const GpuRun a = run_gpu(*tc.layer, x, T), b = run_gpu(by_block, x, T);
      const std::string cfg = tc.layer->config_for(T), plain = by_block.config_for(T);
      EXPECT_EQ(0, std::memcmp(a.y.data(), b.y.data(), a.y.size() * 2))
          << "T = " << T << " programmatic_launch " << pdl << ": units by SM change the bytes (" << cfg
          << ")";
      const bool clusters =
          cfg.find("pair_tiles") != std::string::npos || cfg.find("decode_pairs") != std::string::npos;
      EXPECT_EQ(cfg.find(" sm_units") != std::string::npos, !clusters && T <= 4096)
          << "T = " << T << ": the unit table did not hold: " << cfg;
      EXPECT_EQ(plain.find("sm_units"), std::string::npos) << plain;
      // (two forwards: the turn moves with the routing's forward count)
      for (int rep = 0; rep < 2; ++rep) {
        const GpuRun c = run_gpu(turned, x, T);
        const std::string tcfg = turned.config_for(T);
        EXPECT_EQ(0, std::memcmp(c.y.data(), b.y.data(), c.y.size() * 2))
            << "T = " << T << " programmatic_launch " << pdl << ": the turned unit table changes the bytes ("
            << tcfg << ")";
        EXPECT_EQ(
            tcfg.find(" sm_units") != std::string::npos,
            tcfg.find("pair_tiles") == std::string::npos && tcfg.find("decode_pairs") == std::string::npos)
            << "T = " << T << ": the table's token limit did not lift: " << tcfg;
      }
    }
  }
}

TEST_F(FusedMoe, RoutingBitsIndependentOfRouterTile) {
  // The router GEMM picks its tile shape from the token hint (decode, medium wide, medium,
  // prefill); every shape must give the same logits, so ids and weights match
  // bit for bit, for the F32 (three BF16 terms) and the BF16 router weight.
  // The odd shape's router slices are 72 columns: two steps each, the second zero-filled.
  MoeShape f32 = reduced_shape();
  MoeShape bf16 = reduced_shape();
  bf16.n_group = 8, bf16.topk_group = 4, bf16.router_dtype = RouterDtype::kBF16;
  MoeShape odd = odd_blocks_shape();
  MoeShape odd_bf16 = odd;
  odd_bf16.router_dtype = RouterDtype::kBF16;
  for (const auto& [s, T] : {std::pair{f32, 5}, std::pair{f32, 40}, std::pair{bf16, 5}, std::pair{bf16, 40},
                             std::pair{odd, 5}, std::pair{odd, 40}, std::pair{odd_bf16, 40}}) {
    const int Tmax = 2048;
    const TestCase tc = make_case(s, 41, T, Tmax);
    const HostMoeWeights& w = tc.w;
    const auto& x = tc.x;
    api::CudaMoeLayer& layer = *tc.layer;
    num::bf16_t* dx = nullptr;
    int* dT = nullptr;
    CK(cudaMalloc(&dx, x.size() * 2));
    CK(cudaMalloc(&dT, sizeof(int)));
    CK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dT, &T, sizeof(int), cudaMemcpyHostToDevice));
    std::vector<int32_t> ids0;
    std::vector<float> w0;
    for (int hint : {T, 256, 512, Tmax}) {
      layer.route(dx, hint, dT, nullptr);
      CK(cudaDeviceSynchronize());
      std::vector<int32_t> ids(size_t(T) * s.topk);
      std::vector<float> wts(ids.size());
      CK(cudaMemcpy(ids.data(), layer.topk_ids(), ids.size() * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(wts.data(), layer.topk_weights(), wts.size() * 4, cudaMemcpyDeviceToHost));
      if (ids0.empty()) {
        ids0 = ids, w0 = wts;
        std::vector<int32_t> ref_ids(ids.size());
        std::vector<float> ref_w(ids.size());
        ref::route(s, w.view(), x.data(), T, ref_ids.data(), ref_w.data());
        EXPECT_EQ(ids, ref_ids) << "routing ids differ from the CPU reference";
        continue;
      }
      EXPECT_EQ(ids, ids0) << "hint " << hint << " changes the routing ids";
      EXPECT_EQ(0, std::memcmp(wts.data(), w0.data(), wts.size() * 4))
          << "hint " << hint << " changes the weights";
    }
    cudaFree(dx);
    cudaFree(dT);
  }
}

TEST_F(FusedMoe, TooManyTokensIsAnError) {
  HostMoeWeights w = make_random_weights(reduced_shape(), 3);
  api::MoeLayerOptions opt;
  opt.max_tokens = 16;
  api::CudaMoeLayer layer(w, opt);
  EXPECT_THROW(layer.forward(nullptr, nullptr, 17, nullptr, nullptr), std::invalid_argument);
}

// Host or null pointers are an error before anything is launched (a kernel would fault
// and take the context with it); the layer works afterwards.
TEST_F(FusedMoe, HostPointersAreAnError) {
  const MoeShape s = reduced_shape();
  HostMoeWeights w = make_random_weights(s, 3);
  api::MoeLayerOptions opt;
  opt.max_tokens = 16;
  api::CudaMoeLayer layer(w, opt);
  const int T = 5;
  const auto x = random_x(size_t(T) * s.hidden, 4);
  std::vector<num::bf16_t> host_y(x.size());
  num::bf16_t *dx = nullptr, *dy = nullptr;
  CK(cudaMalloc(&dx, x.size() * 2));
  CK(cudaMalloc(&dy, x.size() * 2));
  CK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  const int host_count = T;
  auto expect_error = [&](auto&& call, const std::string& want) {
    try {
      call();
      ADD_FAILURE() << "no error; want '" << want << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  expect_error([&] { layer.forward(x.data(), dy, T, nullptr, nullptr); }, "forward x: pointer");
  expect_error([&] { layer.forward(dx, host_y.data(), T, nullptr, nullptr); }, "forward y: pointer");
  expect_error([&] { layer.forward(nullptr, dy, T, nullptr, nullptr); }, "forward x: null pointer");
  expect_error([&] { layer.forward(dx, dy, T, &host_count, nullptr); }, "forward num_tokens_dev: pointer");
  expect_error([&] { layer.route(x.data(), T, nullptr, nullptr); }, "route x: pointer");
  CK(cudaGetLastError());
  const GpuRun g = run_gpu(layer, x, T);
  for (num::bf16_t v : g.y) ASSERT_TRUE(std::isfinite(num::bf16_decode(v)));
  cudaFree(dx);
  cudaFree(dy);
}

// Two layers (different weights) on one caller-owned workspace, as every MoE layer of a
// model would share one: interleaved eager forwards and a graph of both give each layer's
// bytes with a workspace of its own.
TEST_F(FusedMoe, LayersShareOneWorkspace) {
  const MoeShape s = reduced_shape();
  const int T = 40, Tmax = 64;
  const auto x = random_x(size_t(T) * s.hidden, 53);
  HostMoeWeights wa = make_random_weights(s, 51), wb = make_random_weights(s, 52);
  api::MoeLayerOptions own;
  own.max_tokens = Tmax;
  std::vector<num::bf16_t> want_a, want_b;
  {
    api::CudaMoeLayer a(wa, own), b(wb, own);
    want_a = run_gpu(a, x, T).y;
    want_b = run_gpu(b, x, T).y;
  }
  const size_t need = api::CudaMoeLayer::workspace_bytes_for(s, Tmax);
  void* ws = nullptr;
  CK(cudaMalloc(&ws, need));
  CK(cudaMemset(ws, 0xFF, need));  // poison: the layers rely on nothing in it
  api::MoeLayerOptions shared = own;
  shared.workspace = ws, shared.workspace_bytes = need;
  api::CudaMoeLayer a(wa, shared), b(wb, shared);
  EXPECT_EQ(a.workspace_bytes(), need);
  for (int round = 0; round < 2; ++round) {
    EXPECT_EQ(run_gpu(a, x, T).y, want_a) << "layer A, round " << round;
    EXPECT_EQ(run_gpu(b, x, T).y, want_b) << "layer B, round " << round;
  }
  // Both layers in one graph, one after the other on the stream.
  const size_t n = x.size();
  num::bf16_t *dx = nullptr, *ya = nullptr, *yb = nullptr;
  CK(cudaMalloc(&dx, n * 2));
  CK(cudaMalloc(&ya, n * 2));
  CK(cudaMalloc(&yb, n * 2));
  CK(cudaMemcpy(dx, x.data(), n * 2, cudaMemcpyHostToDevice));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  a.forward(dx, ya, T, nullptr, st);
  b.forward(dx, yb, T, nullptr, st);
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  CK(cudaMemset(ya, 0xFF, n * 2));
  CK(cudaMemset(yb, 0xFF, n * 2));
  CK(cudaGraphLaunch(exec, st));
  CK(cudaStreamSynchronize(st));
  std::vector<num::bf16_t> got(n);
  CK(cudaMemcpy(got.data(), ya, n * 2, cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, want_a) << "graph, layer A";
  CK(cudaMemcpy(got.data(), yb, n * 2, cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, want_b) << "graph, layer B";
  ASSERT_NO_THROW(a.check());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
  cudaFree(dx);
  cudaFree(ya);
  cudaFree(yb);

  // A workspace too small, or in host memory, is refused.
  api::MoeLayerOptions small = shared;
  small.workspace_bytes = need - 1;
  EXPECT_THROW(api::CudaMoeLayer(wa, small), std::invalid_argument);
  std::vector<uint8_t> host(need);
  api::MoeLayerOptions on_host = own;
  on_host.workspace = host.data(), on_host.workspace_bytes = need;
  EXPECT_THROW(api::CudaMoeLayer(wa, on_host), std::invalid_argument);
  cudaFree(ws);
}

// Captures one forward of `layer` at `hint` tokens into a graph with the switches `capture`
// (for the capture only; `label` names them), replays it at each T of Ts with the count in
// device memory, and expects each replay's bytes (y poisoned first) to be an eager forward's
// at T under the defaults.
void expect_graph_replays_match(api::CudaMoeLayer& layer, const std::vector<num::bf16_t>& x, int hint,
                                const Overrides& capture, const std::string& label,
                                std::initializer_list<int> Ts) {
  const MoeShape& s = layer.shape();
  const size_t n = size_t(hint) * s.hidden;
  ASSERT_GE(x.size(), n);
  num::bf16_t *dx = nullptr, *dy = nullptr;
  int* dT = nullptr;
  CK(cudaMalloc(&dx, n * 2));
  CK(cudaMalloc(&dy, n * 2));
  CK(cudaMalloc(&dT, sizeof(int)));
  CK(cudaMemcpy(dx, x.data(), n * 2, cudaMemcpyHostToDevice));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  {
    const ScopedOverrides scoped(capture);
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    layer.forward(dx, dy, hint, dT, st);
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
  }
  for (int T : Ts) {
    CK(cudaMemcpy(dT, &T, sizeof(int), cudaMemcpyHostToDevice));
    CK(cudaMemset(dy, 0xFF, n * 2));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaStreamSynchronize(st));
    std::vector<num::bf16_t> yg(size_t(T) * s.hidden);
    CK(cudaMemcpy(yg.data(), dy, yg.size() * 2, cudaMemcpyDeviceToHost));
    std::vector<num::bf16_t> xt(x.begin(), x.begin() + size_t(T) * s.hidden);
    const GpuRun eager = run_gpu(layer, xt, T);
    EXPECT_EQ(0, std::memcmp(yg.data(), eager.y.data(), yg.size() * 2))
        << "graph captured at " << hint << " tokens, replayed at T=" << T << " (" << label << ")";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
  cudaFree(dx);
  cudaFree(dy);
  cudaFree(dT);
}

TEST_F(FusedMoe, GraphReplayWithDeviceTokenCount) {
  const MoeShape s = reduced_shape();
  HostMoeWeights w = make_random_weights(s, 31);
  // 320 tokens: the graph's router and fused kernel take their medium tiles, the eager
  // runs at 1 and 37 the decode ones; the bytes must agree (one float computation).
  const int Tmax = 320;
  const auto x = random_x(size_t(Tmax) * s.hidden, 32);
  api::MoeLayerOptions opt;
  opt.max_tokens = Tmax;
  api::CudaMoeLayer layer(w, opt);
  // Captured with route_topk and the fused kernel as programmatic dependents (the graph's
  // edges between them programmatic) and without.
  for (const bool pdl : {true, false}) {
    Overrides capture;
    capture.programmatic_launch = pdl;
    expect_graph_replays_match(layer, x, Tmax, capture, capture.describe(), {37, 320, 0, 1, 100, 257});
  }
}

// A device token count outside [0, tokens_hint] is a caller's bug: the kernels clamp it
// (the tokens up to the hint are computed as usual, no row past the hint is written, a
// negative count computes nothing) and check() reports it once.
TEST_F(FusedMoe, DeviceTokenCountOutOfRangeIsClampedAndReported) {
  const MoeShape s = reduced_shape();
  HostMoeWeights w = make_random_weights(s, 41);
  const int Tmax = 64, hint = 20;
  const auto x = random_x(size_t(Tmax) * s.hidden, 42);
  api::MoeLayerOptions opt;
  opt.max_tokens = Tmax;
  api::CudaMoeLayer layer(w, opt);
  std::vector<num::bf16_t> xh(x.begin(), x.begin() + size_t(hint) * s.hidden);
  const GpuRun want = run_gpu(layer, xh, hint);
  ASSERT_NO_THROW(layer.check());
  num::bf16_t *dx = nullptr, *dy = nullptr;
  int* dT = nullptr;
  CK(cudaMalloc(&dx, x.size() * 2));
  CK(cudaMalloc(&dy, x.size() * 2));
  CK(cudaMalloc(&dT, sizeof(int)));
  CK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  std::vector<num::bf16_t> y(x.size());
  for (int count : {37, Tmax + 1000, -5, hint}) {
    SCOPED_TRACE("device count " + std::to_string(count) + ", hint " + std::to_string(hint));
    CK(cudaMemcpy(dT, &count, sizeof(int), cudaMemcpyHostToDevice));
    CK(cudaMemset(dy, 0xFF, x.size() * 2));  // poison: bf16 NaN
    layer.forward(dx, dy, hint, dT, nullptr);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(y.data(), dy, y.size() * 2, cudaMemcpyDeviceToHost));
    const size_t done = count < 0 ? 0 : size_t(hint) * s.hidden;
    EXPECT_EQ(0, std::memcmp(y.data(), want.y.data(), done * 2)) << "the rows up to the hint";
    size_t written = 0;
    for (size_t i = done; i < y.size(); ++i) written += y[i] != 0xFFFF;
    EXPECT_EQ(written, 0u) << "outputs written past the clamped count";
    if (count == hint) {
      EXPECT_NO_THROW(layer.check());
      continue;
    }
    try {
      layer.check();
      ADD_FAILURE() << "check() did not report the count";
    } catch (const std::runtime_error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("last: " + std::to_string(count) + " with tokens_hint 20"), std::string::npos) << m;
    }
    EXPECT_NO_THROW(layer.check()) << "reported once, then cleared";
  }
  cudaFree(dx);
  cudaFree(dy);
  cudaFree(dT);
}

}  // namespace
}  // namespace megamoe
