// `megamoe doctor` and `megamoe --version` through the CLI binary: they run on any machine
// (this one has no GPU), exit 0 and print one line for each thing a user needs to know
// before running: the build, the CUDA runtime and driver, the GPUs, whether the CUDA
// backend is usable, and the NCCL the nccl transport will load, with the candidates refused.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "store_support.h"

namespace megamoe {
namespace {

using test::run_cli;

// The line of `out` that starts with `prefix` ("" where none does).
std::string line_starting(const std::string& out, const std::string& prefix) {
  size_t at = 0;
  while (at < out.size()) {
    const size_t end = out.find('\n', at);
    const std::string line = out.substr(at, end == std::string::npos ? std::string::npos : end - at);
    if (line.starts_with(prefix)) return line;
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return {};
}

TEST(CliDoctor, PrintsEveryLineAndExitsZero) {
  const auto r = run_cli("doctor");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(r.output.starts_with("megamoe ")) << r.output;
  for (const char* prefix : {"build: ", "CUDA backend: ", "NCCL"})
    EXPECT_NE(line_starting(r.output, prefix), "") << "no line starting '" << prefix << "':\n" << r.output;
#if defined(MEGAMOE_HAVE_CUDA)
  for (const char* prefix : {"CUDA runtime: ", "CUDA driver: ", "GPUs: ", "NCCL: ", "NCCL candidates"})
    EXPECT_NE(line_starting(r.output, prefix), "") << "no line starting '" << prefix << "':\n" << r.output;
  // The backend's line agrees with the GPU count: no GPU, not usable (and says why).
  if (line_starting(r.output, "GPUs: ").starts_with("GPUs: none")) {
    EXPECT_TRUE(line_starting(r.output, "CUDA backend: ").starts_with("CUDA backend: not usable: ")) << r.output;
  }
  // Either a library is chosen (path and version) or the line says none is and how to name one.
  const std::string nccl = line_starting(r.output, "NCCL: ");
  EXPECT_TRUE(nccl.find("libnccl") != std::string::npos || nccl.find("MEGAMOE_NCCL_LIB") != std::string::npos)
      << nccl;
#else
  EXPECT_NE(line_starting(r.output, "build: CPU only"), "") << r.output;
  EXPECT_TRUE(line_starting(r.output, "CUDA backend: ").starts_with("CUDA backend: not usable: ")) << r.output;
#endif
}

#if defined(MEGAMOE_HAVE_CUDA)
// MEGAMOE_NCCL_LIB is an explicit choice: the only candidate, and a library that cannot
// serve is named with the reason (no search goes on past it).
TEST(CliDoctor, NamedNcclLibraryIsTheOnlyCandidate) {
  {
    const auto r = run_cli("doctor", "MEGAMOE_NCCL_LIB=/nonexistent/libnccl.so.2");
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_TRUE(line_starting(r.output, "NCCL: ").starts_with("NCCL: none usable")) << r.output;
    EXPECT_NE(line_starting(r.output, "  MEGAMOE_NCCL_LIB: /nonexistent/libnccl.so.2: refused: cannot load"), "")
        << r.output;
    EXPECT_EQ(r.output.find("system loader"), std::string::npos) << r.output;
  }
  {  // a real shared library that is not NCCL
    const auto r = run_cli("doctor", "MEGAMOE_NCCL_LIB=libm.so.6");
    ASSERT_EQ(r.status, 0) << r.output;
    const std::string c = line_starting(r.output, "  MEGAMOE_NCCL_LIB: libm.so.6");
    EXPECT_NE(c.find("refused: has no ncclGetVersion"), std::string::npos) << r.output;
  }
}
#endif

TEST(CliDoctor, VersionNamesRuntimeAndNccl) {
  const auto r = run_cli("--version");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(r.output.starts_with("megamoe ")) << r.output;
#if defined(MEGAMOE_HAVE_CUDA)
  for (const char* prefix : {"CUDA runtime: ", "CUDA driver: ", "NCCL: "})
    EXPECT_NE(line_starting(r.output, prefix), "") << "no line starting '" << prefix << "':\n" << r.output;
#else
  EXPECT_NE(line_starting(r.output, "CUDA: this build has no CUDA backend"), "") << r.output;
#endif
}

}  // namespace
}  // namespace megamoe
