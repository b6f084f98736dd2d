// The block-FP8 weight quantizer (num::quantize_block_fp8) against the rule as
// docs/numerics.md §2-3 states it, computed directly here: per 128x128 block
// s = amax / 448 in float32 (1 for an all-zero block), code = the E4M3 value nearest to
// w / s (ties to the even code, saturating at ±448). Exact: every code and scale.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "megamoe/numerics/quant.h"

namespace mn = megamoe::num;

namespace {

// E4M3 magnitude of code b (0..126) from its fields: bias 7, subnormals at exponent 0.
double e4m3_magnitude(int b) {
  const int e = (b >> 3) & 15, m = b & 7;
  return e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
}

// The nearest E4M3 code by search over every finite magnitude; ties go to the even code
// (the even mantissa); beyond 448 saturates to 448.
uint8_t nearest_e4m3(float v) {
  const double a = std::fabs(double(v));
  int best = 0;
  for (int b = 1; b <= 126; ++b) {
    const double d = std::fabs(e4m3_magnitude(b) - a), db = std::fabs(e4m3_magnitude(best) - a);
    if (d < db || (d == db && b % 2 == 0)) best = b;
  }
  return uint8_t(best | (std::signbit(v) ? 0x80 : 0));
}

struct Expected {
  std::vector<uint8_t> q;
  std::vector<float> s;
};

Expected reference(const std::vector<float>& w, int batch, int rows, int cols) {
  const int br = (rows + 127) / 128, bc = (cols + 127) / 128;
  Expected out{std::vector<uint8_t>(w.size()), std::vector<float>(size_t(batch) * br * bc)};
  for (int b = 0; b < batch; ++b)
    for (int i = 0; i < br; ++i)
      for (int k = 0; k < bc; ++k) {
        float amax = 0.0f;
        for (int r = i * 128; r < std::min(rows, i * 128 + 128); ++r)
          for (int c = k * 128; c < std::min(cols, k * 128 + 128); ++c)
            amax = std::max(amax, std::fabs(w[(size_t(b) * rows + r) * cols + c]));
        const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
        out.s[(size_t(b) * br + i) * bc + k] = s;
        for (int r = i * 128; r < std::min(rows, i * 128 + 128); ++r)
          for (int c = k * 128; c < std::min(cols, k * 128 + 128); ++c) {
            const size_t at = (size_t(b) * rows + r) * cols + c;
            out.q[at] = nearest_e4m3(w[at] / s);
          }
      }
  return out;
}

TEST(QuantizeBlockFp8, MatchesTheRuleExactly) {
  // Partial edge blocks on both axes, two matrices, a magnitude per block spanning many
  // binades, an all-zero block, and a block whose scale is exactly 1 holding E4M3
  // midpoints (the ties) and a negative zero.
  const int batch = 2, rows = 300, cols = 200;
  std::vector<float> w(size_t(batch) * rows * cols);
  std::mt19937_64 rng(20261207);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_mag(-20.0f, 12.0f);
  const int br = 3, bc = 2;
  for (int b = 0; b < batch; ++b)
    for (int i = 0; i < br; ++i)
      for (int k = 0; k < bc; ++k) {
        const float mag = std::exp2(log_mag(rng));
        for (int r = i * 128; r < std::min(rows, i * 128 + 128); ++r)
          for (int c = k * 128; c < std::min(cols, k * 128 + 128); ++c)
            w[(size_t(b) * rows + r) * cols + c] = normal(rng) * mag;
      }
  // matrix 1, block (1, 0): all zero (scale 1, codes 0)
  for (int r = 128; r < 256; ++r)
    for (int c = 0; c < 128; ++c) w[(size_t(rows) + r) * cols + c] = 0.0f;
  // matrix 0, block (0, 1): amax 448 (scale exactly 1), then every midpoint of two
  // neighbouring magnitudes, both signs
  float* tie = w.data();
  for (int r = 0; r < 128; ++r)
    for (int c = 128; c < cols; ++c) tie[r * cols + c] = 0.25f;
  tie[128] = 448.0f;
  tie[129] = -0.0f;
  int n = 130;
  for (int b = 0; b < 126; ++b) {
    const float mid = float((e4m3_magnitude(b) + e4m3_magnitude(b + 1)) / 2);
    tie[(n / 72) * cols + 128 + n % 72] = mid, ++n;
    tie[(n / 72) * cols + 128 + n % 72] = -mid, ++n;
  }

  std::vector<uint8_t> q(w.size(), 0xAB);
  std::vector<float> s(size_t(batch) * br * bc, std::numeric_limits<float>::quiet_NaN());
  mn::quantize_block_fp8(w.data(), batch, rows, cols, q.data(), s.data());
  const Expected want = reference(w, batch, rows, cols);
  ASSERT_EQ(want.s[1], 1.0f);  // the tie block's scale is exactly 1
  for (size_t i = 0; i < s.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(s[i]), std::bit_cast<uint32_t>(want.s[i])) << "scale " << i;
  for (size_t i = 0; i < q.size(); ++i)
    ASSERT_EQ(int(q[i]), int(want.q[i])) << "w[" << i << "] = " << w[i] << " scale ";
  EXPECT_EQ(q[129], 0x80);  // -0 keeps its sign
}

TEST(QuantizeBlockFp8, RefusesNonFiniteValuesByPosition) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> w(2 * 130 * 140, 0.5f);
    w[size_t(130 * 140) + 129 * 140 + 131] = bad;  // matrix 1, row 129, column 131
    std::vector<uint8_t> q(w.size());
    std::vector<float> s(2 * 2 * 2);
    try {
      mn::quantize_block_fp8(w.data(), 2, 130, 140, q.data(), s.data());
      ADD_FAILURE() << "no throw for " << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("w[1][129][131]"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("finite"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
