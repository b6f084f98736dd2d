// The symmetric buffer of expert parallelism (docs/numerics.md §8): one layout that
// every rank allocates identically, so a peer reaches rank q's region X at
// base[q] + X.offset with plain NVLink loads and stores (the transport hands out
// the base table). It holds only what peers touch; each rank's receive ring is
// private (the fused kernel's workspace: MoeWorkspaceLayout with ep_ranks = R).
// Plain C++ (host and device) so the CPU tests check it.
//
// Flow of one forward on rank r (R ranks, E/R local experts each), all inside
// the fused kernel (fused_moe.cu, phase 0 and the combine):
//   1. r routes its T_r tokens (route kernels, global expert ids), quantizes them
//      into its x_q / x_scale and sorts its token slots by global expert (so by
//      owner, then local expert) into its `send_list` ((token, slot) packed, and
//      the routing weight);
//   2. after a barrier of r's CTAs, r writes into every owner q's `counts[r][*]`
//      how many slots go to each of q's local experts and where q's part of its
//      send_list starts, then raises q's `signals[kCounts][r]`;
//   3. owner q, once every source has signalled, lays the received rows out per
//      local expert (source-major inside an expert; the counts give every offset,
//      in q's ring and in each source's send_list) and pulls each row's FP8 data
//      and scales from the source's x_q / x_scale into its private ring. Row order
//      inside a segment changes no output byte: rows are independent in both GEMMs
//      and step 5 reduces by (token, slot). (Either before its tiles, after a barrier
//      of q's CTAs, or beside them: a tile waits for its rows, ep_pull_row below;
//      every pull still ends before q's last GEMM2 tile, so before step 4's signal);
//   4. q runs its experts (and the shared expert on its own tokens); each GEMM2
//      epilogue stores its BF16 rows straight into the source's
//      `combine[token][slot]` (overlapped with the other tiles); when all of q's
//      tiles are done q raises every source's `signals[kCombine][q]`;
//   5. r, once every owner has signalled, reduces combine[t][0..K-1] and its own
//      shared-expert row in slot order (the bytes of R = 1).
// Signals carry the forward's epoch (a counter in device memory that the routing
// kernel bumps per forward) rather than a flag, so a replayed CUDA graph never
// mistakes an old signal for a new one. Reuse is safe without more barriers: r
// rewrites x_q / send_list / counts at forward n + 1 only after it saw every
// owner's forward-n combine signal, which each owner raises after all its pulls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "megamoe/kernels/tile_schedule.h"  // largest_le
#include "megamoe/model/shape.h"
#include "megamoe/numerics/fp8.h"  // MEGAMOE_HD
#include "megamoe/weights/layout.h"

namespace megamoe::kernels {

struct EpLayout {
  // Signal kinds: one uint64 per (kind, peer rank).
  static constexpr int kCounts = 0;   // the source's counts for this rank are written
  static constexpr int kCombine = 1;  // the owner's results for this rank are written
  static constexpr int kSignalKinds = 2;

  int ranks = 0;          // R
  int local_experts = 0;  // E / R
  int max_tokens = 0;     // Tmax per rank
  int topk = 0;           // K
  int hidden = 0;         // H

  Region x_q;        // e4m3 [Tmax][H]          this rank's tokens (owners pull them)
  Region x_scale;    // f32  [Tmax][H/128]
  Region send_list;  // SendEntry [Tmax * K]   own slots by global expert
  Region counts;     // i32  [R source][E/R + 1] per local expert, then the send_list start
  Region combine;    // bf16 [Tmax][K][H]       results stored by the owners
  Region signals;    // u64  [kSignalKinds][R]  epoch-tagged, one per peer
  size_t total_bytes = 0;

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

  // One send_list entry: the packed (rank, token, slot) and the slot's routing
  // weight, read by the owner in one 8-byte load.
  struct SendEntry {
    int32_t src;
    float weight;
  };

  // Rows an owner can receive from R sources of at most Tmax tokens: a token sends
  // at most min(K, E/R) of its slots to one owner (its experts are distinct).
  static int64_t max_recv_rows(const MoeShape& s, int R, int max_tokens) {
    const int64_t el = s.experts / R, per_token = s.topk < el ? s.topk : el;
    return int64_t(R) * max_tokens * per_token;
  }

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
    if (max_recv_rows(s, R, max_tokens) > (int64_t(1) << 30)) fail("receive ring too large");
    const size_t T = size_t(max_tokens), K = size_t(s.topk), H = size_t(s.hidden);
    RegionPlanner plan(1024);
    plan.place(l.x_q, T * H);
    plan.place(l.x_scale, T * (H / 128) * 4);
    plan.place(l.send_list, T * K * sizeof(SendEntry));
    plan.place(l.counts, size_t(R) * (l.local_experts + 1) * 4);
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

// Where row `ring` of an owner's receive ring comes from, for a pull that walks the ring
// row by row (the fused kernel's pull beside the tiles; step 3 above). The owner's
// schedule: its routed experts el < El hold cnt[el] rows from row_off[el] on (non-
// decreasing; each segment padded to a multiple of 8 rows), source-major inside an
// expert. Pair p = el * R + src: ring_rel[p] its first row counted from the expert's
// first row, send[p] its first entry in source src's send_list. False for a padding row.
struct PullRow {
  int el;     // local expert
  int je;     // the row's place in the expert's segment (its token block: je / block_n)
  int src;    // source rank
  int entry;  // index in the source's send_list
};
MEGAMOE_HD bool ep_pull_row(const int* row_off, const int* cnt, const int* ring_rel, const int* send,
                                   int El, int R, int ring, PullRow& r) {
  r.el = largest_le(row_off, 0, El - 1, 1, ring);
  r.je = ring - row_off[r.el];
  if (r.je >= cnt[r.el]) return false;
  // The last source whose rows start at or before je (an empty source starts where the
  // next one does, so it is never the last such; source 0 starts at 0).
  const int* rel = ring_rel + r.el * R;
  r.src = 0;
  for (int s = 1; s < R; ++s)
    if (rel[s] <= r.je) r.src = s;
  r.entry = send[r.el * R + r.src] + r.je - rel[r.src];
  return true;
}

}  // namespace megamoe::kernels
