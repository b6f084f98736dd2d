// Helpers shared by the GPU tests: fresh random inputs and the reduced test shape.
#pragma once

#include <cstdint>
#include <vector>

#include "megamoe/model/shape.h"
#include "megamoe/numerics/fp8.h"
#include "megamoe/weights/host_weights.h"

namespace megamoe::testutil {

// n BF16 values drawn from N(0, 1), fresh per seed (never zeros).
inline std::vector<num::bf16_t> random_x(size_t n, uint64_t seed) { return make_random_tokens(n, seed); }

// A small GLM-5-like layer (H 1024, I 512, 32 experts, top-4, one shared, F32 router).
inline MoeShape reduced_shape() {
  MoeShape s;
  s.hidden = 1024, s.inter = 512, s.experts = 32, s.topk = 4, s.shared_experts = 1;
  s.routed_scaling = 2.5f, s.swiglu_limit = 10.0f, s.router_dtype = RouterDtype::kF32;
  return s;
}

}  // namespace megamoe::testutil
