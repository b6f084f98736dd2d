// Device buffers and timed runs shared by the CUDA host code (cuda_backend.cu,
// ep_layer.cu, and the bench's bench/src/bench.cu, which includes this header by path as
// one of the library's two internals it uses): memory freed on every path, one warm-up
// before a timing.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <utility>

#include "../kernels/cuda_check.h"

namespace megamoe::api {

// cudaMalloc on the current device (at least 256 bytes, so empty batches still get a
// valid pointer), cudaFree when it goes; movable.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) { MEGAMOE_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 256))); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p(std::exchange(o.p, nullptr)) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
  void* p = nullptr;
};

// A stream and two events: time_second(run) runs once to warm up (module load, first
// touch), then times a second run; the stream is synchronized afterwards.
class TimedStream {
 public:
  TimedStream() {
    MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    MEGAMOE_CUDA_CHECK(cudaEventCreate(&e0_));
    MEGAMOE_CUDA_CHECK(cudaEventCreate(&e1_));
  }
  ~TimedStream() {
    cudaEventDestroy(e0_);
    cudaEventDestroy(e1_);
    cudaStreamDestroy(stream);
  }
  TimedStream(const TimedStream&) = delete;
  TimedStream& operator=(const TimedStream&) = delete;
  template <typename Run>
  double time_second(Run run) {
    run();
    MEGAMOE_CUDA_CHECK(cudaEventRecord(e0_, stream));
    run();
    MEGAMOE_CUDA_CHECK(cudaEventRecord(e1_, stream));
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    float ms = 0;
    MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0_, e1_));
    return ms * 1e-3;
  }
  cudaStream_t stream = nullptr;

 private:
  cudaEvent_t e0_ = nullptr, e1_ = nullptr;
};

}  // namespace megamoe::api
