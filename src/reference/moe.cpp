// The CPU reference of one MoE layer (docs/numerics.md §7) in its two modes: kExact
// (float64 oracle of the math) and kKernelFaithful (the Hopper kernel's
// arithmetic, bit for bit: its tensor-core partial sums run num::fp8_mma_step).
// Work is grouped by expert so each weight row is split into significands and
// exponents once for all the rows routed to it, and divided into (expert, column
// group) items over threads; every output element has one owner, so results do
// not depend on the thread count.
#include "megamoe/reference/moe.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "engine.h"
#include "megamoe/numerics/act_quant.h"

namespace megamoe::ref {
namespace detail {

ExpertWeights routed_expert(const MoeShape& s, const MoeWeightsView& w, int e) {
  const MoeWeightsView v = w.from_expert(s, e);
  return {v.w13, v.w13_scale, v.w2, v.w2_scale, s.inter};
}

ExpertWeights shared_expert(const MoeShape& s, const MoeWeightsView& w) {
  return {w.shared_w13, w.shared_w13_scale, w.shared_w2, w.shared_w2_scale, s.shared_inter()};
}

int resolve_threads(int requested) {
  if (requested > 0) return requested;
  const unsigned hc = std::thread::hardware_concurrency();
  return hc ? int(hc) : 1;
}

void quantize_acts(const num::bf16_t* x, int T, int H, uint8_t* q, float* s) {
  const int hb = MoeWeightLayout::hidden_blocks(H);
  for (int t = 0; t < T; ++t) {
    for (int b = 0; b < hb; ++b) {
      const int c0 = b * num::kActGroup, c1 = std::min(H, c0 + num::kActGroup);
      float amax = 0.0f;
      for (int c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(num::bf16_decode(x[size_t(t) * H + c])));
      const float sc = num::act_scale(amax);
      const float inv = 1.0f / sc;
      s[size_t(t) * hb + b] = sc;
      for (int c = c0; c < c1; ++c) {
        const size_t i = size_t(t) * H + c;
        q[i] = num::act_quant(num::bf16_decode(x[i]), inv);
      }
    }
  }
}

void run_faithful(const MoeShape& s, std::vector<FaithfulTask>& tasks, int threads) {
  const int H = s.hidden;
  const int hb = MoeWeightLayout::hidden_blocks(H);
  const float limit = s.swiglu_limit;

  // Per task: the requantized SwiGLU output (E4M3 codes, then split) [n][I] and
  // its scales [n][ceil(I/128)]: the second GEMM's operand.
  struct Inter {
    std::vector<uint8_t> q;
    SplitCodes a;
    std::vector<float> s;
    int groups = 0;
  };
  std::vector<Inter> inter(tasks.size());
  struct Item {
    int task, group;
  };
  std::vector<Item> items1, items2;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const int n = int(tasks[i].rows.size());
    if (n == 0) continue;
    const int I = tasks[i].w.inter;
    inter[i].groups = ceil_div(I, num::kInterGroup);
    inter[i].q.resize(size_t(n) * I);
    inter[i].s.resize(size_t(n) * inter[i].groups);
    for (int g = 0; g < inter[i].groups; ++g) items1.push_back({int(i), g});
    // GEMM2 items: 64 output columns each (the same granularity as phase 1).
    for (int g = 0; g < ceil_div(H, 64); ++g) items2.push_back({int(i), g});
  }

  // Phase 1: for one task and one group of 128 intermediate columns, the gate
  // and up rows of those columns for all of the task's rows, SwiGLU, and the
  // 1x128 requantization (the group is exactly one quantization group).
  parallel_for(int(items1.size()), threads, [&](int it) {
    const FaithfulTask& tk = tasks[items1[it].task];
    Inter& md = inter[items1[it].task];
    const int g = items1[it].group, I = tk.w.inter, n = int(tk.rows.size());
    const int ib = MoeWeightLayout::inter_blocks(I);
    const int c0 = g * num::kInterGroup, c1 = std::min(I, c0 + num::kInterGroup), width = c1 - c0;
    std::vector<SplitRow> arows(n);
    for (int j = 0; j < n; ++j) arows[j] = tk.xq->row(tk.rows[j]);
    // The kernel folds every num::kGemm1FoldK-deep partial sum with its block's scales.
    const int nf = ceil_div(H, num::kGemm1FoldK);
    std::vector<float> part(size_t(n) * nf);
    std::vector<float> acc_g(size_t(n) * width), acc_u(size_t(n) * width);
    auto gemm1_row = [&](int wrow, int srow, float* out, int col) {
      dot_e4m3_mma_blocks(tk.w.w13 + size_t(wrow) * H, H, num::kGemm1FoldK, arows.data(), n, part.data());
      const float* sw = tk.w.w13_scale + size_t(srow) * hb;
      for (int j = 0; j < n; ++j) {
        const float* sx = tk.s + size_t(tk.rows[j]) * hb;
        float acc = 0.0f;
        for (int f = 0; f < nf; ++f) {
          const int kb = f * num::kGemm1FoldK / kWeightBlock;
          acc = std::fmaf(part[size_t(j) * nf + f], sx[kb] * sw[kb], acc);
        }
        out[size_t(j) * width + col] = acc;
      }
    };
    for (int c = c0; c < c1; ++c) {
      gemm1_row(c, c / kWeightBlock, acc_g.data(), c - c0);
      gemm1_row(I + c, ib + c / kWeightBlock, acc_u.data(), c - c0);
    }
    std::vector<float> a(width);
    for (int j = 0; j < n; ++j) {
      float amax = 0.0f;
      for (int c = 0; c < width; ++c) {
        a[c] = num::swiglu(acc_g[size_t(j) * width + c], acc_u[size_t(j) * width + c], limit, tk.weight[j]);
        amax = std::max(amax, std::fabs(a[c]));
      }
      const float s2 = num::act_scale(amax);
      const float inv = 1.0f / s2;
      md.s[size_t(j) * md.groups + g] = s2;
      uint8_t* dst = md.q.data() + size_t(j) * I + c0;
      for (int c = 0; c < width; ++c) dst[c] = num::act_quant(a[c], inv);
    }
  });

  for (size_t i = 0; i < tasks.size(); ++i)
    if (!tasks[i].rows.empty()) {
      inter[i].a = SplitCodes(inter[i].q.data(), tasks[i].rows.size(), tasks[i].w.inter);
      std::vector<uint8_t>().swap(inter[i].q);  // the codes live on in their split form
    }

  // Phase 2: y_k[h] for 64 output columns h of one task: per 128-deep block of
  // I a tensor-core partial (num::fp8_mma_chain), folded with s2 * w2_scale[h/128][k/128]; then bf16.
  parallel_for(int(items2.size()), threads, [&](int it) {
    const FaithfulTask& tk = tasks[items2[it].task];
    const Inter& md = inter[items2[it].task];
    const int I = tk.w.inter, n = int(tk.rows.size()), ng = md.groups;
    const int ib = MoeWeightLayout::inter_blocks(I);
    const int h0 = items2[it].group * 64, h1 = std::min(H, h0 + 64);
    std::vector<SplitRow> arows(n);
    for (int j = 0; j < n; ++j) arows[j] = md.a.row(j);
    std::vector<float> part(size_t(n) * ng);
    for (int h = h0; h < h1; ++h) {
      dot_e4m3_mma_blocks(tk.w.w2 + size_t(h) * I, I, num::kInterGroup, arows.data(), n, part.data());
      const float* sw = tk.w.w2_scale + size_t(h / kWeightBlock) * ib;
      for (int j = 0; j < n; ++j) {
        const float* s2 = md.s.data() + size_t(j) * ng;
        float acc = 0.0f;
        for (int g = 0; g < ng; ++g) {
          const float swk = sw[g * num::kInterGroup / kWeightBlock];
          acc = std::fmaf(part[size_t(j) * ng + g], s2[g] * swk, acc);
        }
        tk.out[j][h] = num::bf16_encode(acc);
      }
    }
  });
}

void combine_faithful(const num::bf16_t* slots, const uint8_t* valid, int T, int S, int H, float* y) {
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      float sum = 0.0f;
      for (int k = 0; k < S; ++k)
        if (valid[size_t(t) * S + k]) sum += num::bf16_decode(slots[(size_t(t) * S + k) * H + h]);
      y[size_t(t) * H + h] = num::bf16_decode(num::bf16_encode(sum));
    }
  }
}

}  // namespace detail

namespace {

using detail::ExpertWeights;

void check_inputs(const MoeShape& s, const MoeWeightsView& w, const num::bf16_t* x, int T, const int32_t* ids,
                  const float* weights, float* y) {
  s.validate();
  if (T < 0) throw std::invalid_argument("moe_layer: T must be >= 0");
  if (T == 0) return;
  if (!x || !ids || !weights || !y) throw std::invalid_argument("moe_layer: null x, ids, weights or y");
  if (!w.w13 || !w.w13_scale || !w.w2 || !w.w2_scale)
    throw std::invalid_argument("moe_layer: routed expert weights missing from the view");
  if (s.has_shared() && (!w.shared_w13 || !w.shared_w13_scale || !w.shared_w2 || !w.shared_w2_scale))
    throw std::invalid_argument("moe_layer: shape has a shared expert but the view has no shared weights");
  for (size_t i = 0; i < size_t(T) * s.topk; ++i) {
    if (ids[i] < -1 || ids[i] >= s.experts)
      throw std::invalid_argument("moe_layer: expert id " + std::to_string(ids[i]) + " at token " +
                                  std::to_string(i / s.topk) + " out of range [-1, " +
                                  std::to_string(s.experts) + ")");
  }
}

// ---- kExact: float64 throughout, no activation quantization ----

double dequant(const uint8_t* q, const float* scale_row_block, int c) {
  return double(num::e4m3_decode(q[c])) * double(scale_row_block[c / kWeightBlock]);
}

// One expert over n rows of x (double): returns y [n][H] in double.
void exact_expert(const MoeShape& s, const ExpertWeights& ew, const std::vector<const double*>& xs,
                  const std::vector<double>& wk, std::vector<double>& y, int threads) {
  const int H = s.hidden, I = ew.inter, n = int(xs.size());
  const int hb = MoeWeightLayout::hidden_blocks(H), ib = MoeWeightLayout::inter_blocks(I);
  const double L = s.swiglu_limit;
  std::vector<double> a(size_t(n) * I);
  detail::parallel_for(ceil_div(I, 64), threads, [&](int g) {
    std::vector<double> wg(H), wu(H);
    for (int c = g * 64; c < std::min(I, g * 64 + 64); ++c) {
      for (int h = 0; h < H; ++h) {
        wg[h] = dequant(ew.w13 + size_t(c) * H, ew.w13_scale + size_t(c / kWeightBlock) * hb, h);
        wu[h] = dequant(ew.w13 + size_t(I + c) * H, ew.w13_scale + size_t(ib + c / kWeightBlock) * hb, h);
      }
      for (int j = 0; j < n; ++j) {
        double gv = 0.0, uv = 0.0;
        for (int h = 0; h < H; ++h) {
          gv += wg[h] * xs[j][h];
          uv += wu[h] * xs[j][h];
        }
        if (L > 0.0) {
          gv = std::min(gv, L);
          uv = std::clamp(uv, -L, L);
        }
        a[size_t(j) * I + c] = gv / (1.0 + std::exp(-gv)) * uv * wk[j];
      }
    }
  });
  y.assign(size_t(n) * H, 0.0);
  detail::parallel_for(ceil_div(H, 64), threads, [&](int g) {
    std::vector<double> wd(I);
    for (int h = g * 64; h < std::min(H, g * 64 + 64); ++h) {
      for (int c = 0; c < I; ++c)
        wd[c] = dequant(ew.w2 + size_t(h) * I, ew.w2_scale + size_t(h / kWeightBlock) * ib, c);
      for (int j = 0; j < n; ++j) {
        double acc = 0.0;
        const double* aj = a.data() + size_t(j) * I;
        for (int c = 0; c < I; ++c) acc += wd[c] * aj[c];
        y[size_t(j) * H + h] = acc;
      }
    }
  });
}

void layer_exact(const MoeShape& s, const MoeWeightsView& w, const num::bf16_t* x, int T, const int32_t* ids,
                 const float* weights, float* y, int threads) {
  const int H = s.hidden, K = s.topk, S = s.slots();
  std::vector<double> xd(size_t(T) * H);
  for (size_t i = 0; i < xd.size(); ++i) xd[i] = num::bf16_decode(x[i]);
  // Slot results [T][S][H] in double, summed in slot order at the end.
  std::vector<double> slots(size_t(T) * S * H, 0.0);
  std::vector<char> valid(size_t(T) * S, 0);
  auto run = [&](const ExpertWeights& ew, const std::vector<int>& toks, const std::vector<int>& slot_of,
                 const std::vector<double>& wk) {
    if (toks.empty()) return;
    std::vector<const double*> xs;
    for (int t : toks) xs.push_back(xd.data() + size_t(t) * H);
    std::vector<double> out;
    exact_expert(s, ew, xs, wk, out, threads);
    for (size_t j = 0; j < toks.size(); ++j) {
      std::copy_n(out.data() + j * H, H, slots.data() + (size_t(toks[j]) * S + slot_of[j]) * H);
      valid[size_t(toks[j]) * S + slot_of[j]] = 1;
    }
  };
  for (int e = 0; e < s.experts; ++e) {
    std::vector<int> toks, slot_of;
    std::vector<double> wk;
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k)
        if (ids[size_t(t) * K + k] == e) {
          toks.push_back(t);
          slot_of.push_back(k);
          wk.push_back(weights[size_t(t) * K + k]);
        }
    run(detail::routed_expert(s, w, e), toks, slot_of, wk);
  }
  if (s.has_shared()) {
    std::vector<int> toks(T), slot_of(T, K);
    for (int t = 0; t < T; ++t) toks[t] = t;
    run(detail::shared_expert(s, w), toks, slot_of, std::vector<double>(T, 1.0));
  }
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      double sum = 0.0;
      for (int k = 0; k < S; ++k)
        if (valid[size_t(t) * S + k]) sum += slots[(size_t(t) * S + k) * H + h];
      y[size_t(t) * H + h] = float(sum);
    }
}

// ---- kKernelFaithful ----

void layer_faithful(const MoeShape& s, const MoeWeightsView& w, const num::bf16_t* x, int T,
                    const int32_t* ids, const float* weights, float* y, int threads) {
  const int H = s.hidden, K = s.topk, S = s.slots();
  const int hb = MoeWeightLayout::hidden_blocks(H);
  std::vector<uint8_t> q(size_t(T) * H);
  std::vector<float> sx(size_t(T) * hb);
  detail::quantize_acts(x, T, H, q.data(), sx.data());
  const detail::SplitCodes xq(q.data(), T, H);

  std::vector<num::bf16_t> slots(size_t(T) * S * H);
  std::vector<uint8_t> valid(size_t(T) * S, 0);
  std::vector<detail::FaithfulTask> tasks(s.experts + (s.has_shared() ? 1 : 0));
  for (int e = 0; e < s.experts; ++e) {
    tasks[e].w = detail::routed_expert(s, w, e);
    tasks[e].xq = &xq;
    tasks[e].s = sx.data();
  }
  // Rows in (token, slot) order within each expert: any order gives the same
  // bytes (rows are independent), this one is the natural one.
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const int e = ids[size_t(t) * K + k];
      if (e < 0) continue;
      tasks[e].rows.push_back(t);
      tasks[e].weight.push_back(weights[size_t(t) * K + k]);
      tasks[e].out.push_back(slots.data() + (size_t(t) * S + k) * H);
      valid[size_t(t) * S + k] = 1;
    }
  if (s.has_shared()) {
    auto& sh = tasks.back();
    sh.w = detail::shared_expert(s, w);
    sh.xq = &xq;
    sh.s = sx.data();
    for (int t = 0; t < T; ++t) {
      sh.rows.push_back(t);
      sh.weight.push_back(1.0f);
      sh.out.push_back(slots.data() + (size_t(t) * S + K) * H);
      valid[size_t(t) * S + K] = 1;
    }
  }
  detail::run_faithful(s, tasks, threads);
  detail::combine_faithful(slots.data(), valid.data(), T, S, H, y);
}

}  // namespace

void moe_layer(const MoeShape& s, const MoeWeightsView& w, const num::bf16_t* x, int T, const int32_t* ids,
               const float* weights, Mode mode, float* y, const LayerOptions& opt) {
  check_inputs(s, w, x, T, ids, weights, y);
  if (T == 0) return;
  const int threads = detail::resolve_threads(opt.threads);
  if (mode == Mode::kExact)
    layer_exact(s, w, x, T, ids, weights, y, threads);
  else
    layer_faithful(s, w, x, T, ids, weights, y, threads);
}

}  // namespace megamoe::ref
