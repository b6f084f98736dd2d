// GPU tests of `megamoe bench`'s timing regimes and its dense yardstick: sustained
// windows hold back-to-back calls and NVML's clock and power, burst calls come one at a
// time after their gaps, and the dense FP8 GEMM pair runs at a plausible rate.
// Skipped without a device.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <stdexcept>

#include "../../src/kernels/cuda_check.h"
#include "gpu_test_util.h"
#include "megamoe/model/shape.h"
#include "megamoe_bench/baselines.h"

namespace megamoe::bench {
namespace {

#define REQUIRE_DEVICE() \
  if (!testutil::have_device()) GTEST_SKIP() << "no CUDA device"

void expect_ordered(const Timing& t) {
  EXPECT_GT(t.min_us, 0.0);
  EXPECT_LE(t.min_us, t.p10_us);
  EXPECT_LE(t.p10_us, t.median_us);
  EXPECT_LE(t.median_us, t.p90_us);
  EXPECT_LE(t.p90_us, t.max_us);
}

TEST(BenchRegimes, SustainedAndBurst) {
  REQUIRE_DEVICE();
  const size_t bytes = size_t(256) << 20;
  void* buf = nullptr;
  MEGAMOE_CUDA_CHECK(cudaMalloc(&buf, bytes));
  auto fn = [&](cudaStream_t s) { MEGAMOE_CUDA_CHECK(cudaMemsetAsync(buf, 1, bytes, s)); };
  RegimeOptions o;
  o.sustained_seconds = 0.3;
  o.ramp_seconds = 0.05;
  o.burst_calls = 5;
  o.burst_gap_ms = 20;
  auto t0 = std::chrono::steady_clock::now();
  const RegimeTiming s = time_regime(fn, nullptr, Regime::kSustained, o);
  const double s_wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  t0 = std::chrono::steady_clock::now();
  const RegimeTiming b = time_regime(fn, nullptr, Regime::kBurst, o);
  const double b_wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MEGAMOE_CUDA_CHECK(cudaFree(buf));
  std::printf(
      "sustained: %d calls, %.1f us, %.0f MHz, %.0f W (%d samples, %.2f s); burst: %d calls, %.1f us, "
      "%.0f MHz, %.0f W (%.2f s)\n",
      s.calls, s.t.median_us, s.sm_clock_mhz, s.power_w, s.samples, s_wall, b.calls, b.t.median_us,
      b.sm_clock_mhz, b.power_w, b_wall);
  expect_ordered(s.t);
  expect_ordered(b.t);
  // The window is filled: the calls' time adds up to most of it (each call is a flush
  // and a 256 MB memset, both well under a millisecond).
  EXPECT_GE(s_wall, 0.35);
  EXPECT_GT(s.calls * s.t.median_us * 1e-6, 0.1);
  EXPECT_GE(s.samples, 5);
  EXPECT_GT(s.sm_clock_mhz, 100.0);
  EXPECT_LT(s.sm_clock_mhz, 3000.0);
  EXPECT_GT(s.power_w, 10.0);
  EXPECT_LT(s.power_w, 1500.0);
  EXPECT_EQ(b.calls, 5);
  EXPECT_EQ(b.samples, 5);
  EXPECT_GE(b_wall, 5 * 0.020);
  EXPECT_GT(b.sm_clock_mhz, 100.0);
  EXPECT_STREQ(regime_name(Regime::kSustained), "sustained");
  EXPECT_STREQ(regime_name(Regime::kBurst), "burst");
}

TEST(BenchRegimes, DenseGemmPairRate) {
  REQUIRE_DEVICE();
  DenseFp8GemmPair d(4096, 6144, 2048);  // GLM-5's GEMM shapes
  MoeShape glm5_gemms;  // the layer's FLOP count of 4096 rows through one such expert
  glm5_gemms.hidden = 6144;
  EXPECT_DOUBLE_EQ(d.flops(), 4096 * glm5_gemms.expert_flops(2048));
  RegimeOptions o;
  o.burst_calls = 7;
  o.burst_gap_ms = 10;
  const RegimeTiming t = time_regime([&](cudaStream_t s) { d.run(s); }, nullptr, Regime::kBurst, o);
  const double tflops = d.flops() / (t.t.median_us * 1e-6) * 1e-12;
  std::printf("dense FP8 GEMM pair m=4096: %.1f us, %.0f TFLOP/s, %.0f MHz\n", t.t.median_us, tflops,
              t.sm_clock_mhz);
  EXPECT_GT(tflops, 300.0);
  EXPECT_LT(tflops, 2500.0);  // above any Hopper's FP8 peak would mean skipped work
}

TEST(BenchRegimes, DenseGemmPairRejectsBadShapes) {
  REQUIRE_DEVICE();
  EXPECT_THROW(DenseFp8GemmPair(4094, 6144, 2048), std::invalid_argument);
  EXPECT_THROW(DenseFp8GemmPair(4096, 6100, 2048), std::invalid_argument);
  EXPECT_THROW(DenseFp8GemmPair(4096, 6144, 0), std::invalid_argument);
}

}  // namespace
}  // namespace megamoe::bench
