// Tensor loops over the scalar FP8 rules of fp8.h / act_quant.h (docs/numerics.md §2, §4, §5).
// Nothing here defines a rounding formula of its own: every element goes through
// e4m3_encode / act_scale / act_quant, which the kernels share. The one scale formula here
// is the checkpoint writer's (amax / 448 per 128x128 block), which no kernel computes.
#include "megamoe/numerics/quant.h"

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <vector>

namespace megamoe::num {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Every E4M3 byte decoded once: a table read instead of the bit assembly in
// the multi-GB weight loops.
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = e4m3_decode(uint8_t(b));
    return t;
  }();
  return table;
}

void check_shape(const char* fn, int rows, int cols) {
  if (rows < 0 || cols < 0)
    throw std::invalid_argument(fmt::format("{}: negative shape [{}, {}]", fn, rows, cols));
}

// NOTE: `v > m ? v : m` skips NaN v (the comparison is false), which is the
// fmaxf behaviour the kernels' amax reductions have.
inline float amax_of(const float* x, int n) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float v = std::fabs(x[i]);
    m = v > m ? v : m;
  }
  return m;
}

void quantize_group(const float* x, int n, uint8_t* q, float* scale) {
  const float s = act_scale(amax_of(x, n));
  const float inv = 1.0f / s;
  for (int i = 0; i < n; ++i) q[i] = act_quant(x[i], inv);
  *scale = s;
}

[[noreturn]] void throw_non_finite(const uint8_t* q, float s, int64_t r, int64_t c0) {
  int i = 0;
  while (i < kMxGroup - 1 && std::fabs(e4m3_decode(q[i]) * s) <= FLT_MAX) ++i;
  throw std::domain_error(fmt::format(
      "requant_block_to_mxfp8: non-finite value at [{}, {}] (code 0x{:02x}, scale {})", r, c0 + i, q[i], s));
}

void check_group(const char* fn, int group) {
  if (group <= 0) throw std::invalid_argument(fmt::format("{}: group must be positive, got {}", fn, group));
}

}  // namespace

// ---- activations ----

void quantize_rows(const float* x, int rows, int cols, int group, uint8_t* q, float* scales) {
  check_shape("quantize_rows", rows, cols);
  check_group("quantize_rows", group);
  const int64_t groups = ceil_div(cols, group);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    for (int64_t g = 0; g < groups; ++g) {
      const int c0 = int(g * group);
      const int n = cols - c0 < group ? cols - c0 : group;
      quantize_group(xr + c0, n, q + r * cols + c0, scales + r * groups + g);
    }
  }
}

void quantize_rows(const bf16_t* x, int rows, int cols, int group, uint8_t* q, float* scales) {
  check_shape("quantize_rows", rows, cols);
  check_group("quantize_rows", group);
  const int64_t groups = ceil_div(cols, group);
  // One row of scratch per call, not per element.
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    const bf16_t* xr = x + r * cols;
    for (int c = 0; c < cols; ++c) row[size_t(c)] = bf16_decode(xr[c]);
    quantize_rows(row.data(), 1, cols, group, q + r * cols, scales + r * groups);
  }
}

// ---- weights ----

void dequant_block(const uint8_t* q, const float* scale_inv, int rows, int cols, float* out) {
  check_shape("dequant_block", rows, cols);
  const auto& lut = e4m3_table();
  const int64_t bcols = ceil_div(cols, kQuantBlock);
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = scale_inv + (r / kQuantBlock) * bcols;
    const uint8_t* qr = q + r * cols;
    float* o = out + r * cols;
    for (int64_t b = 0; b < bcols; ++b) {
      const float s = srow[b];
      const int64_t c1 = (b + 1) * kQuantBlock < cols ? (b + 1) * kQuantBlock : cols;
      for (int64_t c = b * kQuantBlock; c < c1; ++c) o[c] = lut[qr[c]] * s;
    }
  }
}

void quantize_block_fp8(const float* w, int64_t batch, int rows, int cols, uint8_t* q, float* scale_inv) {
  check_shape("quantize_block_fp8", rows, cols);
  if (batch < 0) throw std::invalid_argument(fmt::format("quantize_block_fp8: negative batch {}", batch));
  const int64_t brows = ceil_div(rows, kQuantBlock), bcols = ceil_div(cols, kQuantBlock);
  const int64_t plane = int64_t(rows) * cols;
  for (int64_t b = 0; b < batch; ++b) {
    const float* wm = w + b * plane;
    uint8_t* qm = q + b * plane;
    for (int64_t bi = 0; bi < brows; ++bi) {
      const int64_t r0 = bi * kQuantBlock, r1 = std::min<int64_t>(rows, r0 + kQuantBlock);
      for (int64_t bk = 0; bk < bcols; ++bk) {
        const int64_t c0 = bk * kQuantBlock, c1 = std::min<int64_t>(cols, c0 + kQuantBlock);
        float amax = 0.0f;
        bool finite = true;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) {
            const float v = wm[r * cols + c];
            finite &= std::isfinite(v);
            amax = std::fmax(amax, std::fabs(v));
          }
        if (!finite)
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t c = c0; c < c1; ++c)
              if (!std::isfinite(wm[r * cols + c]))
                throw std::invalid_argument(
                    fmt::format("quantize_block_fp8: w[{}][{}][{}] = {}: expected finite values (no block "
                                "scale carries it)",
                                b, r, c, wm[r * cols + c]));
        const float s = amax > 0.0f ? amax / kE4M3Max : 1.0f;
        scale_inv[(b * brows + bi) * bcols + bk] = s;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) qm[r * cols + c] = e4m3_encode(wm[r * cols + c] / s);
      }
    }
  }
}

// ---- MXFP8 ----

uint8_t ue8m0_round_up(float s) {
  const uint32_t u = float_bits(s) & 0x7FFFFFFFu;
  int e = int(u >> 23);
  if (u & 0x7FFFFFu) ++e;  // not a power of two (or subnormal): next power up
  return uint8_t(e < 1 ? 1 : (e > 254 ? 254 : e));
}

void quantize_mxfp8(const float* x, int rows, int cols, uint8_t* q, uint8_t* sf) {
  check_shape("quantize_mxfp8", rows, cols);
  const int64_t groups = ceil_div(cols, kMxGroup);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    uint8_t* qr = q + r * cols;
    for (int64_t g = 0; g < groups; ++g) {
      const int c0 = int(g * kMxGroup);
      const int n = cols - c0 < kMxGroup ? cols - c0 : kMxGroup;
      const uint8_t b = ue8m0_round_up(act_scale(amax_of(xr + c0, n)));
      // NOTE: 1/2^k is exact for every b in [1, 254] (2^-127 is a float32
      // subnormal), so multiplying by it is the same as dividing by the scale.
      const float inv = 1.0f / ue8m0_to_float(b);
      for (int i = 0; i < n; ++i) qr[c0 + i] = act_quant(xr[c0 + i], inv);
      sf[r * groups + g] = b;
    }
  }
}

// ---- requantization ----

RequantReport& RequantReport::operator+=(const RequantReport& o) {
  sum_sq_err += o.sum_sq_err;
  sum_sq_ref += o.sum_sq_ref;
  max_abs_err = o.max_abs_err > max_abs_err ? o.max_abs_err : max_abs_err;
  all_pow2 = all_pow2 && o.all_pow2;
  elements += o.elements;
  rel_l2 = sum_sq_ref > 0.0 ? std::sqrt(sum_sq_err / sum_sq_ref) : (sum_sq_err > 0.0 ? INFINITY : 0.0);
  return *this;
}

RequantReport requant_block_to_mxfp8(const uint8_t* q, const float* scale_inv, int rows, int cols,
                                     uint8_t* q_out, uint8_t* sf_out) {
  check_shape("requant_block_to_mxfp8", rows, cols);
  if (cols % kMxGroup != 0)
    throw std::invalid_argument(fmt::format(
        "requant_block_to_mxfp8: tensor [{}, {}]: MXFP8 needs the column count to be a multiple of {}", rows,
        cols, kMxGroup));
  const auto& lut = e4m3_table();
  const int64_t bcols = ceil_div(cols, kQuantBlock);
  const int64_t groups = cols / kMxGroup;
  RequantReport rep;
  rep.elements = int64_t(rows) * cols;

  for (int64_t i = 0, n = ceil_div(rows, kQuantBlock) * bcols; i < n; ++i)
    rep.all_pow2 = rep.all_pow2 && is_pow2_scale(scale_inv[i]);

  double err_sq = 0.0, ref_sq = 0.0, max_err = 0.0;
  float real[kMxGroup];
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = scale_inv + (r / kQuantBlock) * bcols;
    const uint8_t* qr = q + r * cols;
    uint8_t* qo = q_out + r * cols;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * kMxGroup;
      // A 32-column group never straddles two 128-column blocks (32 | 128).
      const float s = srow[c0 / kQuantBlock];
      // Step 1-2: real values (float32 multiply) and their amax.
      float amax = 0.0f;
      bool finite = true;
      for (int i = 0; i < kMxGroup; ++i) {
        real[i] = lut[qr[c0 + i]] * s;
        const float a = std::fabs(real[i]);
        finite &= a <= FLT_MAX;  // false for inf and NaN; no branch in the loop
        amax = a > amax ? a : amax;
      }
      if (!finite) throw_non_finite(qr + c0, s, r, c0);
      amax = amax > 1e-30f ? amax : 1e-30f;
      // Step 3: the serving engine's formula, in float32, bit for bit.
      // NOTE: keep log2f of the quotient; a bit-trick exponent differs when
      // amax/448 is just above a power of two and log2f rounds down to it.
      const float sf = std::exp2f(std::ceil(std::log2f(amax / kE4M3Max)));
      const uint32_t sfb = float_bits(sf);
      if ((sfb & 0x7FFFFFu) != 0 || (sfb >> 23) < 1 || (sfb >> 23) > 254)
        throw std::domain_error(fmt::format(
            "requant_block_to_mxfp8: group scale {} at row {}, columns [{}, {}) is not a UE8M0 power of two",
            sf, r, c0, c0 + kMxGroup));
      sf_out[r * groups + g] = uint8_t(sfb >> 23);
      // Step 4: re-encode. NOTE: multiplying by 1/sf equals dividing by sf
      // bit for bit: sf is 2^k with k in [-126, 127], so 1/sf is exact and
      // both are the correctly rounded value of real * 2^-k. (Division is the
      // slowest instruction in this loop.)
      const float inv = 1.0f / sf;
      for (int i = 0; i < kMxGroup; ++i) qo[c0 + i] = e4m3_encode(real[i] * inv);
      // Error against the block-FP8 real values, in double.
      double ge = 0.0, gr = 0.0;
      for (int i = 0; i < kMxGroup; ++i) {
        const double d = double(lut[qo[c0 + i]]) * double(sf) - double(real[i]);
        ge += d * d;
        gr += double(real[i]) * double(real[i]);
        const double ad = std::fabs(d);
        max_err = ad > max_err ? ad : max_err;
      }
      err_sq += ge;
      ref_sq += gr;
    }
  }
  rep.sum_sq_err = err_sq;
  rep.sum_sq_ref = ref_sq;
  rep.max_abs_err = max_err;
  rep.rel_l2 = ref_sq > 0.0 ? std::sqrt(err_sq / ref_sq) : (err_sq > 0.0 ? INFINITY : 0.0);
  return rep;
}

bool is_pow2_scale(float s) {
  const uint32_t u = float_bits(s);
  if (u & 0x80000000u) return false;  // negative (or -0)
  const uint32_t e = u >> 23, m = u & 0x7FFFFFu;
  if (e == 0) return m != 0 && (m & (m - 1)) == 0;  // subnormal: a single bit
  return e != 255 && m == 0;                        // normal: no mantissa bits; not inf/NaN
}

// ---- the once-per-process warning ----

namespace {
std::atomic<bool> g_warned{false};
}  // namespace

bool warn_non_pow2_once(std::string_view what, double rel_l2) {
  // exchange: exactly one caller sees false, even when loader threads race.
  if (g_warned.exchange(true)) return false;
  fmt::print(stderr,
             "megamoe: warning: {}: block-FP8 weight scales are not all powers of two; requantizing to "
             "MXFP8 rounds every element a second time (relative L2 error {:.3f}%)\n",
             what, rel_l2 * 100.0);
  return true;
}

namespace test_hooks {
void reset_warn_once() { g_warned.store(false); }
}  // namespace test_hooks

}  // namespace megamoe::num
