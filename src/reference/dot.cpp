// The E4M3 block dot products under both GEMMs of the kernel-faithful reference,
// computed as the Hopper tensor cores compute them (num::fp8_mma_step is the
// definition; tests/cpu/test_layer.cpp checks this path against it bit for bit).
// The codes are split once into signed significands and exponent fields and a
// chain keeps its accumulator as an integer and an exponent, so a k-step is two
// integer passes over its 32 products: the largest exponent, then the truncated
// terms. The same source is compiled for AVX2 (picked at run time), where the
// compiler vectorizes the passes; both builds give the same bits.
#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

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

}  // namespace

void split_e4m3(const uint8_t* q, size_t n, int8_t* sig, int8_t* exp) {
  for (size_t i = 0; i < n; ++i) sig[i] = kSplit.sig[q[i]], exp[i] = kSplit.exp[q[i]];
}

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

__attribute__((always_inline)) inline int trunc_shift(int v, int down) {  // v / 2^down toward zero
  const int mag = (v < 0 ? -v : v) >> down;
  return v < 0 ? -mag : mag;
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
  if (c.s != 0) e = std::max(e, c.e - kBits + int(std::bit_width(unsigned(c.s < 0 ? -c.s : c.s))));
  if (e <= kZeroSum) return;  // no nonzero product and c == 0
  int s = 0;
  for (int i = 0; i < n; ++i) {
    const int p = int(ws[i]) * int(as[i]);
    const int down = std::min(e - es[i], 31);
    const int mag = ((p < 0 ? -p : p) << 7) >> down;
    s += p < 0 ? -mag : mag;
  }
  if (c.s != 0) s += c.e >= e ? c.s * (1 << (c.e - e)) : trunc_shift(c.s, e - c.e);
  const unsigned mag = unsigned(s < 0 ? -s : s);
  const int drop = std::max(int(std::bit_width(mag)) - kBits, 0);
  c.s = s < 0 ? -int((mag >> drop) << drop) : int((mag >> drop) << drop);
  c.e = e;
}

__attribute__((always_inline)) inline void dot_body(const int8_t* ws, const int8_t* we, int n, int blk,
                                                    const SplitRow* a, int m, float* part) {
  const int nb = (n + blk - 1) / blk;
  for (int j = 0; j < m; ++j) {
    for (int b = 0; b < nb; ++b) {
      const int c0 = b * blk, c1 = std::min(n, c0 + blk);
      Acc c;
      int k = c0;
      for (; k + num::kMmaStepK <= c1; k += num::kMmaStepK)
        mma_step_split<num::kMmaStepK>(c, ws + k, we + k, a[j].sig + k, a[j].exp + k, num::kMmaStepK);
      if (k < c1) mma_step_split<0>(c, ws + k, we + k, a[j].sig + k, a[j].exp + k, c1 - k);
      part[size_t(j) * nb + b] = c.nan ? NAN : float(std::ldexp(double(c.s), c.e - num::kMmaFracBits));
    }
  }
}

void dot_portable(const int8_t* ws, const int8_t* we, int n, int blk, const SplitRow* a, int m, float* part) {
  dot_body(ws, we, n, blk, a, m, part);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MEGAMOE_REF_AVX2 1
__attribute__((target("avx2"))) void dot_avx2(const int8_t* ws, const int8_t* we, int n, int blk,
                                              const SplitRow* a, int m, float* part) {
  dot_body(ws, we, n, blk, a, m, part);
}
bool have_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2");
  return ok;
}
#endif

}  // namespace

void dot_e4m3_mma_blocks(const uint8_t* w, int n, int blk, const SplitRow* a, int m, float* part) {
  thread_local std::vector<int8_t> ws, we;
  ws.resize(n), we.resize(n);
  split_e4m3(w, n, ws.data(), we.data());
#if MEGAMOE_REF_AVX2
  if (have_avx2()) return dot_avx2(ws.data(), we.data(), n, blk, a, m, part);
#endif
  dot_portable(ws.data(), we.data(), n, blk, a, m, part);
}

}  // namespace megamoe::ref::detail
