// Argument checks shared by the CUDA layer objects (moe_layer.cu, ep_layer.cu):
// clear errors for shapes the kernels do not take and pointers they cannot use.
#pragma once

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "../kernels/cuda_check.h"
#include "../kernels/heuristics.h"
#include "megamoe/model/shape.h"
#include "megamoe/weights/device_memory.h"

namespace megamoe::api {

// Restores the caller's current device on every path. Never throws, so destructors use it
// too (a failed query leaves nothing to restore; the next CUDA call reports the error).
struct DeviceGuard {
  int saved = -1;
  DeviceGuard() noexcept {
    if (cudaGetDevice(&saved) != cudaSuccess) saved = -1, cudaGetLastError();
  }
  ~DeviceGuard() {
    if (saved >= 0) cudaSetDevice(saved);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
};

inline void require_device_memory(const void* p, const char* what) {
  const dev::PointerInfo info = dev::pointer_info(p);
  if (!info.device) throw std::invalid_argument(fmt::format("{}: pointer {} is not device memory", what, p));
  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  if (info.ordinal != device)
    throw std::invalid_argument(
        fmt::format("{}: pointer is on device {}, the layer on device {}", what, info.ordinal, device));
}

// The pointers a forward is handed (x, y, the device token count) must be device or
// managed memory of the layer's device: a host pointer would fault inside the kernel and
// take the CUDA context with it. The check is a driver query, so a pointer is checked the
// first time it comes (an engine reuses its buffers; the last kRemember are kept), and
// not while the stream is capturing: a graph is captured after eager forwards with the
// same buffers, and a query is not worth an invalidated capture.
class IoPointerCheck {
 public:
  // The message names "[rank R ]op arg" (rank >= 0: an expert-parallel rank), formed
  // only on failure: this runs on every forward.
  void require(const void* p, int device, const char* op, const char* arg, cudaStream_t stream,
               int rank = -1) {
    auto fail = [&](const std::string& why) {
      throw std::invalid_argument(
          fmt::format("{}{} {}: {}", rank < 0 ? std::string() : fmt::format("rank {} ", rank), op, arg, why));
    };
    if (!p) fail("null pointer");
    for (const void* q : seen_)
      if (q == p) return;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess) {
      cudaGetLastError();
      return;  // (the legacy stream while another stream captures: the launch decides)
    }
    if (cs != cudaStreamCaptureStatusNone) return;
    const dev::PointerInfo info = dev::pointer_info(p);
    if (!info.device && !info.managed) fail(fmt::format("pointer {} is not device memory", p));
    if (info.device && info.ordinal != device)
      fail(fmt::format("pointer is on device {}, the layer on device {}", info.ordinal, device));
    seen_[next_++ % seen_.size()] = p;
  }

 private:
  static constexpr size_t kRemember = 8;
  std::array<const void*, kRemember> seen_{};
  size_t next_ = 0;
};

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
