// Synthetic routing for `megamoe bench --routing`: the ids and weights a layer runs
// on through external routing when traffic is skewed (a few hot experts take
// several times the mean rows), instead of the router's picks on random x.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megamoe/model/shape.h"

namespace megamoe::api {

// "uniform" (the layer's own router on random x) or "zipf:S" (S finite, >= 0).
struct RoutingSpec {
  enum class Kind { kUniform, kZipf };
  Kind kind = Kind::kUniform;
  double zipf_s = 0;
  std::string text() const;  // "uniform" or "zipf:S" as parsed ("zipf:1" for 1.0)
};

// Throws std::invalid_argument naming the argument, the expected and the found text.
RoutingSpec parse_routing(const std::string& text);

struct GeneratedRouting {
  std::vector<int32_t> ids;    // [T][K], K distinct experts a token
  std::vector<float> weights;  // [T][K], positive; normalized as the router's
};

// Expert popularity follows a Zipf law of exponent s over a seeded random permutation
// of the E experts (the expert of rank r has weight 1/(r+1)^s); each token draws
// shape.topk distinct experts by that law (successive draws among the experts not yet
// taken), and random positive weights, summing to 1 when shape.norm_topk_prob, times
// shape.routed_scaling. Deterministic in (shape.experts, shape.topk, T, s, seed);
// s = 0 is uniform over the experts.
GeneratedRouting zipf_routing(const MoeShape& shape, int T, double s, uint64_t seed);

}  // namespace megamoe::api
