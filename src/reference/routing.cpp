// CPU routing (docs/numerics.md §6): logits, score function, optional correction bias,
// grouped top-k, unbiased weights, renormalization and routed scaling.
//
// Precision: the logits are accumulated in double from the bf16 activations
// and the router weight (bf16 or float, both exact in double), then rounded
// once to float, which is what "the router dtype's arithmetic" means for an
// fp32 router and is at least as precise for a bf16 one. Everything after the
// logits (scores, selection, weights) is float32, evaluated in a fixed order so
// the result is one well-defined set of bytes.
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "megamoe/reference/moe.h"

namespace megamoe::ref {
namespace {

// log(1 + e^z) without overflow: for z > 20, e^-z < 2^-28 is below float
// resolution relative to z.
float softplus(float z) { return z > 20.0f ? z : std::log1p(std::exp(z)); }

void scores_from_logits(ScoreFunc f, const float* z, int E, float* out) {
  switch (f) {
    case ScoreFunc::kSigmoid:
      for (int e = 0; e < E; ++e) out[e] = 1.0f / (1.0f + std::exp(-z[e]));
      return;
    case ScoreFunc::kSoftmax: {
      // Max-shifted softmax over all E experts; sum in ascending expert order.
      float m = -std::numeric_limits<float>::infinity();
      for (int e = 0; e < E; ++e) m = std::max(m, z[e]);
      float sum = 0.0f;
      for (int e = 0; e < E; ++e) {
        out[e] = std::exp(z[e] - m);
        sum += out[e];
      }
      for (int e = 0; e < E; ++e) out[e] /= sum;
      return;
    }
    case ScoreFunc::kSqrtSoftplus:
      for (int e = 0; e < E; ++e) out[e] = std::sqrt(softplus(z[e]));
      return;
  }
}

// Index of the largest value among the candidates still allowed; strict '>'
// keeps the lower index on ties. -1 if none is left.
int argmax_allowed(const float* v, const std::vector<char>& allowed, int n) {
  int best = -1;
  for (int i = 0; i < n; ++i) {
    if (!allowed[i]) continue;
    if (best < 0 || v[i] > v[best]) best = i;
  }
  return best;
}

}  // namespace

void route(const MoeShape& s, const MoeWeightsView& w, const num::bf16_t* x, int T, int32_t* ids,
           float* weights, float* logits) {
  s.validate();
  if (T < 0) throw std::invalid_argument("route: T must be >= 0");
  if (T > 0 && (!x || !ids || !weights || !w.router))
    throw std::invalid_argument("route: null x, ids, weights or router weight");
  const int H = s.hidden, E = s.experts, K = s.topk;
  const bool use_bias = s.correction_bias && w.bias != nullptr;
  const int G = s.n_group, per_group = E / G;

  // The router weight as double once: both dtypes convert exactly.
  std::vector<double> wr(size_t(E) * H);
  if (s.router_dtype == RouterDtype::kBF16) {
    const auto* r = static_cast<const num::bf16_t*>(w.router);
    for (size_t i = 0; i < wr.size(); ++i) wr[i] = num::bf16_decode(r[i]);
  } else {
    const auto* r = static_cast<const float*>(w.router);
    for (size_t i = 0; i < wr.size(); ++i) wr[i] = r[i];
  }

  std::vector<double> xd(H);
  std::vector<float> z(E), score(E), c(E), gscore(G);
  std::vector<char> allowed(E), gallowed(G);
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) xd[h] = num::bf16_decode(x[size_t(t) * H + h]);
    for (int e = 0; e < E; ++e) {
      const double* we = wr.data() + size_t(e) * H;
      double acc = 0.0;
      for (int h = 0; h < H; ++h) acc += xd[h] * we[h];
      z[e] = float(acc);
    }
    if (logits) std::copy(z.begin(), z.end(), logits + size_t(t) * E);
    scores_from_logits(s.score, z.data(), E, score.data());
    for (int e = 0; e < E; ++e) c[e] = use_bias ? score[e] + w.bias[e] : score[e];

    std::fill(allowed.begin(), allowed.end(), char(1));
    if (G > 1) {
      // Group score = sum of the group's two best selection scores.
      for (int g = 0; g < G; ++g) {
        float b1 = -std::numeric_limits<float>::infinity(), b2 = b1;
        for (int e = g * per_group; e < (g + 1) * per_group; ++e) {
          if (c[e] > b1) {
            b2 = b1;
            b1 = c[e];
          } else if (c[e] > b2) {
            b2 = c[e];
          }
        }
        gscore[g] = b1 + b2;
      }
      std::vector<char> gleft(G, 1);
      std::fill(gallowed.begin(), gallowed.end(), char(0));
      for (int i = 0; i < s.topk_group; ++i) {
        const int g = argmax_allowed(gscore.data(), gleft, G);
        gleft[g] = 0;
        gallowed[g] = 1;
      }
      for (int e = 0; e < E; ++e) allowed[e] = gallowed[e / per_group];
    }

    int32_t* id = ids + size_t(t) * K;
    float* wt = weights + size_t(t) * K;
    for (int k = 0; k < K; ++k) {
      const int e = argmax_allowed(c.data(), allowed, E);
      // validate() guarantees K <= experts in the kept groups, so e >= 0.
      allowed[e] = 0;
      id[k] = e;
      wt[k] = score[e];
    }
    if (s.norm_topk_prob) {
      float sum = 0.0f;
      for (int k = 0; k < K; ++k) sum += wt[k];
      for (int k = 0; k < K; ++k) wt[k] /= (sum + 1e-20f);
    }
    for (int k = 0; k < K; ++k) wt[k] *= s.routed_scaling;
  }
}

}  // namespace megamoe::ref
