// Internal seam between the host API and the CUDA backend (src/api/*.cu).
// Built without CUDA, these functions throw: there is no silent fallback.
#pragma once

#include <string>

#include "megamoe/api/forward.h"

namespace megamoe::api::detail {

bool cuda_device_ok(std::string* why);
ForwardOutput cuda_forward(const HostMoeWeights& w, const num::bf16_t* x, int T, int ranks);

}  // namespace megamoe::api::detail
