// The E4M3 block dot products under both GEMMs of the kernel-faithful reference,
// computed as the Hopper tensor cores compute them (num::fp8_mma_step is the
// definition; tests/cpu/test_layer.cpp checks both paths here against it bit for
// bit). The codes are split once into signed significands and exponent fields and a
// chain keeps its accumulator as an integer and an exponent, so a k-step is two
// integer passes over its 32 products: the largest exponent, then the truncated
// terms. A full step has an AVX2 version (picked at run time); partial steps and
// CPUs without AVX2 run the portable one.
#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#include "engine.h"
#include "megamoe/numerics/mma_model.h"

namespace megamoe::ref::detail {

namespace {

struct SplitTable {
  int8_t sig[256], exp[256];
  SplitTable() {
    for (int b = 0; b < 256; ++b) {
      const num::E4M3Parts p = num::e4m3_parts(uint8_t(b));
      sig[b] = int8_t((b & 0x80) ? -p.sig : p.sig);
      exp[b] = int8_t(p.nan ? kSplitNanExp : p.sig == 0 ? kSplitZeroExp : p.exp);
    }
  }
};
const SplitTable kSplit;

// The codes split (see SplitCodes), one table lookup each.
void split_e4m3(const uint8_t* q, size_t n, int8_t* sig, int8_t* exp) {
  for (size_t i = 0; i < n; ++i) sig[i] = kSplit.sig[q[i]], exp[i] = kSplit.exp[q[i]];
}

}  // namespace

SplitCodes::SplitCodes(const uint8_t* q, size_t rows, int cols_)
    : sig(rows * size_t(cols_)), exp(rows * size_t(cols_)), cols(cols_) {
  split_e4m3(q, rows * size_t(cols_), sig.data(), exp.data());
}

namespace {

// Exponent sums of products with a NaN code are at least kNanSum (a real one is at
// most 16); of products with a zero code at most kZeroSum (a real one is at least
// -12, and a nonzero accumulator of a chain from zero at least 2^-25).
constexpr int kNanSum = kSplitNanExp + kSplitZeroExp;
constexpr int kZeroSum = kSplitZeroExp + 8;
static_assert(kNanSum > 16 && kZeroSum < -25, "split exponents must stay apart from real ones");
constexpr int kBits = num::kMmaFracBits + 1;  // significant bits the accumulator keeps

// A chain's accumulator: s * 2^(e - 13), |s| < 2^14 (s == 0: zero).
struct Acc {
  int s = 0;
  int e = 0;
  bool nan = false;
};

// floor(log2|c|) of a nonzero accumulator, else below every real exponent.
__attribute__((always_inline)) inline int acc_exp(const Acc& c) {
  return c.s != 0 ? c.e - kBits + int(std::bit_width(unsigned(c.s < 0 ? -c.s : c.s))) : -1000;
}

// The step's end: the accumulator's truncated term added to the terms' sum s, the
// result truncated toward zero to 14 significant bits, the new state at exponent e.
__attribute__((always_inline)) inline void finish_step(Acc& c, int s, int e) {
  if (c.s != 0) {
    const int mag = (c.s < 0 ? -c.s : c.s);
    // (toward zero; a NaN product's exponent lies far above c's: e - c.e may pass 31)
    const int term = c.e >= e ? mag << (c.e - e) : e - c.e >= 31 ? 0 : mag >> (e - c.e);
    s += c.s < 0 ? -term : term;
  }
  const unsigned mag = unsigned(s < 0 ? -s : s);
  const int drop = std::max(int(std::bit_width(mag)) - kBits, 0);
  c.s = s < 0 ? -int((mag >> drop) << drop) : int((mag >> drop) << drop);
  c.e = e;
}

// One k-step of n <= 32 products (num::fp8_mma_step on split codes); kN > 0: n == kN
// (a full step: fixed trip counts the compiler vectorizes).
template <int kN>
__attribute__((always_inline)) inline void mma_step_split(Acc& c, const int8_t* ws, const int8_t* we,
                                                          const int8_t* as, const int8_t* ae, int n_) {
  const int n = kN > 0 ? kN : n_;
  int es[num::kMmaStepK];
  int e = -1000;
  for (int i = 0; i < n; ++i) {
    es[i] = int(we[i]) + int(ae[i]);
    e = std::max(e, es[i]);
  }
  if (e >= kNanSum) c.nan = true;
  e = std::max(e, acc_exp(c));
  if (e <= kZeroSum) return;  // no nonzero product and c == 0
  int s = 0;
  for (int i = 0; i < n; ++i) {
    const int p = int(ws[i]) * int(as[i]);
    const int down = std::min(e - es[i], 31);
    const int mag = ((p < 0 ? -p : p) << 7) >> down;
    s += p < 0 ? -mag : mag;
  }
  finish_step(c, s, e);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MEGAMOE_REF_AVX2 1

// The sum of a full step's 32 terms in 16-bit lanes: |p| 2^(7 - d) is
// mulhi(|p| << 8, 2^(15 - d)) with the multiplier looked up by d (0 from d = 15 on,
// where every term truncates to 0), signs restored, pairs summed into 32 bits.
// Returns the step's exponent e (kZeroSum or below: no nonzero product) and the sum.
__attribute__((target("avx2"))) inline int step32_terms_avx2(const int8_t* ws, const int8_t* we,
                                                             const int8_t* as, const int8_t* ae, int c_exp,
                                                             bool& nan, int& sum) {
  const __m256i es = _mm256_adds_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(we)),
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ae)));
  __m128i m = _mm_max_epi8(_mm256_castsi256_si128(es), _mm256_extracti128_si256(es, 1));
  m = _mm_max_epi8(m, _mm_srli_si128(m, 8));
  m = _mm_max_epi8(m, _mm_srli_si128(m, 4));
  m = _mm_max_epi8(m, _mm_srli_si128(m, 2));
  m = _mm_max_epi8(m, _mm_srli_si128(m, 1));
  int e = int(int8_t(_mm_cvtsi128_si32(m) & 0xFF));  // saturated sums keep NaN >= kNanSum, zeros <= kZeroSum
  if (e >= kNanSum) nan = true;
  e = std::max(e, c_exp);
  if (e <= kZeroSum) return e;
  const __m256i d = _mm256_min_epu8(_mm256_subs_epi8(_mm256_set1_epi8(int8_t(e)), es), _mm256_set1_epi8(15));
  // 2^(15 - d) for d < 15, else 0: low and high bytes.
  const __m256i lo_tab = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, -128, 64, 32, 16, 8, 4, 2, 0, 0, 0, 0, 0, 0,
                                          0, 0, 0, -128, 64, 32, 16, 8, 4, 2, 0);
  const __m256i hi_tab = _mm256_setr_epi8(-128, 64, 32, 16, 8, 4, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, -128, 64, 32,
                                          16, 8, 4, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m256i mlo = _mm256_shuffle_epi8(lo_tab, d), mhi = _mm256_shuffle_epi8(hi_tab, d);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i vw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws));
  const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(as));
  const __m256i wneg = _mm256_cmpgt_epi8(zero, vw), aneg = _mm256_cmpgt_epi8(zero, va);
  const __m256i ones = _mm256_set1_epi16(1);
  // Bytes 0-7 and 8-15 of each 128-bit lane as 16-bit lanes (the pairing of w, a and d is
  // all that matters for the sum).
  const __m256i p0 = _mm256_mullo_epi16(_mm256_unpacklo_epi8(vw, wneg), _mm256_unpacklo_epi8(va, aneg));
  const __m256i p1 = _mm256_mullo_epi16(_mm256_unpackhi_epi8(vw, wneg), _mm256_unpackhi_epi8(va, aneg));
  const __m256i t0 =
      _mm256_mulhi_epu16(_mm256_slli_epi16(_mm256_abs_epi16(p0), 8), _mm256_unpacklo_epi8(mlo, mhi));
  const __m256i t1 =
      _mm256_mulhi_epu16(_mm256_slli_epi16(_mm256_abs_epi16(p1), 8), _mm256_unpackhi_epi8(mlo, mhi));
  const __m256i acc = _mm256_add_epi32(_mm256_madd_epi16(_mm256_sign_epi16(t0, p0), ones),
                                       _mm256_madd_epi16(_mm256_sign_epi16(t1, p1), ones));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  s4 = _mm_add_epi32(s4, _mm_srli_si128(s4, 8));
  s4 = _mm_add_epi32(s4, _mm_srli_si128(s4, 4));
  sum = _mm_cvtsi128_si32(s4);
  return e;
}

// A full step: step32_terms_avx2, then finish_step as in mma_step_split.
__attribute__((target("avx2"))) inline void mma_step32_avx2(Acc& c, const int8_t* ws, const int8_t* we,
                                                            const int8_t* as, const int8_t* ae) {
  int s = 0;
  const int e = step32_terms_avx2(ws, we, as, ae, acc_exp(c), c.nan, s);
  if (e <= kZeroSum) return;
  finish_step(c, s, e);
}
#endif

template <bool kAvx2>
__attribute__((always_inline)) inline void dot_body(const int8_t* ws, const int8_t* we, int n, int blk,
                                                    const SplitRow* a, int m, float* part) {
  const int nb = (n + blk - 1) / blk;
  for (int j = 0; j < m; ++j) {
    for (int b = 0; b < nb; ++b) {
      const int c0 = b * blk, c1 = std::min(n, c0 + blk);
      Acc c;
      int k = c0;
      for (; k + num::kMmaStepK <= c1; k += num::kMmaStepK) {
#if MEGAMOE_REF_AVX2
        if constexpr (kAvx2) {
          mma_step32_avx2(c, ws + k, we + k, a[j].sig + k, a[j].exp + k);
          continue;
        }
#endif
        mma_step_split<num::kMmaStepK>(c, ws + k, we + k, a[j].sig + k, a[j].exp + k, num::kMmaStepK);
      }
      if (k < c1) mma_step_split<0>(c, ws + k, we + k, a[j].sig + k, a[j].exp + k, c1 - k);
      // c.s has at most 14 significant bits and 2^(c.e - 13) is a normal float: exact.
      part[size_t(j) * nb + b] =
          c.nan ? NAN : float(c.s) * num::bits_float(uint32_t(c.e - num::kMmaFracBits + 127) << 23);
    }
  }
}

void dot_portable(const int8_t* ws, const int8_t* we, int n, int blk, const SplitRow* a, int m, float* part) {
  dot_body<false>(ws, we, n, blk, a, m, part);
}

#if MEGAMOE_REF_AVX2
__attribute__((target("avx2"))) void dot_avx2(const int8_t* ws, const int8_t* we, int n, int blk,
                                              const SplitRow* a, int m, float* part) {
  dot_body<true>(ws, we, n, blk, a, m, part);
}
bool have_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2");
  return ok;
}

// split_e4m3 32 codes at a time (the weight rows are split on every use).
__attribute__((target("avx2"))) void split_e4m3_avx2(const uint8_t* q, int n, int8_t* sig, int8_t* exp) {
  int i = 0;
  const __m256i k7 = _mm256_set1_epi8(7), k7f = _mm256_set1_epi8(0x7F), zero = _mm256_setzero_si256();
  // exponent field e (0..15) -> e - 7, subnormals (e = 0) -6
  const __m256i exp_tab = _mm256_setr_epi8(-6, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, -6, -6, -5,
                                           -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8);
  for (; i + 32 <= n; i += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i));
    const __m256i mag = _mm256_and_si256(b, k7f);
    const __m256i e = _mm256_and_si256(_mm256_srli_epi16(mag, 3), _mm256_set1_epi8(15));
    const __m256i hidden = _mm256_andnot_si256(_mm256_cmpeq_epi8(e, zero), _mm256_set1_epi8(8));
    const __m256i s = _mm256_add_epi8(_mm256_and_si256(mag, k7), hidden);  // 0..15
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sig + i),
                        _mm256_sign_epi8(s, _mm256_or_si256(b, _mm256_set1_epi8(1))));
    __m256i x = _mm256_shuffle_epi8(exp_tab, e);
    x = _mm256_blendv_epi8(x, _mm256_set1_epi8(int8_t(kSplitZeroExp)), _mm256_cmpeq_epi8(mag, zero));
    x = _mm256_blendv_epi8(x, _mm256_set1_epi8(int8_t(kSplitNanExp)), _mm256_cmpeq_epi8(mag, k7f));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(exp + i), x);
  }
  split_e4m3(q + i, size_t(n - i), sig + i, exp + i);
}
#endif

}  // namespace

void dot_e4m3_mma_blocks(const uint8_t* w, int n, int blk, const SplitRow* a, int m, float* part) {
  thread_local std::vector<int8_t> ws, we;
  ws.resize(n), we.resize(n);
#if MEGAMOE_REF_AVX2
  if (have_avx2()) {
    split_e4m3_avx2(w, n, ws.data(), we.data());
    return dot_avx2(ws.data(), we.data(), n, blk, a, m, part);
  }
#endif
  split_e4m3(w, n, ws.data(), we.data());
  dot_portable(ws.data(), we.data(), n, blk, a, m, part);
}

void dot_e4m3_mma_blocks_portable(const uint8_t* w, int n, int blk, const SplitRow* a, int m, float* part) {
  std::vector<int8_t> ws(n), we(n);
  split_e4m3(w, n, ws.data(), we.data());
  dot_portable(ws.data(), we.data(), n, blk, a, m, part);
}

}  // namespace megamoe::ref::detail
