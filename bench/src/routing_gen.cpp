// Synthetic skewed routing (bench/include/megamoe_bench/routing_gen.h).
#include "megamoe_bench/routing_gen.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <numeric>
#include <stdexcept>

namespace megamoe::api {

namespace {

// splitmix64: a fixed generator, so the ids are the same bits on every platform.
struct Rng {
  uint64_t st;
  uint64_t next() {
    uint64_t z = (st += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
};

}  // namespace

std::string RoutingSpec::text() const {
  return kind == Kind::kUniform ? std::string("uniform") : fmt::format("zipf:{}", zipf_s);
}

RoutingSpec parse_routing(const std::string& text) {
  RoutingSpec r;
  if (text == "uniform") return r;
  const std::string prefix = "zipf:";
  if (text.compare(0, prefix.size(), prefix) == 0 && text.size() > prefix.size()) {
    const std::string num = text.substr(prefix.size());
    char* end = nullptr;
    const double s = std::strtod(num.c_str(), &end);
    if (end == num.c_str() + num.size() && std::isfinite(s) && s >= 0 && s <= 64) {
      r.kind = RoutingSpec::Kind::kZipf;
      r.zipf_s = s;
      return r;
    }
  }
  throw std::invalid_argument(
      fmt::format("--routing: expected uniform or zipf:S with S a number in [0, 64], found '{}'", text));
}

GeneratedRouting zipf_routing(const MoeShape& shape, int T, double s, uint64_t seed) {
  const int E = shape.experts, K = shape.topk;
  if (T < 0) throw std::invalid_argument(fmt::format("zipf_routing: tokens must be >= 0, found {}", T));
  if (E < 1 || K < 1 || K > E)
    throw std::invalid_argument(
        fmt::format("zipf_routing: need 1 <= topk <= experts, found topk {} experts {}", K, E));
  if (!std::isfinite(s) || s < 0)
    throw std::invalid_argument(fmt::format("zipf_routing: exponent must be finite and >= 0, found {}", s));
  Rng rng{seed};
  // The popularity order: a seeded Fisher-Yates permutation, expert perm[r] has rank r.
  std::vector<int32_t> perm(E);
  std::iota(perm.begin(), perm.end(), 0);
  for (int i = E - 1; i > 0; --i) std::swap(perm[i], perm[int(rng.next() % uint64_t(i + 1))]);
  std::vector<double> pop(E);
  for (int r = 0; r < E; ++r) pop[perm[r]] = std::pow(double(r + 1), -s);
  const double total = std::accumulate(pop.begin(), pop.end(), 0.0);

  GeneratedRouting out;
  out.ids.resize(size_t(T) * K);
  out.weights.resize(size_t(T) * K);
  std::vector<char> taken(E, 0);
  std::vector<double> v(K);  // a token's raw weights
  for (int t = 0; t < T; ++t) {
    int32_t* ids = out.ids.data() + size_t(t) * K;
    float* w = out.weights.data() + size_t(t) * K;
    double left = total;  // the popularity of the experts not yet taken
    for (int k = 0; k < K; ++k) {
      // One draw among the experts left, in proportion to their popularity; the scan
      // ends on the last one left should rounding leave u past the sum.
      double u = rng.uniform() * left;
      int pick = -1;
      for (int e = 0; e < E; ++e) {
        if (taken[e]) continue;
        pick = e;
        if ((u -= pop[e]) < 0) break;
      }
      taken[pick] = 1;
      left -= pop[pick];
      ids[k] = pick;
    }
    for (int k = 0; k < K; ++k) taken[ids[k]] = 0;
    // Weights: positive, bounded away from 0 (as sigmoid scores of routed experts are).
    double sum = 0;
    for (int k = 0; k < K; ++k) sum += v[k] = 0.05 + 0.95 * rng.uniform();
    for (int k = 0; k < K; ++k)
      w[k] = float((shape.norm_topk_prob ? v[k] / sum : v[k]) * double(shape.routed_scaling));
  }
  return out;
}

}  // namespace megamoe::api
