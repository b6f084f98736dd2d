// The exact E4M3 block dot products under both GEMMs of the kernel-faithful
// reference: a portable path (256-entry decode table, scalar doubles) and an
// AVX2+FMA path picked at run time. Both compute exact sums (see engine.h), so
// they return the same bits and the choice never shows in the results.
#include <array>

#include "engine.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MEGAMOE_REF_AVX2 1
#include <immintrin.h>
#endif

namespace megamoe::ref::detail {
namespace {

const std::array<double, 256>& e4m3_table() {
  static const std::array<double, 256> t = [] {
    std::array<double, 256> v{};
    for (int b = 0; b < 256; ++b) v[b] = num::e4m3_decode(uint8_t(b));
    return v;
  }();
  return t;
}

void dot_portable(const uint8_t* w, int n, int blk, const float* const* a, int m, double* part) {
  const auto& lut = e4m3_table();
  const int nb = (n + blk - 1) / blk;
  for (int b = 0; b < nb; ++b) {
    const int c0 = b * blk, c1 = std::min(n, c0 + blk);
    for (int j = 0; j < m; ++j) {
      double acc = 0.0;
      for (int c = c0; c < c1; ++c) acc += lut[w[c]] * double(a[j][c]);
      part[size_t(j) * nb + b] = acc;
    }
  }
}

#if MEGAMOE_REF_AVX2

// Eight E4M3 codes -> two vectors of four doubles. Placing the 7 magnitude
// bits at float bit 20 gives 2^-120 times the E4M3 value for normal and
// subnormal codes alike (the float is then subnormal exactly when the E4M3 is),
// so one multiply by 2^120 finishes the decode. NaN codes are forced to NaN.
__attribute__((target("avx2,fma"))) inline void decode8(const uint8_t* p, __m256d& lo, __m256d& hi) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(mag, 20), sign);
  __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
  f = _mm256_or_ps(f, _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F))));
  lo = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
  hi = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
}

__attribute__((target("avx2,fma"))) inline double hsum(__m256d v) {
  const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

// M activation rows against one weight row: the weight codes are decoded once
// per 8 columns and reused from registers for all M rows.
template <int M>
__attribute__((target("avx2,fma"))) void dot_avx2_m(const uint8_t* w, int n, int blk, const float* const* a,
                                                    double* part, int nb) {
  const auto& lut = e4m3_table();
  for (int b = 0; b < nb; ++b) {
    const int c0 = b * blk, c1 = std::min(n, c0 + blk);
    __m256d acc0[M], acc1[M];
    for (int j = 0; j < M; ++j) acc0[j] = acc1[j] = _mm256_setzero_pd();
    int c = c0;
    for (; c + 8 <= c1; c += 8) {
      __m256d lo, hi;
      decode8(w + c, lo, hi);
      for (int j = 0; j < M; ++j) {
        acc0[j] = _mm256_fmadd_pd(lo, _mm256_cvtps_pd(_mm_loadu_ps(a[j] + c)), acc0[j]);
        acc1[j] = _mm256_fmadd_pd(hi, _mm256_cvtps_pd(_mm_loadu_ps(a[j] + c + 4)), acc1[j]);
      }
    }
    for (int j = 0; j < M; ++j) {
      double s = hsum(_mm256_add_pd(acc0[j], acc1[j]));
      for (int cc = c; cc < c1; ++cc) s += lut[w[cc]] * double(a[j][cc]);
      part[size_t(j) * nb + b] = s;
    }
  }
}

void dot_avx2(const uint8_t* w, int n, int blk, const float* const* a, int m, double* part) {
  const int nb = (n + blk - 1) / blk;
  int j = 0;
  for (; j + 4 <= m; j += 4) dot_avx2_m<4>(w, n, blk, a + j, part + size_t(j) * nb, nb);
  switch (m - j) {
    case 3: dot_avx2_m<3>(w, n, blk, a + j, part + size_t(j) * nb, nb); break;
    case 2: dot_avx2_m<2>(w, n, blk, a + j, part + size_t(j) * nb, nb); break;
    case 1: dot_avx2_m<1>(w, n, blk, a + j, part + size_t(j) * nb, nb); break;
    default: break;
  }
}

bool have_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

#endif

}  // namespace

void dot_e4m3_blocks(const uint8_t* w, int n, int blk, const float* const* a, int m, double* part) {
#if MEGAMOE_REF_AVX2
  if (have_avx2()) return dot_avx2(w, n, blk, a, m, part);
#endif
  dot_portable(w, n, blk, a, m, part);
}

void dot_e4m3_blocks_portable(const uint8_t* w, int n, int blk, const float* const* a, int m, double* part) {
  dot_portable(w, n, blk, a, m, part);
}

}  // namespace megamoe::ref::detail
