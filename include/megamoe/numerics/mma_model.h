// The Hopper FP8 tensor cores' accumulation, bit for bit: what one wgmma k-step
// (E4M3 x E4M3 -> F32, 32 products a step) does to an accumulator. The kernels'
// chains of wgmma do not add exactly; the kernel-faithful CPU reference runs this
// model instead of exact sums, so it computes the very floats the kernel folds.
//
// The model was fitted to the H200 (chains of 1, 2 and 4 steps from zero and from a
// given accumulator on 1536 random 64 x 8 tiles, 100 % of 4.7M results equal;
// docs/performance-history.md) and tests/gpu/test_mma_model.cu checks it against the
// hardware on every run (MEGAMOE_MMA_DUMP=path also writes its raw results):
//   1. e = the largest exponent among the step's nonzero products, taken as the sum
//      of the two E4M3 exponent fields (unbiased; subnormals -6), so a product's
//      significand lies in [1, 4) -- and floor(log2|c|) of the accumulator if c != 0;
//   2. every product and c truncated toward zero to a multiple of 2^(e - 13);
//   3. the truncated terms summed exactly;
//   4. the sum truncated toward zero to 14 significant bits (an e8m13 accumulator).
// A NaN code anywhere in the step (or a NaN c) gives NaN.
#pragma once

#include <cmath>
#include <cstdint>

#include "megamoe/numerics/fp8.h"

namespace megamoe::num {

constexpr int kMmaStepK = 32;     // products per wgmma k-step (K of m64nNk32)
constexpr int kMmaFracBits = 13;  // alignment below the largest exponent, and kept fraction bits

// An E4M3 code as significand (0..15, hidden bit included) x 2^(exp - 3), exp the
// unbiased exponent field (-6 for subnormals and zero).
struct E4M3Parts {
  int sig;
  int exp;
  bool nan;
};
inline E4M3Parts e4m3_parts(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  return {e == 0 ? m : 8 + m, e == 0 ? -6 : e - 7, (b & 0x7F) == 0x7F};
}

// Truncates toward zero to `bits` significant bits; |s| < 2^62.
inline int64_t mma_keep_bits(int64_t s, int bits) {
  const uint64_t mag = uint64_t(s < 0 ? -s : s);
  int width = 0;
  while (width < 64 && (mag >> width) != 0) ++width;
  if (width <= bits) return s;
  const int drop = width - bits;
  const int64_t kept = int64_t((mag >> drop) << drop);
  return s < 0 ? -kept : kept;
}

// The step's result from its exponent e and the exact sum s of its truncated terms
// (units of 2^(e - 13)).
inline float mma_step_result(int64_t s, int e) {
  return float(std::ldexp(double(mma_keep_bits(s, kMmaFracBits + 1)), e - kMmaFracBits));
}

// c + a[0] b[0] + ... + a[n-1] b[n-1] (n <= 32; the codes past n are zeros) as one
// wgmma k-step computes it.
inline float fp8_mma_step(float c, const uint8_t* a, const uint8_t* b, int n) {
  if (std::isnan(c)) return c;
  constexpr int kNone = -1000;
  int e = kNone;
  for (int i = 0; i < n; ++i) {
    const E4M3Parts pa = e4m3_parts(a[i]), pb = e4m3_parts(b[i]);
    if (pa.nan || pb.nan) return NAN;
    if (pa.sig != 0 && pb.sig != 0 && pa.exp + pb.exp > e) e = pa.exp + pb.exp;
  }
  if (c != 0.0f) {
    const int ec = std::ilogb(c);
    if (ec > e) e = ec;
  }
  if (e == kNone) return 0.0f;
  int64_t s = 0;
  for (int i = 0; i < n; ++i) {
    const E4M3Parts pa = e4m3_parts(a[i]), pb = e4m3_parts(b[i]);
    // |a b| / 2^(e - 13) = sig_a sig_b 2^(exp_a + exp_b - 6 - e + 13): at most 7 bits up.
    const int64_t p = int64_t(pa.sig * pb.sig) << 7;
    const int down = e - (pa.exp + pb.exp);  // >= 0 but for a zero product (excluded from e)
    const int64_t mag = p == 0 || down >= 62 ? 0 : p >> down;
    s += ((a[i] ^ b[i]) & 0x80) ? -mag : mag;
  }
  s += int64_t(std::trunc(std::ldexp(double(c), kMmaFracBits - e)));
  return mma_step_result(s, e);
}

// A chain of steps from zero over n products (the tensor-core partial sum one fold
// takes in): steps of kMmaStepK in order.
inline float fp8_mma_chain(const uint8_t* a, const uint8_t* b, int n) {
  float c = 0.0f;
  for (int k = 0; k < n; k += kMmaStepK)
    c = fp8_mma_step(c, a + k, b + k, n - k < kMmaStepK ? n - k : kMmaStepK);
  return c;
}

}  // namespace megamoe::num
