// Test support for the CPU reference tests: reduced shapes, random inputs and
// the comparison figures (relative L2 that never lets NaN pass).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "megamoe/model/shape.h"
#include "megamoe/numerics/fp8.h"

namespace megamoe::test {

// A reduced GLM-5.3-Flash-like shape (sigmoid, fp32 router, clamp, shared
// expert) small enough for CI.
inline MoeShape small_glm_shape() {
  MoeShape s;
  s.hidden = 256, s.inter = 128, s.experts = 16, s.topk = 4, s.shared_experts = 1;
  s.routed_scaling = 2.5f, s.swiglu_limit = 10.0f, s.router_dtype = RouterDtype::kF32;
  return s;
}

// A reduced DeepSeek-V3-like shape: grouped top-k, bf16 router, no clamp.
inline MoeShape small_deepseek_shape() {
  MoeShape s;
  s.hidden = 256, s.inter = 128, s.experts = 32, s.topk = 4, s.shared_experts = 1;
  s.n_group = 8, s.topk_group = 4, s.routed_scaling = 2.5f, s.router_dtype = RouterDtype::kBF16;
  return s;
}

// x ~ N(0, sd^2) rounded to bf16.
inline std::vector<num::bf16_t> random_bf16(size_t n, uint64_t seed, float sd = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<num::bf16_t> v(n);
  for (auto& x : v) x = num::bf16_encode(nd(rng));
  return v;
}

// ||a - b|| / ||b||; +inf when either side has a NaN or Inf anywhere, so a
// NaN can never pass a "< tolerance" check.
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return den > 0.0 ? std::sqrt(num / den) : (num > 0.0 ? INFINITY : 0.0);
}

// Byte equality of two float outputs, reporting the first mismatch.
inline ::testing::AssertionResult same_bytes(const std::vector<float>& a, const std::vector<float>& b,
                                             int H) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << "sizes " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (num::float_bits(a[i]) != num::float_bits(b[i]))
      return ::testing::AssertionFailure()
             << "first mismatch at token " << i / H << " column " << i % H << ": " << a[i] << " vs " << b[i];
  }
  return ::testing::AssertionSuccess();
}

}  // namespace megamoe::test
