// The per-token activation quantization rule (SPEC §4) as scalar building
// blocks shared by the CPU reference and the CUDA kernels, so both compute the
// same scale and the same bytes.
#pragma once

#include <cmath>

#include "megamoe/numerics/fp8.h"

namespace megamoe::num {

constexpr float kActScaleEps = 1e-4f;  // amax floor
constexpr int kActGroup = 128;         // x -> FP8: 1x128 groups along H (matches the weight blocks)
// SwiGLU output -> FP8 before the second GEMM: 1x64 groups along I with a
// float32 scale. 64 = the intermediate columns one GEMM1 tile of the Hopper
// kernel produces, so each tile quantizes its own output without a second pass.
constexpr int kInterGroup = 64;
// Depth at which the kernel folds a tensor-core partial sum into its float32
// accumulator (times scale_x * scale_w): 64, half a weight block, in both GEMMs.
// NOTE: shorter chains of FP8 wgmma accumulation track the exact sum more closely
// (the tensor cores accumulate with reduced precision inside a chain).
// (v11 measured 128 in the first GEMM: 5-8 % faster from T = 1024 on, but relative L2
// up to 5.5e-3 against this reference on the DeepSeek-V3 shape: bench/results/NOTES.md.)
constexpr int kFoldK = 64;

// s = max(amax, 1e-4) / 448 (IEEE float division; no fast-math anywhere).
MEGAMOE_HD float act_scale(float amax) { return (amax > kActScaleEps ? amax : kActScaleEps) / kE4M3Max; }

// q = e4m3(x * (1 / s)).
MEGAMOE_HD uint8_t act_quant(float x, float inv_scale) { return e4m3_encode(x * inv_scale); }

// SwiGLU with the optional clamp (SPEC §7), times the routing weight, in fp32.
// NOTE: the kernel evaluates exactly this expression; keep them in step.
MEGAMOE_HD float swiglu(float g, float u, float limit, float weight) {
  if (limit > 0.0f) {
    g = g < limit ? g : limit;
    u = u < -limit ? -limit : (u > limit ? limit : u);
  }
#if defined(__CUDA_ARCH__)
  const float silu = g / (1.0f + expf(-g));
#else
  const float silu = g / (1.0f + std::exp(-g));
#endif
  return silu * u * weight;
}

}  // namespace megamoe::num
