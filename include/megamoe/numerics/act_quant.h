// The per-token activation quantization rule (docs/numerics.md §4) as scalar building
// blocks shared by the CPU reference and the CUDA kernels, so both compute the
// same scale and the same bytes.
#pragma once

#include <cmath>

#include "megamoe/numerics/fp8.h"

namespace megamoe::num {

constexpr float kActScaleEps = 1e-4f;  // amax floor
constexpr int kActGroup = 128;         // x -> FP8: 1x128 groups along H (matches the weight blocks)
// SwiGLU output -> FP8 before the second GEMM: 1x128 groups along I with a
// float32 scale. 128 = one K block of the second GEMM, so every GEMM2 tile folds once a
// 128-deep stage, as GEMM1 does (64-column groups cost a second fold a stage, 7 % of GLM-5's
// layer at 16384 tokens), and the same granularity as
// cuBLASLt's VEC128 and DeepGEMM's activations. Every Hopper GEMM1 tile therefore holds
// the gate and up rows of 128 intermediate columns (fused_moe.cu), whatever its shape.
constexpr int kInterGroup = 128;
// Depth at which the kernel folds a first-GEMM tensor-core partial sum into its
// float32 accumulator (times scale_x * scale_w): 128, one weight block, as DeepGEMM
// does. The second GEMM folds every kInterGroup columns (its activation scale changes
// there). The reference models the tensor cores' accumulation inside a fold
// (num::fp8_mma_step), so the fold depth is a speed choice, not a tolerance (a reference
// that summed exactly drifted to 5.5e-3 relative L2 from the kernel at this depth).
constexpr int kGemm1FoldK = 128;

// s = max(amax, 1e-4) / 448 (IEEE float division; no fast-math anywhere).
MEGAMOE_HD float act_scale(float amax) { return (amax > kActScaleEps ? amax : kActScaleEps) / kE4M3Max; }

// q = e4m3(x * (1 / s)).
MEGAMOE_HD uint8_t act_quant(float x, float inv_scale) { return e4m3_encode(x * inv_scale); }

// SwiGLU's clamp (docs/numerics.md §7) when limit > 0: the gate from above (a NaN gate becomes
// the limit), the up projection both ways. Selects, no branch: the kernel's
// epilogues evaluate 32 of these a thread and a branch each kept ptxas from
// overlapping them.
MEGAMOE_HD void swiglu_clamp(float& g, float& u, float limit) {
  const bool on = limit > 0.0f;
  g = on && !(g < limit) ? limit : g;
  const float lo = u < -limit ? -limit : u;
  u = on ? (lo > limit ? limit : lo) : u;
}

// e^x from one multiply, one rounding to an integer, FMAs and an exponent add: no
// library exp and no special-function unit, so the CPU reference and the kernels get
// the same bits (the device's expf uses MUFU.EX2 and differed from the host's
// std::exp for 7.6 % of floats). Cody-Waite reduction x = k ln2 + r (|r| <=
// ln2 / 2, ln2's high part exact times any k here), Taylor to r^7 (truncation below
// 0.5 ulp), Horner in fmaf, then k added to the exponent field. The argument is
// clamped to [-86, 88] so that add stays in the normal range: within 1 ulp of e^x
// rounded to float there (measured on every 64th float; tests/cpu/test_numerics.cpp
// asserts 2), e^-86 below, e^88 above, NaN for NaN. (SiLU
// needs no more: 1 + e^-g is 1 for g > 17 and g / (1 + e^-g) underflows the
// intermediate's FP8 codes long before g < -86.)
// NOTE: only explicit fmaf and lone products: a compiler contracting a * b + c into
// one FMA on one side only would change bits.
// kShift: k = rint(x log2e) and its integer by the 1.5 * 2^23 shift (the sum rounds the
// product to an integer, ties to even as rintf, and k sits in the sum's low significand
// bits: |x log2e| < 2^22 here) with two adds and an integer subtract, instead of rintf and
// a conversion (FRND and F2I, each at a quarter of the FMA rate on the device; a GEMM1
// epilogue evaluates 32 of these a thread). The same bits either way: the device uses the
// shift, the host rintf, and tests/gpu/test_numerics_device.cu compares the two for every
// float. (__fmul_rn / __fadd_rn: no FMA contraction of the shift. kShift is device code
// only: compiled for the host it would leave k = 0.)
template <bool kShift>
MEGAMOE_HD float exp_fma_impl(float x) {
  const bool nan = x != x;
  float xc = x < -86.0f ? -86.0f : x;
  xc = xc > 88.0f ? 88.0f : xc;
  xc = nan ? 0.0f : xc;
  float k = 0.0f;
  int ki = 0;
  if constexpr (kShift) {
#if defined(__CUDA_ARCH__)
    const float shifted = __fadd_rn(__fmul_rn(xc, 1.44269502f), 0x1.8p23f);
    k = __fsub_rn(shifted, 0x1.8p23f);
    ki = int(float_bits(shifted) - float_bits(0x1.8p23f));
#endif
  } else {
    k = rintf(xc * 1.44269502f);
    ki = int(k);
  }
  float r = fmaf(k, -0.693145751953125f, xc);  // ln2 high part: 16 significant bits
  r = fmaf(k, -1.428606765330187e-06f, r);     // ln2 - the high part
  float p = 1.0f / 5040.0f;
  p = fmaf(p, r, 1.0f / 720.0f);
  p = fmaf(p, r, 1.0f / 120.0f);
  p = fmaf(p, r, 1.0f / 24.0f);
  p = fmaf(p, r, 1.0f / 6.0f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);  // in [0.70, 1.42]; times 2^k, k in [-124, 127]: normal
  const float e = bits_float(float_bits(p) + (uint32_t(ki) << 23));
  return nan ? x : e;
}

MEGAMOE_HD float exp_fma(float x) {
#if defined(__CUDA_ARCH__)
  return exp_fma_impl<true>(x);
#else
  return exp_fma_impl<false>(x);
#endif
}

// SwiGLU with the optional clamp, times the routing weight, in fp32.
// NOTE: the kernel evaluates exactly this expression (or swiglu_fast, the same bits);
// keep them in step.
MEGAMOE_HD float swiglu(float g, float u, float limit, float weight) {
  swiglu_clamp(g, u, limit);
  const float silu = g / (1.0f + exp_fma(-g));
  return silu * u * weight;
}

#if defined(__CUDACC__)
// n / d rounded to nearest even, without the slow path of IEEE division: the
// sequence nvcc emits for `/` when its FCHK finds the operands in range
// (reciprocal estimate, one Newton step, quotient, one residual correction), so
// the same bits wherever silu_fast_ok holds. Why: `/` branches to its slow path
// per element, and the branch with its convergence barrier made every SwiGLU of
// an epilogue a basic block of its own: ptxas could not overlap a thread's 32
// (~190 cycles each, one after the other; docs/performance-history.md).
__device__ __forceinline__ float div_rn_fast(float n, float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  const float r1 = fmaf(r, fmaf(-d, r, 1.0f), r);
  const float q0 = n * r1;
  const float q1 = fmaf(r1, fmaf(-d, q0, n), q0);
  return copysignf(q1, n);  // (a zero n: q1 is +0 either way; n / d keeps n's sign)
}

// Where div_rn_fast(g, 1 + exp_fma(-g)) == g / (1 + exp_fma(-g)) bit for bit: g finite
// and 1 + exp(-g) below 2^126 (g > -87). (A tiny g has 1 + exp(-g) == 2 exactly, so the
// quotient is g / 2 rounded once, subnormal or not.) Checked for every float g on the
// GPU (tests/gpu/test_numerics_device.cu). Predicates combined without branches.
__device__ __forceinline__ bool silu_fast_ok(float g) { return (g > -87.0f) & (g <= 0x1.fffffep127f); }

// swiglu with div_rn_fast: the same bits when silu_fast_ok(g after the clamp);
// callers check that for a whole warp first (one branch, not one an element).
__device__ __forceinline__ float swiglu_fast(float g, float u, float limit, float weight) {
  swiglu_clamp(g, u, limit);
  return div_rn_fast(g, 1.0f + exp_fma(-g)) * u * weight;
}

// True when swiglu_fast(g, ...) == swiglu(g, ...) (g before the clamp).
__device__ __forceinline__ bool swiglu_fast_ok(float g, float limit) {
  float u = 0.0f;
  swiglu_clamp(g, u, limit);
  return silu_fast_ok(g);
}
#endif

}  // namespace megamoe::num
