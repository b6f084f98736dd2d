// Internal seam between the host API and the CUDA backend (src/api/*.cu).
// Built without CUDA, these functions throw: there is no silent fallback.
#pragma once

#include <string>

#include "megamoe/api/forward.h"
#include "megamoe/kernels/overrides.h"
#include "megamoe/transport/transport.h"

namespace megamoe::api::detail {

bool cuda_device_ok(std::string* why);
ForwardOutput cuda_forward(const HostMoeWeights& w, const num::bf16_t* x, int T, int ranks);

// The process's switches (kernels::Overrides: the environment, or a test's ScopedOverrides),
// read here, at the API edge, and passed down to the kernels and the transport: the library's
// one reader of them.
const kernels::Overrides& switches();
// Where the NCCL transport looks for its library, from switches().
transport::NcclSearch nccl_search();

}  // namespace megamoe::api::detail
