// device_memory.h without CUDA: every call is a clear error. With CUDA the
// definitions live in src/api/weights_device.cu and this file is empty.
#include "megamoe/weights/device_memory.h"

#if !defined(MEGAMOE_HAVE_CUDA)

#include <stdexcept>

namespace megamoe::dev {

namespace {

[[noreturn]] void no_cuda(const char* what) {
  throw std::runtime_error(std::string(what) +
                           ": this build has no CUDA backend (nvcc was not found at configure time)");
}

}  // namespace

bool device_memory_available(std::string* why) {
  if (why) *why = "this build has no CUDA backend (nvcc was not found at configure time)";
  return false;
}

void* device_alloc(size_t) { no_cuda("device_alloc"); }
void device_free(void*) noexcept {}
void copy_to_device(void*, const void*, size_t) { no_cuda("copy_to_device"); }
void copy_to_host(void*, const void*, size_t) { no_cuda("copy_to_host"); }
void device_memset(void*, int, size_t) { no_cuda("device_memset"); }
PointerInfo pointer_info(const void*) { return {}; }
void copy_device_to_device(void*, const void*, size_t) { no_cuda("copy_device_to_device"); }

}  // namespace megamoe::dev

#endif  // !MEGAMOE_HAVE_CUDA
