// Argument checks shared by the CUDA layer objects (moe_layer.cu, ep_layer.cu):
// clear errors for shapes the kernels do not take and pointers they cannot use.
#pragma once

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstdint>
#include <stdexcept>

#include "../kernels/cuda_check.h"
#include "../kernels/heuristics.h"
#include "megamoe/model/shape.h"

namespace megamoe::api {

inline void require_device_memory(const void* p, const char* what) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess || attr.type != cudaMemoryTypeDevice) {
    cudaGetLastError();
    throw std::invalid_argument(fmt::format("{}: pointer {} is not device memory", what, p));
  }
  int dev = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
  if (attr.device != dev)
    throw std::invalid_argument(
        fmt::format("{}: pointer is on device {}, the layer on device {}", what, attr.device, dev));
}

inline void require_aligned(const void* p, size_t align, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % align != 0)
    throw std::invalid_argument(fmt::format("{}: pointer {} is not {}-byte aligned", what, p, align));
}

inline void validate_shape(const MoeShape& s) {
  s.validate();
  if (s.hidden % 128 != 0)
    throw std::invalid_argument(fmt::format("CUDA backend: H = {} must be a multiple of 128", s.hidden));
  if (s.inter % 128 != 0)
    throw std::invalid_argument(fmt::format("CUDA backend: I = {} must be a multiple of 128", s.inter));
  if (s.experts + (s.has_shared() ? 1 : 0) > kernels::kMaxExpertsTotal)
    throw std::invalid_argument(
        fmt::format("CUDA backend: at most {} experts (E = {})", kernels::kMaxExpertsTotal - 1, s.experts));
  if (s.topk + (s.has_shared() ? 1 : 0) > 32)
    throw std::invalid_argument(
        fmt::format("CUDA backend: top-k plus the shared expert must be <= 32 slots (K = {})", s.topk));
}

}  // namespace megamoe::api
