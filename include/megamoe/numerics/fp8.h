// Scalar number formats shared by every layer (docs/numerics.md §3): E4M3 (float8_e4m3fn),
// UE8M0 scale bytes and BF16. Everything here is __host__ __device__ so the CPU
// reference and the CUDA kernels use one definition of each conversion.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MEGAMOE_HD __host__ __device__ __forceinline__
#else
#define MEGAMOE_HD inline
#endif

namespace megamoe::num {

constexpr float kE4M3Max = 448.0f;
constexpr uint8_t kE4M3NaN = 0x7F;  // S.1111.111; 0xFF is NaN too.

MEGAMOE_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

MEGAMOE_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// E4M3 -> float: exact (every E4M3 value is a float).
MEGAMOE_HD float e4m3_decode(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80) << 24;
  const uint32_t exp = (b >> 3) & 0xF;
  const uint32_t man = b & 0x7;
  if (exp == 0xF && man == 0x7) return bits_float(0x7FC00000u | sign);  // NaN
  if (exp == 0) {
    // Subnormal: man * 2^-9.
    const float v = float(man) * (1.0f / 512.0f);
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// float -> E4M3, round to nearest even, saturating to +-448 (never NaN from a
// finite input or from +-inf); every NaN maps to the canonical 0x7F, sign
// dropped, because that is what the hardware cvt produces (a -NaN input gives
// 0x7F, not 0xFF; ml_dtypes would keep the sign). Checked against the H200's
// cvt for all 2^32 float inputs.
// NOTE: must stay bit-identical to cvt.rn.satfinite.e4m3x2.f32 (the kernels use it).
MEGAMOE_HD uint8_t e4m3_encode(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kE4M3NaN;
  // Largest magnitude that rounds to <= 448: 464 rounds to even (480 would be
  // NaN code), so everything >= 464 saturates; satfinite clamps it to 448.
  if (a >= 0x43E80000u) return uint8_t(sign | 0x7E);  // >= 464.0 (incl. inf)
  const int exp = int(a >> 23) - 127;
  if (exp < -6) {
    // Subnormal range of E4M3 (or zero): quantum 2^-9. Round |f| * 512 to even.
    const float x = bits_float(a) * 512.0f;  // exact (power-of-two scaling)
    // x < 8 here; round half to even on the integer grid.
    const uint32_t xi = uint32_t(x);
    const float frac = x - float(xi);
    uint32_t r = xi;
    if (frac > 0.5f || (frac == 0.5f && (xi & 1u))) r = xi + 1;
    // r == 8 becomes the smallest normal (exp field 1, mantissa 0): same encoding.
    return uint8_t(sign | r);
  }
  // Normal: keep 3 mantissa bits, round to nearest even on the 20 dropped bits.
  uint32_t man = a & 0x7FFFFFu;
  uint32_t e = uint32_t(exp + 7);
  const uint32_t keep = man >> 20;
  const uint32_t rest = man & 0xFFFFFu;
  uint32_t q = (e << 3) | keep;
  if (rest > 0x80000u || (rest == 0x80000u && (keep & 1u))) q += 1;  // may carry into exp
  if (q > 0x7E) q = 0x7E;  // 448 < |f| < 464 rounds down to 448 already; belt and braces
  return uint8_t(sign | q);
}

// UE8M0 scale byte b means 2^(b-127); 255 is NaN.
MEGAMOE_HD float ue8m0_decode(uint8_t b) {
  if (b == 255) return bits_float(0x7FC00000u);
  if (b == 0) return bits_float(0x00400000u);  // 2^-127 (subnormal)
  return bits_float(uint32_t(b) << 23);
}

// BF16 stored as its raw 16 bits.
using bf16_t = uint16_t;

MEGAMOE_HD float bf16_decode(bf16_t h) { return bits_float(uint32_t(h) << 16); }

// float -> bf16, round to nearest even; NaN stays NaN (quiet).
MEGAMOE_HD bf16_t bf16_encode(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16_t((u >> 16) | 0x40u);
  const uint32_t lsb = (u >> 16) & 1u;
  return bf16_t((u + 0x7FFFu + lsb) >> 16);
}

#if defined(__CUDACC__)
// Two floats -> two BF16 in one word (lo in the low half) with one cvt.rn.bf16x2.f32:
// bf16_encode's bits for every input but NaN, which comes out as 0x7FFF (bf16_encode
// keeps the payload). Checked for every float on the GPU (tests/gpu/test_numerics_device.cu).
__device__ __forceinline__ uint32_t bf16x2_encode(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif

}  // namespace megamoe::num
