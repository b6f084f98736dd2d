// Host-side tensor quantization (docs/numerics.md §2, §4, §5): per-token activation groups,
// block-FP8 weight quantization and dequantization, the Blackwell MXFP8 format and the 128x128
// block-FP8 -> MXFP8 requantization with its error report.
//
// The scalar rules live in fp8.h / act_quant.h and are shared with the CUDA
// kernels; this file only loops over tensors with them, so the CPU reference
// and the kernels cannot disagree about a single element.
//
// All functions take raw row-major pointers, allocate nothing per element and
// are reentrant: a caller may split a tensor into row slabs and run them on
// several threads (for block scales, a slab must start on a multiple of 128
// rows; see RequantReport::operator+= to combine the reports).
#pragma once

#include <cfloat>
#include <cstdint>
#include <string_view>

#include "megamoe/numerics/act_quant.h"
#include "megamoe/numerics/fp8.h"

namespace megamoe::num {

// Checkpoint weight scales: one float32 per 128x128 block (weights/layout.h
// names the same number kWeightBlock for its own grids).
constexpr int kQuantBlock = 128;
constexpr int kMxGroup = 32;  // MXFP8: one UE8M0 byte per 1x32 group

// ---- activations (Hopper rule) ----

// Per row, per `group` consecutive columns (the last group may be partial):
// s = act_scale(max |x|), q = act_quant(x, 1/s).
// q is [rows][cols]; scales is [rows][ceil(cols/group)] float32.
// NOTE: NaN inputs do not take part in the amax (fmaxf semantics, like the
// kernels) and encode to the E4M3 NaN code.
void quantize_rows(const float* x, int rows, int cols, int group, uint8_t* q, float* scales);
void quantize_rows(const bf16_t* x, int rows, int cols, int group, uint8_t* q, float* scales);

// ---- weights (checkpoint block FP8) ----

// The checkpoint rule (docs/numerics.md §2), for `batch` matrices w [batch][rows][cols]:
// per 128x128 block (edge blocks may be partial), s = amax / 448 in float32 (1 for an
// all-zero block) and q = e4m3_encode(w / s) (IEEE division; nearest even, saturating).
// q is [batch][rows][cols]; scale_inv is [batch][ceil(rows/128)][ceil(cols/128)].
// Throws std::invalid_argument naming the first value that is not finite (no scale can
// carry it) or a negative size.
void quantize_block_fp8(const float* w, int64_t batch, int rows, int cols, uint8_t* q, float* scale_inv);

// out[r][c] = e4m3(q[r][c]) * scale_inv[r/128][c/128] (float32 multiply), with
// scale_inv shaped [ceil(rows/128)][ceil(cols/128)]; edge blocks may be partial.
void dequant_block(const uint8_t* q, const float* scale_inv, int rows, int cols, float* out);

// ---- MXFP8 (Blackwell format: E4M3 with a UE8M0 scale per 1x32) ----

// A positive scale rounded up to a power of two, as a UE8M0 byte: the float's
// exponent field, plus one if any mantissa bit is set, clamped to [1, 254] so
// the byte is never NaN (255) and never the subnormal 2^-127 (0). The sign is
// ignored; a non-finite s clamps to 254.
uint8_t ue8m0_round_up(float s);

// 2^(b-127); the same conversion as ue8m0_decode (one definition, two names:
// this one reads better next to ue8m0_round_up).
inline float ue8m0_to_float(uint8_t b) { return ue8m0_decode(b); }

// Per row, per 32 columns (the last group may be partial):
// b = ue8m0_round_up(act_scale(amax)), q = act_quant(x, 1/2^(b-127)).
// q is [rows][cols]; sf is [rows][ceil(cols/32)].
void quantize_mxfp8(const float* x, int rows, int cols, uint8_t* q, uint8_t* sf);

// ---- requantization 128x128 block FP8 -> MXFP8 (docs/numerics.md §5) ----

struct RequantReport {
  double rel_l2 = 0.0;       // ||mx - blk|| / ||blk|| over the dequantized tensors (0 when both are 0)
  double max_abs_err = 0.0;  // max |mx - blk|
  bool all_pow2 = true;      // every source scale the tensor uses is a power of two
  int64_t elements = 0;
  // The two sums behind rel_l2, kept so reports of row slabs can be combined.
  double sum_sq_err = 0.0;
  double sum_sq_ref = 0.0;

  // Combine the report of another slab of the same tensor into this one.
  RequantReport& operator+=(const RequantReport& o);
};

// q, scale_inv: the checkpoint tensor [rows][cols] and its [ceil(rows/128)]
// [ceil(cols/128)] float32 scales. Writes q_out [rows][cols] (E4M3) and
// sf_out [rows][cols/32] (UE8M0).
// Throws std::invalid_argument when cols % 32 != 0 (or a size is negative), and
// std::domain_error when a source value is not finite or a group's scale falls
// outside the UE8M0 range: the format cannot carry either.
// NOTE: does not warn about non-power-of-two scales by itself; the caller
// (loader) decides, with warn_non_pow2_once below.
RequantReport requant_block_to_mxfp8(const uint8_t* q, const float* scale_inv, int rows, int cols,
                                     uint8_t* q_out, uint8_t* sf_out);

// True when s is a positive finite power of two (normal or subnormal).
bool is_pow2_scale(float s);

// True when s can be a block scale (amax / 448 of a block of finite weights): >= 0, and
// 448 * s finite, so that no dequantized weight (docs/numerics.md §2: fp8(q) * scale_inv in float32)
// overflows. A NaN, an infinity, a negative scale or one above ~7.6e35 is a corrupt
// checkpoint (the loader refuses it, inspect reports it).
inline bool is_valid_block_scale(float s) { return s >= 0.0f && s * 448.0f <= FLT_MAX; }

// Prints one warning per process to stderr, naming `what` and the measured
// rel_l2; returns true the one time it printed, false afterwards. Thread-safe.
bool warn_non_pow2_once(std::string_view what, double rel_l2);

// NOTE: deliberately not named `testing`: tests that say `using namespace
// megamoe::num` would make GoogleTest's ::testing ambiguous.
namespace test_hooks {
// Re-arms warn_non_pow2_once (tests only).
void reset_warn_once();
}  // namespace test_hooks

}  // namespace megamoe::num
