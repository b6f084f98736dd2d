// Scalar formats (fp8.h) against hand-worked cases and an independent golden
// table (ml_dtypes, scripts/gen_e4m3_golden.py), and the host quantization
// loops of quant.h (docs/numerics.md §3, §4).
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "megamoe/numerics/act_quant.h"
#include "megamoe/numerics/fp8.h"
#include "megamoe/numerics/mma_model.h"
#include "megamoe/numerics/quant.h"

namespace mn = megamoe::num;

namespace {

float f(uint32_t bits) { return mn::bits_float(bits); }
float pow2(int k) { return std::ldexp(1.0f, k); }

// ---------------------------------------------------------------- E4M3 ----

TEST(E4M3, DecodeKnownValues) {
  EXPECT_EQ(mn::e4m3_decode(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(mn::e4m3_decode(0x80)));
  EXPECT_EQ(mn::e4m3_decode(0x38), 1.0f);
  EXPECT_EQ(mn::e4m3_decode(0x7E), 448.0f);
  EXPECT_EQ(mn::e4m3_decode(0xFE), -448.0f);
  EXPECT_EQ(mn::e4m3_decode(0x01), pow2(-9));         // smallest subnormal
  EXPECT_EQ(mn::e4m3_decode(0x07), 7.0f * pow2(-9));  // largest subnormal
  EXPECT_EQ(mn::e4m3_decode(0x08), pow2(-6));         // smallest normal
  EXPECT_EQ(mn::e4m3_decode(0x39), 1.125f);
}

TEST(E4M3, AllCodesRoundTrip) {
  for (int b = 0; b < 256; ++b) {
    const float v = mn::e4m3_decode(uint8_t(b));
    if ((b & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << "code " << b;
      // NOTE: the hardware cvt returns the canonical 0x7F for any NaN, so 0xFF
      // does not survive a round trip; it stays NaN.
      EXPECT_EQ(mn::e4m3_encode(v), mn::kE4M3NaN) << "code " << b;
    } else {
      EXPECT_FALSE(std::isnan(v)) << "code " << b;
      EXPECT_EQ(mn::e4m3_encode(v), b) << "code " << b << " value " << v;
    }
  }
}

TEST(E4M3, TiesToEven) {
  struct Case {
    float x;
    uint8_t want;
  };
  const Case cases[] = {
      // Subnormals (quantum 2^-9).
      {pow2(-10), 0x00},          // tie 0 | 2^-9     -> 0 (even)
      {3.0f * pow2(-10), 0x02},   // tie 1q | 2q     -> 2q
      {5.0f * pow2(-10), 0x02},   // tie 2q | 3q     -> 2q
      {7.0f * pow2(-10), 0x04},   // tie 3q | 4q     -> 4q
      {15.0f * pow2(-10), 0x08},  // tie 7q | 2^-6 (first normal) -> 0x08
      // Normals at several exponents.
      {1.0625f, 0x38},  // tie 1.0 | 1.125  -> 1.0
      {1.1875f, 0x3A},  // tie 1.125 | 1.25 -> 1.25
      {pow2(-6) * 1.0625f, 0x08},
      {pow2(-6) * 1.1875f, 0x0A},
      {17.0f, 0x58},   // tie 16 | 18 -> 16
      {19.0f, 0x5A},   // tie 18 | 20 -> 20
      {3.875f, 0x48},  // tie 3.75 | 4.0 -> 4.0 (carries into the exponent)
      {400.0f, 0x7C},  // tie 384 | 416 -> 384
      {432.0f, 0x7E},  // tie 416 | 448 -> 448
  };
  for (const auto& c : cases) {
    EXPECT_EQ(mn::e4m3_encode(c.x), c.want) << "x = " << c.x;
    EXPECT_EQ(mn::e4m3_encode(-c.x), c.want | 0x80) << "x = " << -c.x;
    // One float32 ulp off the tie decides it: away from zero rounds up.
    const float up = std::nextafter(c.x, INFINITY);
    const float down = std::nextafter(c.x, 0.0f);
    EXPECT_GT(mn::e4m3_decode(mn::e4m3_encode(up)), c.x) << "x = " << up;
    EXPECT_LT(mn::e4m3_decode(mn::e4m3_encode(down)), c.x) << "x = " << down;
  }
}

TEST(E4M3, Saturation) {
  const float xs[] = {448.0f, 449.0f, 463.99f, 464.0f,  std::nextafter(464.0f, INFINITY),
                      480.0f, 1e9f,   FLT_MAX, INFINITY};
  for (float x : xs) {
    EXPECT_EQ(mn::e4m3_encode(x), 0x7E) << "x = " << x;
    EXPECT_EQ(mn::e4m3_encode(-x), 0xFE) << "x = " << -x;
  }
  // Just below the 416 | 448 tie: the step below the max.
  EXPECT_EQ(mn::e4m3_encode(431.99f), 0x7D);
}

TEST(E4M3, NaN) {
  const uint32_t nans[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0xFFFFFFFFu};
  for (uint32_t n : nans) EXPECT_EQ(mn::e4m3_encode(f(n)), 0x7F) << std::hex << n;
  EXPECT_TRUE(std::isnan(mn::e4m3_decode(0x7F)));
  EXPECT_TRUE(std::isnan(mn::e4m3_decode(0xFF)));
  // Signed zero and float32 subnormals keep their sign and flush to zero.
  EXPECT_EQ(mn::e4m3_encode(-0.0f), 0x80);
  EXPECT_EQ(mn::e4m3_encode(f(0x00000001u)), 0x00);
  EXPECT_EQ(mn::e4m3_encode(f(0x80000001u)), 0x80);
}

// The golden table holds bytes from ml_dtypes (an implementation that shares no
// code with ours), adjusted to the satfinite contract; see the script's doc.
TEST(E4M3, GoldenTable) {
  const std::string path = std::string(MEGAMOE_TEST_DATA) + "/e4m3_golden.txt";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "cannot open " << path << " (run scripts/gen_e4m3_golden.py)";
  int n_enc = 0, n_dec = 0, bad = 0;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    char kind = 0;
    uint32_t a = 0, b = 0;
    ls >> kind >> std::hex >> a >> b;
    ASSERT_FALSE(ls.fail()) << "bad line: " << line;
    if (kind == 'E') {
      ++n_enc;
      const int got = mn::e4m3_encode(f(a));
      if (got != int(b) && ++bad <= 10)
        ADD_FAILURE() << "encode(" << f(a) << " = 0x" << std::hex << a << ") = 0x" << got << ", want 0x" << b;
    } else if (kind == 'D') {
      ++n_dec;
      const float got = mn::e4m3_decode(uint8_t(a));
      const bool ok = std::isnan(f(b)) ? std::isnan(got) : mn::float_bits(got) == b;
      if (!ok && ++bad <= 10)
        ADD_FAILURE() << "decode(0x" << std::hex << a << ") = " << got << ", want 0x" << b;
    } else {
      FAIL() << "bad line: " << line;
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(n_dec, 256);
  EXPECT_GT(n_enc, 2000);  // not vacuous
}

// ---------------------------------------------------------------- BF16 ----

TEST(BF16, EncodeRoundsToNearestEven) {
  EXPECT_EQ(mn::bf16_encode(1.0f), 0x3F80);
  EXPECT_EQ(mn::bf16_encode(f(0x3F808000u)), 0x3F80);  // tie, even below
  EXPECT_EQ(mn::bf16_encode(f(0x3F818000u)), 0x3F82);  // tie, even above
  EXPECT_EQ(mn::bf16_encode(f(0x3F808001u)), 0x3F81);  // above the tie
  EXPECT_EQ(mn::bf16_encode(f(0x3F807FFFu)), 0x3F80);  // below the tie
  EXPECT_EQ(mn::bf16_encode(f(0xBF818000u)), 0xBF82);  // negative tie
  EXPECT_EQ(mn::bf16_encode(FLT_MAX), 0x7F80);         // rounds past the max: inf
  EXPECT_EQ(mn::bf16_encode(-INFINITY), 0xFF80);
  EXPECT_EQ(mn::bf16_encode(f(0x00008000u)), 0x0000);  // subnormal tie to even (zero)
  EXPECT_EQ(mn::bf16_encode(f(0x00018000u)), 0x0002);
}

TEST(BF16, AllValuesRoundTrip) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float v = mn::bf16_decode(mn::bf16_t(h));
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(mn::bf16_decode(mn::bf16_encode(v)))) << h;
    } else {
      ASSERT_EQ(mn::bf16_encode(v), h) << h;
    }
  }
}

TEST(BF16, NaNStaysNaN) {
  // Payloads only in the low 16 bits must not truncate to infinity.
  const uint32_t nans[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7F80FFFFu, 0x7FFFFFFFu};
  for (uint32_t n : nans) {
    const mn::bf16_t h = mn::bf16_encode(f(n));
    EXPECT_TRUE(std::isnan(mn::bf16_decode(h))) << std::hex << n << " -> " << h;
    EXPECT_EQ(h & 0x8000, (n >> 16) & 0x8000) << std::hex << n;
  }
}

// ------------------------------------------------------- quantize_rows ----

std::vector<float> random_normal(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

TEST(NumericsQuantizeRows, ScaleFormulaAndBytes) {
  const int rows = 3, cols = 256, group = 128;
  auto x = random_normal(size_t(rows) * cols, 1);
  x[5] = -7.5f;  // a known amax in row 0, group 0
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(size_t(rows) * 2);
  mn::quantize_rows(x.data(), rows, cols, group, q.data(), s.data());
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < 2; ++g) {
      float amax = 0.0f;
      for (int c = g * group; c < (g + 1) * group; ++c) amax = std::max(amax, std::fabs(x[r * cols + c]));
      const float want = std::max(amax, 1e-4f) / 448.0f;
      ASSERT_EQ(mn::float_bits(s[r * 2 + g]), mn::float_bits(want)) << r << "," << g;
      for (int c = g * group; c < (g + 1) * group; ++c)
        ASSERT_EQ(q[r * cols + c], mn::e4m3_encode(x[r * cols + c] * (1.0f / want))) << r << "," << c;
    }
  EXPECT_EQ(s[0], 7.5f / 448.0f);
  EXPECT_EQ(q[5], 0xFE);  // the amax element lands on -448
}

TEST(NumericsQuantizeRows, PartialLastGroup) {
  const int rows = 2, cols = 300, group = 128;  // groups of 128, 128, 44
  auto x = random_normal(size_t(rows) * cols, 2);
  x[1 * cols + 299] = 100.0f;  // only the partial group of row 1 sees it
  x[1 * cols + 255] = 0.5f;
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(size_t(rows) * 3);
  mn::quantize_rows(x.data(), rows, cols, group, q.data(), s.data());
  EXPECT_EQ(s[1 * 3 + 2], 100.0f / 448.0f);
  EXPECT_LT(s[1 * 3 + 1], 100.0f / 448.0f);
  float amax = 0.0f;
  for (int c = 256; c < 300; ++c) amax = std::max(amax, std::fabs(x[c]));
  EXPECT_EQ(s[2], amax / 448.0f);
  EXPECT_EQ(q[1 * cols + 299], 0x7E);
}

TEST(NumericsQuantizeRows, AllZeroRowUsesTheFloor) {
  const int cols = 160;
  std::vector<float> x(size_t(2) * cols, 0.0f);
  x[cols] = -0.0f;
  std::vector<uint8_t> q(x.size(), 0xAA);
  std::vector<float> s(4);
  mn::quantize_rows(x.data(), 2, cols, mn::kActGroup, q.data(), s.data());
  for (float v : s) EXPECT_EQ(v, 1e-4f / 448.0f);
  for (int c = 0; c < 2 * cols; ++c) EXPECT_EQ(q[c] & 0x7F, 0) << c;
}

TEST(NumericsQuantizeRows, Bf16MatchesFloatOnTheSameValues) {
  const int rows = 4, cols = 192, group = mn::kInterGroup;
  auto xf = random_normal(size_t(rows) * cols, 3, 3.0f);
  std::vector<mn::bf16_t> xb(xf.size());
  for (size_t i = 0; i < xf.size(); ++i) {
    xb[i] = mn::bf16_encode(xf[i]);
    xf[i] = mn::bf16_decode(xb[i]);
  }
  std::vector<uint8_t> qf(xf.size()), qb(xf.size());
  std::vector<float> sf(size_t(rows) * 3), sb(sf.size());
  mn::quantize_rows(xf.data(), rows, cols, group, qf.data(), sf.data());
  mn::quantize_rows(xb.data(), rows, cols, group, qb.data(), sb.data());
  EXPECT_EQ(qf, qb);
  EXPECT_EQ(sf, sb);
}

TEST(NumericsQuantizeRows, RejectsBadGroup) {
  float x = 1.0f;
  uint8_t q;
  float s;
  EXPECT_THROW(mn::quantize_rows(&x, 1, 1, 0, &q, &s), std::invalid_argument);
}

// ------------------------------------------------------- dequant_block ----

TEST(NumericsDequantBlock, EdgeBlocksAndScaleGrid) {
  const int rows = 200, cols = 300;  // grid 2 x 3, the last row/column of blocks partial
  std::mt19937 rng(4);
  std::vector<uint8_t> q(size_t(rows) * cols);
  for (auto& b : q) {
    b = uint8_t(rng());
    if ((b & 0x7F) == 0x7F) b = 0x3F;
  }
  const float scale[6] = {0.5f, 1.0f / 3.0f, 2.0f, 1e-3f, 7.0f, 0.0625f};
  std::vector<float> out(q.size());
  mn::dequant_block(q.data(), scale, rows, cols, out.data());
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      ASSERT_EQ(out[r * cols + c], mn::e4m3_decode(q[r * cols + c]) * scale[(r / 128) * 3 + c / 128])
          << r << "," << c;
}

// --------------------------------------------------------------- MXFP8 ----

TEST(NumericsMxfp8, Ue8m0RoundUp) {
  EXPECT_EQ(mn::ue8m0_round_up(1.0f), 127);
  EXPECT_EQ(mn::ue8m0_round_up(std::nextafter(1.0f, 2.0f)), 128);
  EXPECT_EQ(mn::ue8m0_round_up(1.5f), 128);
  EXPECT_EQ(mn::ue8m0_round_up(2.0f), 128);
  EXPECT_EQ(mn::ue8m0_round_up(0.75f), 127);
  EXPECT_EQ(mn::ue8m0_round_up(pow2(-126)), 1);
  EXPECT_EQ(mn::ue8m0_round_up(0.0f), 1);  // clamped up from 0
  EXPECT_EQ(mn::ue8m0_round_up(f(0x00000001u)), 1);
  EXPECT_EQ(mn::ue8m0_round_up(pow2(127)), 254);
  EXPECT_EQ(mn::ue8m0_round_up(FLT_MAX), 254);  // clamped down from 255
  EXPECT_EQ(mn::ue8m0_round_up(INFINITY), 254);
  EXPECT_EQ(mn::ue8m0_to_float(127), 1.0f);
  EXPECT_EQ(mn::ue8m0_to_float(1), pow2(-126));
  EXPECT_EQ(mn::ue8m0_to_float(254), pow2(127));
  // Always the smallest power of two >= s.
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> e(-100.0f, 100.0f);
  for (int i = 0; i < 10000; ++i) {
    const float s = std::exp2(e(rng));
    const float p = mn::ue8m0_to_float(mn::ue8m0_round_up(s));
    ASSERT_GE(p, s);
    ASSERT_LT(p, 2.0f * s);
  }
}

TEST(NumericsMxfp8, QuantizeMatchesTheRule) {
  const int rows = 3, cols = 80;  // groups 32, 32, 16 (partial)
  auto x = random_normal(size_t(rows) * cols, 6, 0.7f);
  for (int c = 0; c < 32; ++c) x[c] = 0.0f;  // an all-zero group: 1e-4/448 rounded up
  std::vector<uint8_t> q(x.size()), sf(size_t(rows) * 3);
  mn::quantize_mxfp8(x.data(), rows, cols, q.data(), sf.data());
  EXPECT_EQ(sf[0], mn::ue8m0_round_up(1e-4f / 448.0f));
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < 3; ++g) {
      float amax = 0.0f;
      const int c1 = std::min(cols, (g + 1) * 32);
      for (int c = g * 32; c < c1; ++c) amax = std::max(amax, std::fabs(x[r * cols + c]));
      const uint8_t b = sf[r * 3 + g];
      ASSERT_EQ(b, mn::ue8m0_round_up(std::max(amax, 1e-4f) / 448.0f));
      const float scale = mn::ue8m0_to_float(b);
      for (int c = g * 32; c < c1; ++c) {
        const float v = x[r * cols + c];
        ASSERT_EQ(q[r * cols + c], mn::e4m3_encode(v / scale)) << r << "," << c;
        // The power-of-two scale is >= the exact one: nothing saturates, so the
        // error is E4M3 rounding only (half a step: 2^-4 relative, or 2^-10 absolute
        // in the subnormal range of the scaled value).
        const float back = mn::e4m3_decode(q[r * cols + c]) * scale;
        ASSERT_LE(std::fabs(back - v), std::max(std::fabs(v) * 0.0625f, pow2(-10) * scale)) << r << "," << c;
      }
    }
}

// ------------------------------------------------- tensor-core model ----
// Hand-worked k-steps of num::fp8_mma_step (the GPU test checks the model against
// the hardware itself).

TEST(MmaModel, ExactWhenNothingFallsBelowTheAlignment) {
  const uint8_t a[3] = {mn::e4m3_encode(1.5f), mn::e4m3_encode(-2.0f), mn::e4m3_encode(0.25f)};
  const uint8_t b[3] = {mn::e4m3_encode(3.0f), mn::e4m3_encode(0.75f), mn::e4m3_encode(-8.0f)};
  EXPECT_EQ(mn::fp8_mma_step(0.0f, a, b, 3), 4.5f - 1.5f - 2.0f);
  EXPECT_EQ(mn::fp8_mma_step(0.5f, a, b, 3), 1.5f);
}

TEST(MmaModel, TermsBelowTheAlignmentAreTruncatedTowardZero) {
  // Largest product 1 (exponent 0): terms are multiples of 2^-13.
  const uint8_t one = mn::e4m3_encode(1.0f);
  const uint8_t a[2] = {one, mn::e4m3_encode(pow2(-7))};  // 2^-7 is subnormal in E4M3
  const uint8_t b[2] = {one, mn::e4m3_encode(pow2(-7))};
  EXPECT_EQ(mn::fp8_mma_step(0.0f, a, b, 2), 1.0f);  // + 2^-14 dropped (a float keeps it)
  const uint8_t bn[2] = {one, mn::e4m3_encode(-pow2(-7))};
  EXPECT_EQ(mn::fp8_mma_step(0.0f, a, bn, 2), 1.0f);  // - 2^-14 dropped: toward zero, not down
  // The accumulator is truncated the same way.
  EXPECT_EQ(mn::fp8_mma_step(1.0f + pow2(-20), a, b, 1), 2.0f);
}

TEST(MmaModel, TheSumKeepsFourteenSignificantBits) {
  // 1 + 1 + 2^-13 = 16385 units of 2^-13: 15 bits, the last one dropped.
  const uint8_t one = mn::e4m3_encode(1.0f);
  const uint8_t a[3] = {one, one, mn::e4m3_encode(pow2(-9))};
  const uint8_t b[3] = {one, one, mn::e4m3_encode(pow2(-4))};
  EXPECT_EQ(mn::fp8_mma_step(0.0f, a, b, 3), 2.0f);
  EXPECT_EQ(mn::fp8_mma_step(0.0f, a + 1, b + 1, 2), 1.0f + pow2(-13));  // 14 bits: kept
}

TEST(MmaModel, ZerosAndNaN) {
  const uint8_t z[2] = {0x00, 0x80}, big[2] = {mn::e4m3_encode(448.0f), mn::e4m3_encode(-448.0f)};
  EXPECT_EQ(mn::fp8_mma_step(0.0f, z, big, 2), 0.0f);
  EXPECT_EQ(mn::fp8_mma_step(3.0f, z, big, 2), 3.0f);
  const uint8_t nan[2] = {0x00, mn::kE4M3NaN};
  EXPECT_TRUE(std::isnan(mn::fp8_mma_step(0.0f, nan, z, 2)));  // NaN x 0
  EXPECT_TRUE(std::isnan(mn::fp8_mma_step(NAN, z, z, 2)));
}

TEST(MmaModel, ChainFoldsStepsOfThirtyTwo) {
  // 64 products of 1: two steps, exact (64 < 2^14 units of the first step).
  std::vector<uint8_t> ones(64, mn::e4m3_encode(1.0f));
  EXPECT_EQ(mn::fp8_mma_chain(ones.data(), ones.data(), 64), 64.0f);
  EXPECT_EQ(mn::fp8_mma_chain(ones.data(), ones.data(), 40), 40.0f);
}

// ------------------------------------------------------------ exp_fma ----

TEST(ExpFma, WithinTwoUlpOfExp) {
  // Every 64th float of [-86, 88] (both signs, all binades), against exp in double.
  int worst = 0;
  float worst_x = 0;
  auto check = [&](float x) {
    const float got = mn::exp_fma(x);
    const double want = std::exp(double(x));
    const float wf = float(want);
    const int ulps = std::abs(int(mn::float_bits(got)) - int(mn::float_bits(wf)));
    if (ulps > worst) worst = ulps, worst_x = x;
  };
  for (uint32_t b = 0; b <= 0x42B00000u; b += 64) check(mn::bits_float(b));            // [0, 88]
  for (uint32_t b = 0x80000000u; b <= 0xC2AC0000u; b += 64) check(mn::bits_float(b));  // [-86, -0]
  std::printf("exp_fma: at most %d ulp from exp (at x = %g)\n", worst, worst_x);
  EXPECT_LE(worst, 2) << "at x = " << worst_x;
  EXPECT_EQ(mn::exp_fma(0.0f), 1.0f);
  EXPECT_EQ(mn::exp_fma(-200.0f), mn::exp_fma(-86.0f));  // clamped
  EXPECT_EQ(mn::exp_fma(INFINITY), mn::exp_fma(88.0f));
  EXPECT_GT(mn::exp_fma(-86.0f), 0.0f);
  EXPECT_TRUE(std::isfinite(mn::exp_fma(88.0f)));
  EXPECT_TRUE(std::isnan(mn::exp_fma(NAN)));
}

}  // namespace
