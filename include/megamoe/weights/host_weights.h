// One MoE layer's weights in host memory, in the kernel layout (layout.h).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "megamoe/model/shape.h"
#include "megamoe/numerics/fp8.h"
#include "megamoe/weights/layout.h"

namespace megamoe {

struct HostMoeWeights {
  MoeShape shape;
  MoeWeightLayout layout;

  explicit HostMoeWeights(const MoeShape& s);
  HostMoeWeights(const MoeShape& s, ExpertRange experts);  // only these routed experts
  HostMoeWeights(HostMoeWeights&&) noexcept = default;
  HostMoeWeights& operator=(HostMoeWeights&&) noexcept = default;

  uint8_t* data() { return storage_.get(); }
  const uint8_t* data() const { return storage_.get(); }
  size_t bytes() const { return layout.total_bytes; }
  uint8_t* region(const Region& r) { return storage_.get() + r.offset; }
  MoeWeightsView view() const { return MoeWeightsView::at(storage_.get(), layout, shape); }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> storage_;
};

// w itself if it holds every routed expert (MoeWeightLayout::whole), else
// std::invalid_argument naming `what` and the experts w holds.
const HostMoeWeights& whole_layer(const HostMoeWeights& w, const char* what);

// Random weights shaped like a block-FP8 checkpoint: E4M3 codes distributed
// like a quantized normal (block amax near 448), per-block float32 scales
// drawn log-normally (not powers of two unless pow2_scales), router and bias
// random. Deterministic in `seed`; multithreaded.
HostMoeWeights make_random_weights(const MoeShape& s, uint64_t seed, bool pow2_scales = false);

// n BF16 activations drawn from N(0, 1) (mt19937_64 seeded with `seed`): fresh
// random tokens for demos, checks and tests, never zeros.
std::vector<num::bf16_t> make_random_tokens(size_t n, uint64_t seed);

}  // namespace megamoe
