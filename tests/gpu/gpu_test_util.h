// Helpers shared by the GPU tests: fresh random inputs and the reduced test shape.
#pragma once

#include <cstdint>
#include <vector>

#include "megamoe/api/forward.h"
#include "megamoe/model/shape.h"
#include "megamoe/numerics/fp8.h"
#include "megamoe/weights/host_weights.h"

namespace megamoe::testutil {

// A CUDA device to run on (the GPU tests skip without one).
inline bool have_device() { return api::cuda_available(); }

// n BF16 values drawn from N(0, 1), fresh per seed (never zeros).
inline std::vector<num::bf16_t> random_x(size_t n, uint64_t seed) { return make_random_tokens(n, seed); }

// A small GLM-5-like layer (H 1024, I 512, 32 experts, top-4, one shared, F32 router).
inline MoeShape reduced_shape() {
  MoeShape s;
  s.hidden = 1024, s.inter = 512, s.experts = 32, s.topk = 4, s.shared_experts = 1;
  s.routed_scaling = 2.5f, s.swiglu_limit = 10.0f, s.router_dtype = RouterDtype::kF32;
  return s;
}

// Odd K-block counts (H 1152 = 9 x 128, I 384 = 3 x 128): the K loops' last single stage
// after their two-stage iterations, and router slices of 72 columns (a 64-column step and
// a zero-filled partial one).
inline MoeShape odd_blocks_shape() {
  MoeShape s = reduced_shape();
  s.hidden = 1152, s.inter = 384;
  return s;
}

}  // namespace megamoe::testutil
