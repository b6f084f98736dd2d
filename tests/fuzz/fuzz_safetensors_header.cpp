// libFuzzer target for io::parse_header, the one parser that sees untrusted
// bytes before anything else. Built by scripts/fuzz.sh with clang
// (-fsanitize=fuzzer,address,undefined), not by the main CMake build.
//
// Contract checked: any input either parses into a header whose every tensor
// lies inside the buffer, sorted and non-overlapping, with a byte size that
// matches dtype x shape, or throws io::FormatError. Any other exception, an
// out-of-bounds read (ASan) or undefined behaviour (UBSan) is a crash.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "megamoe/io/safetensors.h"

namespace {

[[noreturn]] void fail(const char* what, const megamoe::io::TensorInfo& t) {
  std::fprintf(stderr, "parse_header accepted a bad header: %s (tensor '%s')\n", what, t.name.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace megamoe::io;
  Header h;
  try {
    h = parse_header(data, size, "fuzz-input");
  } catch (const FormatError&) {
    return 0;  // the expected outcome for hostile input
  }
  if (h.data_offset < 8 || h.data_offset > size) std::abort();
  const uint64_t data_bytes = size - h.data_offset;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : h.tensors) {
    if (t.begin > t.end) fail("begin > end", t);
    if (t.end > data_bytes) fail("range past the end of the file", t);
    // NOTE: a zero dimension anywhere makes the count 0 however large the others are (the
    // parser multiplies in order with an overflow check, as the format's reference does),
    // so it is found before the early stop below, which is only sound for a growing product.
    unsigned __int128 n = dtype_size(t.dtype);
    for (int64_t d : t.shape) {
      if (d < 0) fail("negative dimension", t);
      if (d == 0) n = 0;
    }
    for (int64_t d : t.shape) {
      if (n == 0 || n > size) break;  // n > size: cannot match a range inside the buffer anyway
      n *= uint64_t(d);
    }
    if (n != t.bytes()) fail("byte size differs from dtype x shape", t);
    if (prev && !(prev->name < t.name)) fail("tensors not sorted by unique name", t);
    if (h.find(t.name) != &t) fail("find() does not return the tensor", t);
    prev = &t;
  }
  return 0;
}
