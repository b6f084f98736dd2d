// GPU tests of the device-only shortcuts in numerics/ against the shared
// definitions, for every 32-bit float: exp_fma's shift rounding, the branch-free SwiGLU
// (swiglu_fast, where swiglu_fast_ok says) and the BF16 pair conversion (bf16x2_encode).
// Both must give the very bits of the definitions the CPU reference uses, so
// the kernel's bytes did not change when its epilogues took them (v15).
// Skipped without a device.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>

#include "../../src/kernels/cuda_check.h"
#include "gpu_test_util.h"
#include "megamoe/numerics/act_quant.h"
#include "megamoe/numerics/fp8.h"

namespace megamoe::num {
namespace {

using testutil::have_device;

#define REQUIRE_DEVICE() \
  if (!have_device()) GTEST_SKIP() << "no CUDA device"

struct Counts {
  unsigned long long checked;     // inputs compared
  unsigned long long mismatches;  // bits differ
  unsigned int first_bad;         // an input that differs (valid if mismatches > 0)
};

// A thread's counts into the totals (any one differing input is kept).
__device__ void report(Counts* out, unsigned long long checked, unsigned long long bad, unsigned int first) {
  atomicAdd(&out->checked, checked);
  if (bad) {
    atomicAdd(&out->mismatches, bad);
    out->first_bad = first;
  }
}

__device__ __forceinline__ uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// Every float x: exp_fma's device form (k by the 1.5 * 2^23 shift) == its host form (rintf).
__global__ void exp_all_floats(Counts* out) {
  unsigned long long checked = 0, bad = 0;
  unsigned int first = 0;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < (uint64_t(1) << 32);
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float x = __uint_as_float(uint32_t(i));
    ++checked;
    if (__float_as_uint(exp_fma_impl<true>(x)) != __float_as_uint(exp_fma_impl<false>(x))) {
      ++bad;
      first = uint32_t(i);
    }
  }
  report(out, checked, bad, first);
}

// Every float g (the bit pattern i) where swiglu_fast_ok holds: swiglu_fast ==
// swiglu bit for bit, with an up value and a weight drawn from i's hash.
__global__ void swiglu_all_floats(float limit, Counts* out) {
  unsigned long long checked = 0, bad = 0;
  unsigned int first = 0;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < (uint64_t(1) << 32);
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float g = __uint_as_float(uint32_t(i));
    if (!swiglu_fast_ok(g, limit)) continue;
    const uint32_t h = hash32(uint32_t(i));
    const float u = (float(h & 0xFFFF) - 32768.0f) * (1.0f / 2048.0f);  // [-16, 16)
    const float w = float(h >> 16) * (1.0f / 65536.0f);                 // [0, 1)
    ++checked;
    if (__float_as_uint(swiglu_fast(g, u, limit, w)) != __float_as_uint(swiglu(g, u, limit, w))) {
      ++bad;
      first = uint32_t(i);
    }
  }
  report(out, checked, bad, first);
}

// Every float pair (i, ~i) but NaN: bf16x2_encode == two bf16_encode.
__global__ void bf16_all_floats(Counts* out) {
  unsigned long long checked = 0, bad = 0;
  unsigned int first = 0;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < (uint64_t(1) << 32);
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float lo = __uint_as_float(uint32_t(i)), hi = __uint_as_float(~uint32_t(i));
    if (isnan(lo) || isnan(hi)) continue;
    ++checked;
    const uint32_t want = uint32_t(bf16_encode(lo)) | (uint32_t(bf16_encode(hi)) << 16);
    if (bf16x2_encode(lo, hi) != want) {
      ++bad;
      first = uint32_t(i);
    }
  }
  report(out, checked, bad, first);
}

Counts run(void (*launch)(Counts*)) {
  Counts* d = nullptr;
  MEGAMOE_CUDA_CHECK(cudaMalloc(&d, sizeof(Counts)));
  MEGAMOE_CUDA_CHECK(cudaMemset(d, 0, sizeof(Counts)));
  launch(d);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
  Counts h{};
  MEGAMOE_CUDA_CHECK(cudaMemcpy(&h, d, sizeof(Counts), cudaMemcpyDeviceToHost));
  cudaFree(d);
  return h;
}

constexpr int kGrid = 1024, kBlock = 256;

TEST(NumericsDevice, SwigluFastIsSwigluWhereOk) {
  REQUIRE_DEVICE();
  // No clamp (DeepSeek-V3, GLM-5) and a clamped gate (a swiglu_limit of 7).
  const Counts plain = run(+[](Counts* d) { swiglu_all_floats<<<kGrid, kBlock>>>(0.0f, d); });
  const Counts clamped = run(+[](Counts* d) { swiglu_all_floats<<<kGrid, kBlock>>>(7.0f, d); });
  for (const Counts& r : {plain, clamped}) {
    std::printf("swiglu_fast: %llu floats in range, %llu differ\n", r.checked, r.mismatches);
    EXPECT_EQ(r.mismatches, 0u) << "first g bits 0x" << std::hex << r.first_bad;
    // The range holds what activations occupy: every finite float above -87, about 74 %
    // of all bit patterns.
    EXPECT_GT(r.checked, (1ull << 32) / 10 * 7);
  }
}

TEST(NumericsDevice, ExpFmaShiftIsRintForEveryFloat) {
  REQUIRE_DEVICE();
  const Counts c = run(+[](Counts* d) { exp_all_floats<<<kGrid, kBlock>>>(d); });
  std::printf("exp_fma (shift vs rintf): %llu floats, %llu differ\n", c.checked, c.mismatches);
  EXPECT_EQ(c.mismatches, 0u) << "first x bits 0x" << std::hex << c.first_bad;
  EXPECT_EQ(c.checked, 1ull << 32);
}

TEST(NumericsDevice, Bf16x2EncodeIsBf16EncodeForEveryNonNan) {
  REQUIRE_DEVICE();
  const Counts c = run(+[](Counts* d) { bf16_all_floats<<<kGrid, kBlock>>>(d); });
  std::printf("bf16x2_encode: %llu pairs, %llu differ\n", c.checked, c.mismatches);
  EXPECT_EQ(c.mismatches, 0u) << "first lo bits 0x" << std::hex << c.first_bad;
  EXPECT_GT(c.checked, (1ull << 32) - (1ull << 25));
}

}  // namespace
}  // namespace megamoe::num
