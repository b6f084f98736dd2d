// The symmetric buffer of expert parallelism (SPEC §8, issue 5): one layout that
// every rank allocates identically, so a peer reaches rank q's region X at
// base[q] + X.offset with plain NVLink loads and stores (the transport hands out
// the base table). Plain C++ (host and device) so the CPU tests check it.
//
// Flow of one forward on rank r (R ranks, E/R local experts each):
//   1. r quantizes its T_r tokens into x_q / x_scale and routes them (topk_*);
//   2. r sorts its token slots by (owner, local expert) into its own `send_list`
//      (packed token and slot), writes into every owner q's `counts[r][*]` how many
//      go to each of q's local experts and where q's part of its send_list starts,
//      then raises q's `signals[kCounts][r]`;
//   3. owner q, once every source has signalled, lays the received rows out per
//      local expert (source-major inside an expert; the counts give every offset,
//      in the owner's segments and in each source's send_list) and pulls each
//      row's FP8 data and scales from the source's x_q / x_scale into recv_x /
//      recv_scale; recv_src remembers (source, token, slot). Row order inside a
//      segment changes no output byte: rows are independent in both GEMMs and
//      step 5 reduces by (token, slot);
//   4. q runs its experts over recv_* and pushes each BF16 result row into the
//      source's `combine[token][slot]`, then raises the source's
//      `signals[kCombine][q]`;
//   5. r, once every owner has signalled, reduces combine[t][0..K-1] and its own
//      shared-expert row in slot order (the bytes of R = 1).
// Signals carry the forward's epoch (a counter the host bumps per launch) rather
// than a flag, so a replayed CUDA graph never mistakes an old signal for a new one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "megamoe/model/shape.h"
#include "megamoe/numerics/fp8.h"  // MEGAMOE_HD
#include "megamoe/weights/layout.h"

namespace megamoe::kernels {

struct EpLayout {
  // Signal kinds: one uint64 per (kind, peer rank).
  static constexpr int kCounts = 0;   // the source's counts for this rank are written
  static constexpr int kCombine = 1;  // the owner's results for this rank are written
  static constexpr int kSignalKinds = 2;
  static constexpr int kRowAlign = 8;  // expert segments of recv_* start on 8 rows (TMA boxes)

  int ranks = 0;          // R
  int local_experts = 0;  // E / R
  int max_tokens = 0;     // Tmax per rank
  int topk = 0;           // K
  int hidden = 0;         // H
  int recv_rows_cap = 0;  // rows a rank can receive: R * Tmax * min(K, E/R), padded per expert

  Region x_q;           // e4m3 [Tmax][H]               this rank's tokens (peers pull them)
  Region x_scale;       // f32  [Tmax][H/128]
  Region topk_ids;      // i32  [Tmax][K]               global expert ids
  Region topk_weights;  // f32  [Tmax][K]
  Region send_list;     // i32  [Tmax * K]              own slots by (owner, local expert), pack_src
  Region counts;        // i32  [R source][E/R + 1]     per local expert, then the send_list start
  Region recv_x;        // e4m3 [recv_rows_cap][H]      expert-sorted received rows
  Region recv_scale;    // f32  [H/128][recv_rows_cap]  (K-block-major, as TMA reads it)
  Region recv_weight;   // f32  [recv_rows_cap]         routing weight of each received row
  Region recv_src;      // i32  [recv_rows_cap]         (source rank, token, slot) packed
  Region combine;       // bf16 [Tmax][K][H]            results pushed back by the owners
  Region signals;       // u64  [kSignalKinds][R]       epoch-tagged, one per peer
  size_t total_bytes = 0;

  // Rows an expert segment of n rows takes in a receive ring.
  MEGAMOE_HD static int pad_rows(int n) { return (n + kRowAlign - 1) / kRowAlign * kRowAlign; }

  // Owner rank of global expert e.
  MEGAMOE_HD int owner(int e) const { return e / local_experts; }

  // (source, token, slot) of a received row, packed into one int32; the layout
  // checks at compute() that every field fits.
  static constexpr int kSlotBits = 5, kRankBits = 4;
  MEGAMOE_HD static int32_t pack_src(int rank, int token, int slot) {
    return (token << (kSlotBits + kRankBits)) | (rank << kSlotBits) | slot;
  }
  MEGAMOE_HD static int src_slot(int32_t v) { return v & ((1 << kSlotBits) - 1); }
  MEGAMOE_HD static int src_rank(int32_t v) { return (v >> kSlotBits) & ((1 << kRankBits) - 1); }
  MEGAMOE_HD static int src_token(int32_t v) { return v >> (kSlotBits + kRankBits); }

  // The layout for R ranks of shape `s` (all experts, E) with at most `max_tokens`
  // tokens per rank. Errors name the limit that does not hold.
  static EpLayout compute(const MoeShape& s, int R, int max_tokens) {
    s.validate();
    auto fail = [](const std::string& m) { throw std::invalid_argument("expert-parallel layout: " + m); };
    if (R < 1) fail("ranks must be >= 1 (got " + std::to_string(R) + ")");
    if (R > (1 << kRankBits))
      fail("at most " + std::to_string(1 << kRankBits) + " ranks (got " + std::to_string(R) + ")");
    if (s.experts % R != 0)
      fail(std::to_string(s.experts) + " experts do not split evenly over " + std::to_string(R) + " ranks");
    if (s.topk > (1 << kSlotBits)) fail("top-k above " + std::to_string(1 << kSlotBits));
    if (max_tokens < 1) fail("max tokens per rank must be >= 1 (got " + std::to_string(max_tokens) + ")");
    if (int64_t(max_tokens) >= (int64_t(1) << (31 - kSlotBits - kRankBits)))
      fail("max tokens per rank above " + std::to_string((1 << (31 - kSlotBits - kRankBits)) - 1));
    if (s.hidden % 128 != 0) fail("H % 128 != 0");
    EpLayout l;
    l.ranks = R;
    l.local_experts = s.experts / R;
    l.max_tokens = max_tokens;
    l.topk = s.topk;
    l.hidden = s.hidden;
    // A token sends at most min(K, E/R) of its slots to one owner (distinct experts).
    const int64_t per_token = s.topk < l.local_experts ? s.topk : l.local_experts;
    const int64_t rows = int64_t(R) * max_tokens * per_token + int64_t(kRowAlign) * l.local_experts;
    if (rows > (int64_t(1) << 30)) fail("receive buffer of " + std::to_string(rows) + " rows is too large");
    l.recv_rows_cap = int((rows + 127) / 128 * 128);
    const size_t T = size_t(max_tokens), K = size_t(s.topk), H = size_t(s.hidden),
                 Rc = size_t(l.recv_rows_cap);
    RegionPlanner plan(1024);  // TMA boxes and 128-byte swizzled rows start 1024-byte aligned
    plan.place(l.x_q, T * H);
    plan.place(l.x_scale, T * (H / 128) * 4);
    plan.place(l.topk_ids, T * K * 4);
    plan.place(l.topk_weights, T * K * 4);
    plan.place(l.send_list, T * K * 4);
    plan.place(l.counts, size_t(R) * (l.local_experts + 1) * 4);
    plan.place(l.recv_x, Rc * H);
    plan.place(l.recv_scale, (H / 128) * Rc * 4);
    plan.place(l.recv_weight, Rc * 4);
    plan.place(l.recv_src, Rc * 4);
    plan.place(l.combine, T * K * H * 2);
    plan.place(l.signals, size_t(kSignalKinds) * R * 8);
    l.total_bytes = plan.total();
    return l;
  }

  // Checked on the host before every launch: a batch over the capacity is an error,
  // never a silent drop.
  void check_tokens(int rank, int tokens) const {
    if (tokens < 0 || tokens > max_tokens)
      throw std::invalid_argument("rank " + std::to_string(rank) + ": " + std::to_string(tokens) +
                                  " tokens exceed the expert-parallel capacity of " +
                                  std::to_string(max_tokens) + " tokens per rank");
  }
};

}  // namespace megamoe::kernels
