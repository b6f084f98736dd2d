// device_memory.h with CUDA: thin checked wrappers over the CUDA runtime
// (the non-CUDA build gets throwing stubs from src/weights/device_memory.cpp).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <stdexcept>

#include "../kernels/cuda_check.h"
#include "megamoe/weights/device_memory.h"

namespace megamoe::dev {

bool device_memory_available(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();  // clear the sticky error so later calls are not confused by it
    if (why) {
      // cudart reports a missing driver as "insufficient driver": say what it means.
      if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice || n == 0)
        *why = "no NVIDIA GPU (driver or device) on this machine";
      else
        *why = std::string("the CUDA runtime cannot use the GPU: ") + cudaGetErrorString(e);
    }
    return false;
  }
  return true;
}

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(fmt::format("cudaMalloc of {} bytes failed: {} ({})", bytes, cudaGetErrorName(e),
                                         cudaGetErrorString(e)));
  }
  return p;
}

void device_free(void* p) noexcept {
  if (p) cudaFree(p);
}

void copy_to_device(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  // NOTE: from pageable host memory (a mapped checkpoint, a vector) cudaMemcpy may return
  // once the bytes are staged, before they land; the store's contract is that a call
  // returns with them in place (a forward on a non-blocking stream may follow at once).
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cudaStreamPerThread));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
}

void copy_to_host(void* dst, const void* src, size_t bytes) {
  if (bytes) MEGAMOE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

void device_memset(void* dst, int value, size_t bytes) {
  if (bytes) {
    // NOTE: asynchronous for device memory; the store's contract is that a call returns
    // with the bytes in place (waiting for this memset only, not the device's other work).
    MEGAMOE_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, cudaStreamPerThread));
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
  }
}

PointerInfo pointer_info(const void* p) {
  static const bool have_device = device_memory_available();
  PointerInfo info;
  cudaPointerAttributes a{};
  if (!p || !have_device) return info;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // (not a pointer CUDA knows: host memory)
    return info;
  }
  info.device = a.type == cudaMemoryTypeDevice;
  info.managed = a.type == cudaMemoryTypeManaged;
  if (info.device) info.ordinal = a.device;
  return info;
}

void copy_device_to_device(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  // NOTE: a device-to-device cudaMemcpy may return before the copy is done; the caller
  // may reuse its source as soon as we return, so wait for this copy (and only it: the
  // thread's default stream, not the whole device).
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cudaStreamPerThread));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
}

}  // namespace megamoe::dev
