// Return-code checks for CUDA runtime calls inside the library (src/) and the bench.
// A failed call throws std::runtime_error naming the call, the code and the
// place, so a host caller (tool, test) can report it; nothing is retried or
// silently ignored.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace megamoe::detail {

[[noreturn]] inline void throw_cuda(const char* call, cudaError_t e, const char* file, int line) {
  throw std::runtime_error(std::string(call) + " failed: " + cudaGetErrorName(e) + " (" +
                           cudaGetErrorString(e) + ") at " + file + ":" + std::to_string(line));
}

}  // namespace megamoe::detail

#define MEGAMOE_CUDA_CHECK(call)                                                                             \
  do {                                                                                                       \
    const cudaError_t megamoe_err_ = (call);                                                                 \
    if (megamoe_err_ != cudaSuccess) ::megamoe::detail::throw_cuda(#call, megamoe_err_, __FILE__, __LINE__); \
  } while (0)

// NOTE: a kernel launch reports configuration errors only through
// cudaGetLastError(); call this right after every <<<...>>>.
#define MEGAMOE_CUDA_CHECK_LAUNCH() MEGAMOE_CUDA_CHECK(cudaGetLastError())

// A host-side precondition of a launcher: throws with the condition and `msg`.
#define MEGAMOE_CHECK(cond, msg)                                                                          \
  do {                                                                                                    \
    if (!(cond))                                                                                          \
      throw std::runtime_error(std::string("check failed: ") + #cond + ": " + std::string(msg) + " at " + \
                               __FILE__ + ":" + std::to_string(__LINE__));                                \
  } while (0)
