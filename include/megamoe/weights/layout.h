// The weight layout of one MoE layer: the one struct the loader fills, the CPU
// reference reads and the CUDA kernels take (host or device memory alike).
//
// The layout is the checkpoint's own (docs/numerics.md §2, §7), stacked per expert, so a
// checkpoint tensor lands in one contiguous range and an in-place reload is a
// plain copy:
//   w13        E4M3 [E][2I][H]      rows [0, I) = gate_proj, rows [I, 2I) = up_proj
//   w13_scale  F32  [E][2*ceil(I/128)][ceil(H/128)]   gate block-rows, then up block-rows
//   w2         E4M3 [E][H][I]       down_proj
//   w2_scale   F32  [E][ceil(H/128)][ceil(I/128)]
//   shared_*   the same for the shared MLP with intermediate Is = S*I (absent if S = 0)
//   router     BF16 or F32 [E][H]   gate.weight
//   bias       F32  [E]             gate.e_score_correction_bias (absent if unused)
// Every region starts on a 256-byte boundary (TMA needs 16, vector loads 16).
// NOTE: the Hopper kernel interleaves gate/up rows in shared memory with a
// multi-dimensional TMA box; the memory layout stays the checkpoint's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "megamoe/model/shape.h"

namespace megamoe {

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }
constexpr int kWeightBlock = 128;  // block-FP8 scale granularity (128x128)

struct Region {
  size_t offset = 0;
  size_t bytes = 0;
};

// Lays regions out one after another in one allocation, each starting on an
// `align`-byte boundary (the one offset computation every buffer layout uses).
class RegionPlanner {
 public:
  explicit RegionPlanner(size_t align) : align_(align) {}
  void place(Region& r, size_t bytes) {
    cursor_ = round(cursor_);
    r.offset = cursor_;
    r.bytes = bytes;
    cursor_ += bytes;
  }
  size_t total() const { return round(cursor_); }

 private:
  size_t round(size_t v) const { return (v + align_ - 1) / align_ * align_; }
  size_t align_;
  size_t cursor_ = 0;
};

// The routed experts a layout holds: [first, first + count) of the layer's E. An
// expert-parallel rank's weights hold only its own experts (plus the shared expert,
// and the whole router: every rank routes its tokens over all E).
struct ExpertRange {
  int first = 0;
  int count = 0;
  int end() const { return first + count; }
  bool contains(int e) const { return e >= first && e < end(); }
  bool contains(ExpertRange r) const { return r.first >= first && r.end() <= end(); }
  bool operator==(ExpertRange r) const { return first == r.first && count == r.count; }
  std::string text() const;  // "[first, end)"
};

struct MoeWeightLayout {
  Region w13, w13_scale, w2, w2_scale;  // experts.count experts, from experts.first
  Region shared_w13, shared_w13_scale, shared_w2, shared_w2_scale;
  Region router, bias;  // all E experts
  ExpertRange experts;
  size_t total_bytes = 0;

  // Sizes of the scale grids (in blocks) for one expert of intermediate `inter`.
  static int w13_scale_rows(int inter) { return 2 * ceil_div(inter, kWeightBlock); }
  static int hidden_blocks(int hidden) { return ceil_div(hidden, kWeightBlock); }
  static int inter_blocks(int inter) { return ceil_div(inter, kWeightBlock); }

  // Every routed expert of the layer (a whole layer: what the single-device layer,
  // the CPU reference and the checkpoint writer take).
  bool whole(const MoeShape& s) const { return experts == ExpertRange{0, s.experts}; }
  // "experts [a, b) of E" when not whole (for error messages).
  std::string experts_text(const MoeShape& s) const;

  static MoeWeightLayout compute(const MoeShape& s);  // every expert
  // Only the routed experts of `r` (a non-empty range inside [0, E); checked).
  static MoeWeightLayout compute(const MoeShape& s, ExpertRange r);
};

// One contiguous byte range to copy from one layout's buffer into another's.
struct RegionCopy {
  size_t src_offset = 0, dst_offset = 0, bytes = 0;
};
// The copies that fill a layout `to` from a layout `from` of the same shape whose
// experts include all of `to`'s (an expert-parallel rank's upload from the whole
// layer): each routed region's sub-range, the shared expert, router and bias whole.
// Throws std::invalid_argument when `from` lacks some of `to`'s experts.
std::vector<RegionCopy> region_copies(const MoeWeightLayout& from, const MoeWeightLayout& to);

// Typed pointers into one layer's weights (host or device). Read-only for the
// compute paths; the loader writes through the same offsets.
struct MoeWeightsView {
  const uint8_t* w13 = nullptr;
  const float* w13_scale = nullptr;
  const uint8_t* w2 = nullptr;
  const float* w2_scale = nullptr;
  const uint8_t* shared_w13 = nullptr;
  const float* shared_w13_scale = nullptr;
  const uint8_t* shared_w2 = nullptr;
  const float* shared_w2_scale = nullptr;
  const void* router = nullptr;  // uint16_t (bf16) or float by MoeShape::router_dtype
  const float* bias = nullptr;

  static MoeWeightsView at(const void* base, const MoeWeightLayout& l, const MoeShape& s);
  // The same view with the layout's routed expert e (counted from its
  // experts.first) as its expert 0 (one expert's weights and scales; an
  // expert-parallel rank's first local expert in a view of the whole layer).
  MoeWeightsView from_expert(const MoeShape& s, int e) const;
};

}  // namespace megamoe
