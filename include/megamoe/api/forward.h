// Host API: one forward of an MoE layer on a chosen backend. The CPU backend is
// the kernel-faithful reference; the CUDA backend is the fused Hopper kernel.
// No silent fallback: asking for CUDA where there is none is an error.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megamoe/model/shape.h"
#include "megamoe/numerics/fp8.h"
#include "megamoe/weights/host_weights.h"

namespace megamoe::api {

enum class Backend { kAuto, kCpu, kCuda };

Backend parse_backend(const std::string& name);  // auto|cpu|cuda, throws otherwise
std::string to_string(Backend b);

// True when the library was built with CUDA and a device of compute
// capability 9.0 is present. `why` (optional) says what is missing.
bool cuda_available(std::string* why = nullptr);

// kAuto -> kCuda when available, else kCpu (this is the documented choice, printed by the tools);
// kCuda without a usable device throws std::runtime_error saying what is missing (callers
// resolve before building inputs, so an impossible request fails first, not after them).
Backend resolve(Backend b);

struct ForwardOutput {
  std::vector<num::bf16_t> y;  // [T][H]
  std::vector<int32_t> ids;    // [T][K]
  std::vector<float> weights;  // [T][K]
  double seconds = 0;          // compute time (device time for CUDA, wall for CPU)
  Backend backend = Backend::kCpu;
};

// x: bf16 [T][H] in host memory. ranks > 1 splits the tokens evenly over R
// (simulated or virtual) expert-parallel ranks.
ForwardOutput forward(Backend b, const HostMoeWeights& w, const num::bf16_t* x, int T, int ranks = 1);

}  // namespace megamoe::api
