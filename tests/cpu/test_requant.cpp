// Requantization 128x128 block FP8 -> MXFP8 (docs/numerics.md §5): exact with power-of-two
// scales, a few percent of relative L2 otherwise, the shape check, and the
// once-per-process warning the loader uses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "megamoe/numerics/fp8.h"
#include "megamoe/numerics/quant.h"

namespace mn = megamoe::num;

namespace {

struct BlockTensor {
  int rows = 0, cols = 0;
  std::vector<uint8_t> q;
  std::vector<float> scale_inv;  // [ceil(rows/128)][ceil(cols/128)]
  int brows() const { return (rows + 127) / 128; }
  int bcols() const { return (cols + 127) / 128; }
};

// Random codes (every finite code, zeros and subnormals included) under
// power-of-two scales 2^[-14, -2].
BlockTensor random_pow2(int rows, int cols, uint32_t seed) {
  BlockTensor t{rows, cols, {}, {}};
  std::mt19937 rng(seed);
  t.q.resize(size_t(rows) * cols);
  for (auto& b : t.q) {
    b = uint8_t(rng());
    if ((b & 0x7F) == 0x7F) b ^= 0x01;  // no NaN codes
  }
  t.scale_inv.resize(size_t(t.brows()) * t.bcols());
  for (auto& s : t.scale_inv) s = std::ldexp(1.0f, -14 + int(rng() % 13));
  return t;
}

// What a checkpoint holds: normal weights, each 128x128 block quantized with
// scale = amax / 448 (not a power of two).
BlockTensor realistic(int rows, int cols, uint32_t seed) {
  BlockTensor t{rows, cols, {}, {}};
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<float> w(size_t(rows) * cols);
  for (auto& v : w) v = d(rng);
  t.q.resize(w.size());
  t.scale_inv.resize(size_t(t.brows()) * t.bcols());
  for (int br = 0; br < t.brows(); ++br)
    for (int bc = 0; bc < t.bcols(); ++bc) {
      float amax = 0.0f;
      for (int r = br * 128; r < std::min(rows, br * 128 + 128); ++r)
        for (int c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c)
          amax = std::max(amax, std::fabs(w[size_t(r) * cols + c]));
      const float s = amax / 448.0f;
      t.scale_inv[size_t(br) * t.bcols() + bc] = s;
      for (int r = br * 128; r < std::min(rows, br * 128 + 128); ++r)
        for (int c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c)
          t.q[size_t(r) * cols + c] = mn::e4m3_encode(w[size_t(r) * cols + c] / s);
    }
  return t;
}

struct Mx {
  std::vector<uint8_t> q, sf;
  mn::RequantReport rep;
};

Mx requant(const BlockTensor& t) {
  Mx m;
  m.q.resize(t.q.size());
  m.sf.resize(size_t(t.rows) * (t.cols / 32));
  m.rep = mn::requant_block_to_mxfp8(t.q.data(), t.scale_inv.data(), t.rows, t.cols, m.q.data(), m.sf.data());
  return m;
}

std::vector<float> dequant_mx(const Mx& m, int rows, int cols) {
  std::vector<float> out(size_t(rows) * cols);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      out[size_t(r) * cols + c] = mn::e4m3_decode(m.q[size_t(r) * cols + c]) *
                                  mn::ue8m0_to_float(m.sf[size_t(r) * (cols / 32) + c / 32]);
  return out;
}

std::vector<float> dequant_blk(const BlockTensor& t) {
  std::vector<float> out(t.q.size());
  mn::dequant_block(t.q.data(), t.scale_inv.data(), t.rows, t.cols, out.data());
  return out;
}

TEST(Requant, BitExactWithPow2Scales) {
  // 200 x 320: partial 128-blocks in both directions (grid 2 x 3).
  for (auto [rows, cols] : {std::pair{256, 384}, std::pair{200, 320}}) {
    auto t = random_pow2(rows, cols, 11);
    // A whole zero row and a zero group exercise the 1e-30 amax floor.
    for (int c = 0; c < cols; ++c) t.q[size_t(7) * cols + c] = 0x00;
    for (int c = 64; c < 96; ++c) t.q[size_t(9) * cols + c] = 0x80;
    const Mx m = requant(t);
    const auto want = dequant_blk(t);
    const auto got = dequant_mx(m, rows, cols);
    int bad = 0;
    for (size_t i = 0; i < want.size(); ++i)
      if (mn::float_bits(got[i]) != mn::float_bits(want[i]) && ++bad <= 5)
        ADD_FAILURE() << "[" << i / cols << ", " << i % cols << "] mx " << got[i] << " blk " << want[i];
    EXPECT_EQ(bad, 0);
    EXPECT_TRUE(m.rep.all_pow2);
    EXPECT_EQ(m.rep.rel_l2, 0.0);
    EXPECT_EQ(m.rep.max_abs_err, 0.0);
    EXPECT_EQ(m.rep.elements, int64_t(rows) * cols);
  }
}

TEST(Requant, NonPow2ScalesCostAFewPercent) {
  const int rows = 384, cols = 512;
  auto t = realistic(rows, cols, 12);
  const Mx m = requant(t);
  EXPECT_FALSE(m.rep.all_pow2);
  EXPECT_GT(m.rep.rel_l2, 0.005);
  EXPECT_LT(m.rep.rel_l2, 0.06);
  // The report is what it says: recompute it from the two dequantized tensors.
  const auto blk = dequant_blk(t);
  const auto mx = dequant_mx(m, rows, cols);
  double e2 = 0, r2 = 0, emax = 0;
  for (size_t i = 0; i < blk.size(); ++i) {
    const double d = double(mx[i]) - double(blk[i]);
    e2 += d * d;
    r2 += double(blk[i]) * blk[i];
    emax = std::max(emax, std::fabs(d));
  }
  EXPECT_NEAR(m.rep.rel_l2, std::sqrt(e2 / r2), 1e-12);
  EXPECT_EQ(m.rep.max_abs_err, emax);
  RecordProperty("rel_l2", std::to_string(m.rep.rel_l2));
  std::printf("[ info ] requant rel_l2 %.3f%% max_abs_err %.3g (non-pow2 scales, %d x %d)\n",
              m.rep.rel_l2 * 100, m.rep.max_abs_err, rows, cols);
}

// Each group follows docs/numerics.md §5 step by step, written out here independently.
TEST(Requant, FollowsTheSpecFormula) {
  const int rows = 130, cols = 256;
  auto t = realistic(rows, cols, 13);
  const Mx m = requant(t);
  const auto real = dequant_blk(t);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < cols / 32; ++g) {
      float amax = 0.0f;
      for (int c = g * 32; c < g * 32 + 32; ++c) amax = std::max(amax, std::fabs(real[size_t(r) * cols + c]));
      amax = std::max(amax, 1e-30f);
      const float sf = std::exp2f(std::ceil(std::log2f(amax / 448.0f)));
      ASSERT_EQ(m.sf[size_t(r) * (cols / 32) + g], mn::float_bits(sf) >> 23) << r << "," << g;
      for (int c = g * 32; c < g * 32 + 32; ++c)
        ASSERT_EQ(m.q[size_t(r) * cols + c], mn::e4m3_encode(real[size_t(r) * cols + c] / sf))
            << r << "," << c;
    }
}

// log2 of the quotient, not the exponent bits: amax / 448 = 2^-20 * (1 + 2^-23)
// has log2 = -20 + 1.7e-7, which float32 rounds to exactly -20, so the scale is
// 2^-20 (byte 107) and the value saturates to 448; an exponent-bits ceil would
// give 2^-19 (byte 108).
TEST(Requant, ScaleIsLog2OfTheQuotient) {
  const float s = mn::bits_float(0x35800001u);  // 2^-20 * (1 + 2^-23)
  ASSERT_EQ(448.0f * s / 448.0f, s);
  std::vector<uint8_t> q(32, 0x00), qo(32), sf(1);
  q[3] = 0x7E;  // 448
  const auto rep = mn::requant_block_to_mxfp8(q.data(), &s, 1, 32, qo.data(), sf.data());
  EXPECT_EQ(sf[0], 107);
  EXPECT_EQ(qo[3], 0x7E);
  EXPECT_FALSE(rep.all_pow2);
  EXPECT_GT(rep.max_abs_err, 0.0);
  EXPECT_LT(rep.rel_l2, 1e-6);
}

TEST(Requant, ColsMustBeAMultipleOf32) {
  std::vector<uint8_t> q(4 * 100), qo(q.size()), sf(16);
  const float s = 1.0f;
  try {
    mn::requant_block_to_mxfp8(q.data(), &s, 4, 100, qo.data(), sf.data());
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[4, 100]"), std::string::npos) << e.what();
  }
}

TEST(Requant, NonFiniteSourceIsAnError) {
  std::vector<uint8_t> q(32, 0x38), qo(32), sf(1);
  const float inf = INFINITY, one = 1.0f;
  EXPECT_THROW(mn::requant_block_to_mxfp8(q.data(), &inf, 1, 32, qo.data(), sf.data()), std::domain_error);
  q[5] = 0x7F;  // a NaN code in the checkpoint
  EXPECT_THROW(mn::requant_block_to_mxfp8(q.data(), &one, 1, 32, qo.data(), sf.data()), std::domain_error);
}

TEST(Requant, SlabReportsCombine) {
  const int rows = 384, cols = 256;
  auto t = realistic(rows, cols, 14);
  const Mx whole = requant(t);
  mn::RequantReport sum;
  std::vector<uint8_t> qo(t.q.size()), sf(size_t(rows) * cols / 32);
  for (int r0 = 0; r0 < rows; r0 += 128) {
    const float* s = t.scale_inv.data() + size_t(r0 / 128) * t.bcols();
    sum += mn::requant_block_to_mxfp8(t.q.data() + size_t(r0) * cols, s, 128, cols,
                                      qo.data() + size_t(r0) * cols, sf.data() + size_t(r0) * cols / 32);
  }
  EXPECT_EQ(qo, whole.q);
  EXPECT_EQ(sf, whole.sf);
  EXPECT_NEAR(sum.rel_l2, whole.rep.rel_l2, 1e-12);
  EXPECT_EQ(sum.max_abs_err, whole.rep.max_abs_err);
  EXPECT_EQ(sum.elements, whole.rep.elements);
  EXPECT_EQ(sum.all_pow2, whole.rep.all_pow2);
}

TEST(Requant, IsPow2Scale) {
  for (float s : {1.0f, 0.5f, 2.0f, std::ldexp(1.0f, -126), std::ldexp(1.0f, -140), std::ldexp(1.0f, 127)})
    EXPECT_TRUE(mn::is_pow2_scale(s)) << s;
  for (float s : {0.0f, -0.0f, -1.0f, 3.0f, 0.75f, 1.0f / 448.0f, INFINITY, NAN, std::ldexp(3.0f, -140)})
    EXPECT_FALSE(mn::is_pow2_scale(s)) << s;
}

TEST(Requant, WarnsOncePerProcess) {
  mn::test_hooks::reset_warn_once();
  ::testing::internal::CaptureStderr();
  const bool first = mn::warn_non_pow2_once("layer 3 experts", 0.0241);
  const bool second = mn::warn_non_pow2_once("layer 4 experts", 0.0300);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(first);
  EXPECT_FALSE(second);
  EXPECT_NE(err.find("layer 3 experts"), std::string::npos) << err;
  EXPECT_NE(err.find("2.410%"), std::string::npos) << err;
  EXPECT_EQ(err.find("layer 4"), std::string::npos) << err;
  EXPECT_EQ(err.find("warning"), err.rfind("warning")) << err;  // exactly one line
  mn::test_hooks::reset_warn_once();
}

}  // namespace
