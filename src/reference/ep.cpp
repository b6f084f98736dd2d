// Expert parallelism over R simulated ranks (docs/numerics.md §8), modelled step by step
// like the kernel's protocol so the data movement itself is checked:
//   1. each rank routes and quantizes its own tokens;
//   2. count exchange: every rank tells every other how many tokens it sends;
//   3. dispatch: one copy of each token's FP8 row + scales + routing per
//      destination rank, into that rank's receive buffer (source-rank order);
//   4. each rank runs its local experts on the received rows and the shared
//      expert on its own tokens;
//   5. combine: each result goes back into the source's slot buffer at its
//      slot, then (after the barrier) the source reduces in slot order.
// The expert arithmetic is the single-rank kernel-faithful engine, so the
// output bytes equal moe_layer(kKernelFaithful) on the concatenated batch.
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine.h"
#include "megamoe/reference/moe.h"

namespace megamoe::ref {

namespace {

// views[r]: rank r's weights; its routed expert e is views[r]'s expert e - first[r]
// (0 for a view of the whole layer, r * E/R for a rank-local one).
EpStats ep_layer(const MoeShape& s, std::span<const MoeWeightsView> views, std::span<const int> first, int R,
                 std::span<const RankBatch> ranks, std::span<float* const> y, std::span<int32_t* const> ids,
                 std::span<float* const> weights, const LayerOptions& opt) {
  if (int(ranks.size()) != R || int(y.size()) != R)
    throw std::invalid_argument("moe_layer_ep: need one batch and one output per rank");
  if ((!ids.empty() && int(ids.size()) != R) || (!weights.empty() && int(weights.size()) != R))
    throw std::invalid_argument("moe_layer_ep: ids/weights spans must be empty or have one entry per rank");
  for (int r = 0; r < R; ++r) {
    if (ranks[r].T < 0) throw std::invalid_argument("moe_layer_ep: negative T on rank " + std::to_string(r));
    if (ranks[r].T > 0 && (!ranks[r].x || !y[r]))
      throw std::invalid_argument("moe_layer_ep: null x or y on rank " + std::to_string(r));
  }
  const int H = s.hidden, K = s.topk, S = s.slots(), E = s.experts, per_rank = E / R;
  const int hb = MoeWeightLayout::hidden_blocks(H);
  const int threads = detail::resolve_threads(opt.threads);

  // ---- 1. local routing and quantization ----
  struct Local {
    std::vector<int32_t> ids;
    std::vector<float> wts;
    std::vector<uint8_t> q;
    std::vector<float> sx;
    detail::SplitCodes xq;
    std::vector<num::bf16_t> slots;  // [T][S][H]: where results come back
    std::vector<uint8_t> valid;      // [T][S]
  };
  std::vector<Local> loc(R);
  for (int r = 0; r < R; ++r) {
    const int T = ranks[r].T;
    Local& L = loc[r];
    L.ids.resize(size_t(T) * K);
    L.wts.resize(size_t(T) * K);
    L.q.resize(size_t(T) * H);
    L.sx.resize(size_t(T) * hb);
    L.slots.resize(size_t(T) * S * H);
    L.valid.assign(size_t(T) * S, 0);
    if (T == 0) continue;
    route(s, views[r], ranks[r].x, T, L.ids.data(), L.wts.data());
    detail::quantize_acts(ranks[r].x, T, H, L.q.data(), L.sx.data());
    L.xq = detail::SplitCodes(L.q.data(), T, H);
    if (!ids.empty() && ids[r]) std::copy(L.ids.begin(), L.ids.end(), ids[r]);
    if (!weights.empty() && weights[r]) std::copy(L.wts.begin(), L.wts.end(), weights[r]);
  }
  auto owner = [&](int e) { return e / per_rank; };

  // ---- 2. count exchange: tokens[src][dst] (deduplicated per destination) ----
  std::vector<int64_t> count(size_t(R) * R, 0);
  for (int src = 0; src < R; ++src)
    for (int t = 0; t < ranks[src].T; ++t) {
      std::vector<char> hit(R, 0);
      for (int k = 0; k < K; ++k) {
        const int e = loc[src].ids[size_t(t) * K + k];
        if (e >= 0) hit[owner(e)] = 1;
      }
      for (int d = 0; d < R; ++d) count[size_t(src) * R + d] += hit[d];
    }

  // ---- 3. dispatch into each destination's receive buffer ----
  // A received row carries the token's FP8 codes and scales plus its routing
  // (expert ids and weights for all K slots) and where it came from.
  struct Recv {
    std::vector<uint8_t> q;
    std::vector<float> sx;
    detail::SplitCodes xq;
    std::vector<int32_t> ids;
    std::vector<float> wts;
    std::vector<int32_t> src_rank, src_token;
    int rows = 0;
  };
  std::vector<Recv> recv(R);
  EpStats stats;
  stats.rows_received.assign(R, 0);
  stats.tokens_sent.assign(R, 0);
  for (int d = 0; d < R; ++d) {
    int64_t total = 0;
    for (int src = 0; src < R; ++src) total += count[size_t(src) * R + d];
    Recv& rv = recv[d];
    rv.q.resize(size_t(total) * H);
    rv.sx.resize(size_t(total) * hb);
    rv.ids.resize(size_t(total) * K);
    rv.wts.resize(size_t(total) * K);
    rv.src_rank.resize(total);
    rv.src_token.resize(total);
  }
  for (int src = 0; src < R; ++src) {
    const Local& L = loc[src];
    for (int t = 0; t < ranks[src].T; ++t) {
      std::vector<char> sent(R, 0);
      for (int k = 0; k < K; ++k) {
        const int e = L.ids[size_t(t) * K + k];
        if (e < 0 || sent[owner(e)]) continue;
        const int d = owner(e);
        sent[d] = 1;
        Recv& rv = recv[d];
        const size_t row = size_t(rv.rows++);
        std::memcpy(rv.q.data() + row * H, L.q.data() + size_t(t) * H, H);
        std::memcpy(rv.sx.data() + row * hb, L.sx.data() + size_t(t) * hb, hb * sizeof(float));
        std::memcpy(rv.ids.data() + row * K, L.ids.data() + size_t(t) * K, K * sizeof(int32_t));
        std::memcpy(rv.wts.data() + row * K, L.wts.data() + size_t(t) * K, K * sizeof(float));
        rv.src_rank[row] = src;
        rv.src_token[row] = t;
        ++stats.tokens_sent[src];
      }
    }
  }
  for (int d = 0; d < R; ++d) {
    Recv& rv = recv[d];
    if (int64_t(rv.rows) != int64_t(rv.src_rank.size()))
      throw std::logic_error("moe_layer_ep: receive count disagrees with the exchanged counts");
    // The receiving rank splits its FP8 rows for the GEMM operand.
    rv.xq = detail::SplitCodes(rv.q.data(), rv.rows, H);
  }

  // ---- 4. local compute: results land in the destination's result buffer ----
  // result[d] holds one H-row per (received row, slot on a local expert).
  struct Result {
    std::vector<num::bf16_t> y;
    std::vector<int32_t> src_rank, src_token, slot;
  };
  std::vector<Result> res(R);
  std::vector<detail::FaithfulTask> tasks;
  for (int d = 0; d < R; ++d) {
    const Recv& rv = recv[d];
    Result& rs = res[d];
    // Count this rank's (row, local expert) pairs first so the result buffer
    // never reallocates under the task's output pointers.
    size_t n = 0;
    for (size_t i = 0; i < rv.ids.size(); ++i)
      if (rv.ids[i] >= 0 && owner(rv.ids[i]) == d) ++n;
    rs.y.resize(n * H);
    stats.rows_received[d] = int64_t(n);
    size_t next = 0;
    for (int le = 0; le < per_rank; ++le) {
      const int e = d * per_rank + le;
      detail::FaithfulTask tk;
      tk.w = detail::routed_expert(s, views[d], e - first[d]);
      tk.xq = &rv.xq;
      tk.s = rv.sx.data();
      for (int row = 0; row < rv.rows; ++row)
        for (int k = 0; k < K; ++k) {
          if (rv.ids[size_t(row) * K + k] != e) continue;
          tk.rows.push_back(row);
          tk.weight.push_back(rv.wts[size_t(row) * K + k]);
          tk.out.push_back(rs.y.data() + next * H);
          rs.src_rank.push_back(rv.src_rank[row]);
          rs.src_token.push_back(rv.src_token[row]);
          rs.slot.push_back(k);
          ++next;
        }
      if (!tk.rows.empty()) tasks.push_back(std::move(tk));
    }
  }
  // Shared expert: each rank on its own tokens, straight into its slot K.
  if (s.has_shared()) {
    for (int r = 0; r < R; ++r) {
      if (ranks[r].T == 0) continue;
      Local& L = loc[r];
      detail::FaithfulTask tk;
      tk.w = detail::shared_expert(s, views[r]);
      tk.xq = &L.xq;
      tk.s = L.sx.data();
      for (int t = 0; t < ranks[r].T; ++t) {
        tk.rows.push_back(t);
        tk.weight.push_back(1.0f);
        tk.out.push_back(L.slots.data() + (size_t(t) * S + K) * H);
        L.valid[size_t(t) * S + K] = 1;
      }
      tasks.push_back(std::move(tk));
    }
  }
  // All simulated ranks compute concurrently (one engine call); each task
  // writes only its own rank's buffers.
  detail::run_faithful(s, tasks, threads);

  // ---- 5. combine: send each result back to its source slot, then reduce ----
  for (int d = 0; d < R; ++d) {
    const Result& rs = res[d];
    for (size_t i = 0; i < rs.slot.size(); ++i) {
      Local& L = loc[rs.src_rank[i]];
      const size_t slot = size_t(rs.src_token[i]) * S + rs.slot[i];
      std::memcpy(L.slots.data() + slot * H, rs.y.data() + i * H, H * sizeof(num::bf16_t));
      L.valid[slot] = 1;
    }
  }
  for (int r = 0; r < R; ++r) {
    if (ranks[r].T == 0) continue;
    detail::combine_faithful(loc[r].slots.data(), loc[r].valid.data(), ranks[r].T, S, H, y[r]);
  }
  return stats;
}

void check_ranks(const MoeShape& s, int R) {
  s.validate();
  if (R <= 0 || s.experts % R != 0)
    throw std::invalid_argument("moe_layer_ep: R = " + std::to_string(R) +
                                " must divide E = " + std::to_string(s.experts));
}

}  // namespace

EpStats moe_layer_ep(const MoeShape& s, const MoeWeightsView& w, int R, std::span<const RankBatch> ranks,
                     std::span<float* const> y, std::span<int32_t* const> ids,
                     std::span<float* const> weights, const LayerOptions& opt) {
  check_ranks(s, R);
  const std::vector<MoeWeightsView> views(R, w);
  const std::vector<int> first(R, 0);
  return ep_layer(s, views, first, R, ranks, y, ids, weights, opt);
}

EpStats moe_layer_ep(const MoeShape& s, std::span<const MoeWeightsView> rank_weights,
                     std::span<const RankBatch> ranks, std::span<float* const> y,
                     std::span<int32_t* const> ids, std::span<float* const> weights,
                     const LayerOptions& opt) {
  const int R = int(rank_weights.size());
  check_ranks(s, R);
  std::vector<int> first(R);
  for (int r = 0; r < R; ++r) first[r] = r * (s.experts / R);
  return ep_layer(s, rank_weights, first, R, ranks, y, ids, weights, opt);
}

}  // namespace megamoe::ref
