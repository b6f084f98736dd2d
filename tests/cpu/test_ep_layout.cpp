// The expert-parallel symmetric buffer layout (include/megamoe/kernels/ep_layout.h):
// regions disjoint and aligned, the receive-ring bound holds the worst routing, the
// packed row sources round-trip, and every limit is a clear error.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "megamoe/kernels/ep_layout.h"
#if defined(MEGAMOE_HAVE_CUDA)
#include "megamoe/kernels/fused_moe.h"  // MoeWorkspaceLayout (host code of the CUDA library)
#endif

namespace megamoe {
namespace {

using kernels::EpLayout;

std::vector<Region> regions(const EpLayout& l) {
  return {l.x_q, l.x_scale, l.send_list, l.counts, l.combine, l.signals};
}

TEST(EpLayout, RegionsAreDisjointAlignedAndSized) {
  for (const char* name : {"glm-5", "glm-5.3-flash", "deepseek-v3"}) {
    const MoeShape& s = find_preset(name).shape;
    for (int R : {1, 2, 4, 8}) {
      for (int T : {1, 37, 256, 4096}) {
        const EpLayout l = EpLayout::compute(s, R, T);
        std::vector<Region> r = regions(l);
        std::sort(r.begin(), r.end(), [](const Region& a, const Region& b) { return a.offset < b.offset; });
        for (size_t i = 0; i < r.size(); ++i) {
          EXPECT_EQ(r[i].offset % 1024, 0u) << name << " R=" << R << " region " << i;
          EXPECT_GT(r[i].bytes, 0u);
          if (i + 1 < r.size()) {
            EXPECT_LE(r[i].offset + r[i].bytes, r[i + 1].offset) << "regions overlap";
          }
        }
        EXPECT_LE(r.back().offset + r.back().bytes, l.total_bytes);
        // Sizes from the definitions.
        const size_t H = s.hidden, K = s.topk;
        EXPECT_EQ(l.x_q.bytes, size_t(T) * H);
        EXPECT_EQ(l.combine.bytes, size_t(T) * K * H * 2);
        EXPECT_EQ(l.x_scale.bytes, size_t(T) * (H / 128) * 4);
        EXPECT_EQ(l.send_list.bytes, size_t(T) * K * 8);
        EXPECT_EQ(l.counts.bytes, size_t(R) * (s.experts / R + 1) * 4);
        EXPECT_EQ(l.signals.bytes, size_t(EpLayout::kSignalKinds) * R * 8);
      }
    }
  }
}

// Rows each owner receives for random routings, including the worst case (every
// token of every rank sends min(K, E/R) slots to one owner), against the bound the
// owner's receive ring is sized by (MoeWorkspaceLayout with ep_ranks = R).
TEST(EpLayout, ReceiveBoundHoldsTheWorstRouting) {
  const MoeShape& s = find_preset("glm-5").shape;
  std::mt19937 rng(7);
  for (int R : {1, 2, 8, 16}) {
    const int T = 300;
    const EpLayout l = EpLayout::compute(s, R, T);
    const int El = l.local_experts;
    for (int trial = 0; trial < 3; ++trial) {
      std::vector<int64_t> rows(R, 0), per_expert(s.experts, 0);
      for (int src = 0; src < R; ++src)
        for (int t = 0; t < T; ++t) {
          std::vector<int> ids(s.experts);
          std::iota(ids.begin(), ids.end(), 0);
          if (trial == 0) {
            // all slots on rank 0's experts (as many distinct ones as there are)
            std::shuffle(ids.begin(), ids.begin() + El, rng);
          } else {
            std::shuffle(ids.begin(), ids.end(), rng);
          }
          for (int k = 0; k < s.topk; ++k) ++per_expert[ids[k]];
        }
      for (int e = 0; e < s.experts; ++e) rows[l.owner(e)] += per_expert[e];
      const int64_t bound = EpLayout::max_recv_rows(s, R, T);
      for (int q = 0; q < R; ++q) EXPECT_LE(rows[q], bound) << "R=" << R << " owner " << q;
      if (trial == 0) {
        EXPECT_EQ(rows[0], bound) << "the worst routing reaches the bound";
      }
    }
  }
}

#if defined(MEGAMOE_HAVE_CUDA)
// The owner's private ring (MoeWorkspaceLayout with ep_ranks = R) holds the segments
// the fused kernel lays out (fused_moe_device.cuh build_sched): the shared expert's rows of the
// own tokens first, then every local expert's received rows, each padded to 8 rows; and
// its completion counters cover every (expert, 8-row token block), for the worst
// routings (all slots on this owner, spread to maximize the padding) and random ones.
TEST(EpLayout, OwnerRingHoldsTheKernelsSegments) {
  for (const char* name : {"glm-5", "glm-5.3-flash", "deepseek-v3"}) {
    const MoeShape& s = find_preset(name).shape;
    std::mt19937 rng(11);
    for (int R : {1, 2, 8}) {
      for (int T : {1, 37, 256}) {
        const kernels::MoeWorkspaceLayout ws = kernels::MoeWorkspaceLayout::compute(s, T, R);
        const int El = s.experts / R, sh = s.has_shared() ? 1 : 0;
        ASSERT_EQ(ws.local_experts, El);
        for (int trial = 0; trial < 3; ++trial) {
          std::vector<int64_t> cnt(El, 0);
          const int per_token = std::min(s.topk, El);
          for (int src = 0; src < R; ++src)
            for (int t = 0; t < T; ++t) {
              std::vector<int> ids(El);
              std::iota(ids.begin(), ids.end(), 0);
              std::shuffle(ids.begin(), ids.end(), rng);
              // trial 0: every slot here; 1: every slot here, few experts hit; 2: half the slots
              const int n = trial == 2 ? per_token / 2 : per_token;
              for (int k = 0; k < n; ++k) ++cnt[trial == 1 ? k : ids[k]];
            }
          auto pad = [](int64_t n) { return (n + 7) / 8 * 8; };
          int64_t rows = sh ? pad(T) : 0, units = sh ? (T + 7) / 8 : 0;
          for (int64_t c : cnt) rows += pad(c), units += (c + 7) / 8;
          EXPECT_LE(rows, ws.rows_cap) << name << " R=" << R << " T=" << T << " trial " << trial;
          EXPECT_LE(units, ws.units_cap) << name << " R=" << R << " T=" << T << " trial " << trial;
        }
      }
    }
  }
}
#endif

TEST(EpLayout, OwnersAndPackedSourcesRoundTrip) {
  const MoeShape& s = find_preset("glm-5").shape;  // 256 experts
  const EpLayout l = EpLayout::compute(s, 8, 1000);
  EXPECT_EQ(l.owner(0), 0);
  EXPECT_EQ(l.owner(31), 0);
  EXPECT_EQ(l.owner(32), 1);
  EXPECT_EQ(l.owner(255), 7);
  const int max_token = (1 << (31 - EpLayout::kSlotBits - EpLayout::kRankBits)) - 1;
  for (int rank : {0, 5, 15})
    for (int token : {0, 1, 999, max_token})
      for (int slot : {0, 7, 31}) {
        const int32_t v = EpLayout::pack_src(rank, token, slot);
        EXPECT_GE(v, 0);
        EXPECT_EQ(EpLayout::src_rank(v), rank);
        EXPECT_EQ(EpLayout::src_token(v), token);
        EXPECT_EQ(EpLayout::src_slot(v), slot);
      }
}

TEST(EpLayout, LimitsAreClearErrors) {
  const MoeShape& s = find_preset("glm-5").shape;
  auto message = [&](int R, int T) {
    try {
      EpLayout::compute(s, R, T);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(3, 64).find("do not split evenly over 3 ranks"), std::string::npos);
  EXPECT_NE(message(0, 64).find("ranks must be >= 1"), std::string::npos);
  EXPECT_NE(message(32, 64).find("at most 16 ranks"), std::string::npos);
  EXPECT_NE(message(8, 0).find("max tokens per rank must be >= 1"), std::string::npos);
  EXPECT_NE(message(8, 1 << 23).find("max tokens per rank above"), std::string::npos);
  const EpLayout l = EpLayout::compute(s, 8, 64);
  EXPECT_NO_THROW(l.check_tokens(3, 0));
  EXPECT_NO_THROW(l.check_tokens(3, 64));
  try {
    l.check_tokens(3, 65);
    ADD_FAILURE() << "65 tokens over a capacity of 64 must throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("rank 3: 65 tokens exceed"), std::string::npos) << e.what();
  }
}

// The walk of the pull beside the tiles (ep_pull_row): on random counts (empty sources
// and experts among them, the shared expert's rows first or not), every ring row of a
// routed segment names the (source, send_list entry) the pull before the tiles gives it
// -- pair (el, src) in source-major order inside the expert, its j-th row at
// row_off[el] + (rows of the earlier sources) + j and entry (the source's start for this
// owner) + (its slots to earlier experts) + j -- and every padding row none.
TEST(EpLayout, PullRowWalkNamesEveryReceivedRowOnce) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const int R = 1 << (trial % 5 == 4 ? 0 : rng() % 4), El = 1 + int(rng() % 40);
    const int row0 = trial % 2 ? 8 * int(rng() % 5) : 0;  // the shared expert's rows, first
    std::vector<int> counts(size_t(R) * El), start(R);    // counts[src * El + el]
    for (int& c : counts) c = rng() % 4 == 0 ? 0 : int(rng() % 40);
    for (int& st : start) st = int(rng() % 1000);
    std::vector<int> cnt(El, 0), row_off(El + 1), rel(size_t(El) * R), send(size_t(El) * R);
    int row = row0;
    for (int el = 0; el < El; ++el) {
      row_off[el] = row;
      for (int src = 0; src < R; ++src) {
        rel[el * R + src] = cnt[el];
        cnt[el] += counts[src * El + el];
        int before = 0;
        for (int e = 0; e < el; ++e) before += counts[src * El + e];
        send[el * R + src] = start[src] + before;
      }
      row += (cnt[el] + 7) / 8 * 8;
    }
    row_off[El] = row;
    // The pull before the tiles, pair by pair: ring row -> (source, entry).
    std::vector<std::pair<int, int>> want(row, {-1, -1});
    for (int el = 0; el < El; ++el)
      for (int src = 0; src < R; ++src)
        for (int j = 0; j < counts[src * El + el]; ++j)
          want[row_off[el] + rel[el * R + src] + j] = {src, send[el * R + src] + j};
    int pulled = 0;
    for (int ring = row0; ring < row; ++ring) {
      kernels::PullRow pr{};
      const bool has =
          kernels::ep_pull_row(row_off.data(), cnt.data(), rel.data(), send.data(), El, R, ring, pr);
      ASSERT_EQ(has, want[ring].first >= 0) << "trial " << trial << " ring row " << ring;
      if (!has) continue;
      ++pulled;
      EXPECT_EQ(pr.src, want[ring].first) << "trial " << trial << " ring row " << ring;
      EXPECT_EQ(pr.entry, want[ring].second) << "trial " << trial << " ring row " << ring;
      EXPECT_EQ(row_off[pr.el] + pr.je, ring);
      EXPECT_LT(pr.je, cnt[pr.el]);
    }
    EXPECT_EQ(pulled, std::accumulate(counts.begin(), counts.end(), 0)) << "trial " << trial;
  }
}

}  // namespace
}  // namespace megamoe
