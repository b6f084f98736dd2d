// The few device-memory calls the weight layer needs (WeightStore's device
// buffers, the tools' input/output buffers), behind plain functions so that
// host-only C++ never includes a CUDA header.
//
// Implemented in src/api/weights_device.cu when the library is built with
// CUDA; otherwise (src/weights/device_memory.cpp) every call throws: there is
// no silent fallback to host memory.
#pragma once

#include <cstddef>
#include <string>

namespace megamoe::dev {

// True when this build has the CUDA backend and a device can be used; `why`
// (optional) says what is missing.
bool device_memory_available(std::string* why = nullptr);

// cudaMalloc: 256-byte aligned device memory of the current device. Throws
// std::runtime_error naming the size and the CUDA error.
void* device_alloc(size_t bytes);
// cudaFree; null is a no-op. Never throws (used from destructors).
void device_free(void* p) noexcept;

// Synchronous copies and memset (the loader is not on a hot path; a
// synchronous copy also means the source may be unmapped right after).
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
void device_memset(void* dst, int value, size_t bytes);

// What CUDA knows of a pointer: device (cudaMalloc) or managed memory, and on which
// device. Host memory, null, and any pointer without a device (or a CUDA build) are
// neither. (It initializes the CUDA runtime when a device is present: call it where
// device memory is in use anyway.)
struct PointerInfo {
  bool device = false;   // cudaMalloc'ed (on `ordinal`)
  bool managed = false;  // cudaMallocManaged
  int ordinal = -1;
};
PointerInfo pointer_info(const void* p);
// Device or managed memory, e.g. a tensor on the GPU handed to WeightStore::update.
inline bool is_device_pointer(const void* p) {
  const PointerInfo i = pointer_info(p);
  return i.device || i.managed;
}
// Device -> device (any device of the process), returning with the bytes in place.
void copy_device_to_device(void* dst, const void* src, size_t bytes);

}  // namespace megamoe::dev
