// Test support for the WeightStore tests: small synthetic checkpoints in a
// per-test temporary directory, and running the CLI binary.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

#include "megamoe/model/config.h"
#include "megamoe/weights/checkpoint_layout.h"

namespace megamoe::test {

// H=256 I=128 E=8 K=4, one shared expert, fp32 router: small enough for CI,
// with H and I multiples of 128 (the kernel) and 32 (MXFP8).
inline MoeShape store_test_shape() {
  MoeShape s;
  s.hidden = 256, s.inter = 128, s.experts = 8, s.topk = 4, s.shared_experts = 1;
  s.routed_scaling = 2.5f, s.swiglu_limit = 10.0f, s.router_dtype = RouterDtype::kF32;
  return s;
}

// A fresh directory named after the running test, removed by the destructor.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string("megamoe_") + info->test_suite_name() + "_" + info->name() + "_" +
                       std::to_string(::getpid());
    std::replace(name.begin(), name.end(), '/', '_');  // parameterized names contain '/'
    path_ = std::filesystem::temp_directory_path() / name;
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// A GLM-5.3-Flash-family checkpoint (text_config, language_model prefix) of
// `layers` MoE layers with the test shape.
inline ModelDesc write_test_checkpoint(const std::filesystem::path& dir, int layers, uint64_t seed,
                                       bool pow2_scales = false) {
  return write_synthetic_checkpoint(dir, find_preset("glm-5.3-flash"), layers, seed, pow2_scales,
                                    store_test_shape());
}

#ifdef MEGAMOE_CLI_PATH  // (the GPU tests include this header for its checkpoints only)
struct CliResult {
  int status = -1;
  std::string output;  // stdout and stderr together
};

// Runs the megamoe binary with `args` (already shell-quoted), with `env` (NAME=VALUE ...,
// no quoting needed) added to its environment when given.
inline CliResult run_cli(const std::string& args, const std::string& env = "") {
  CliResult r;
  const std::string cmd =
      (env.empty() ? "" : "env " + env + " ") + std::string(MEGAMOE_CLI_PATH) + " " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}
#endif  // MEGAMOE_CLI_PATH

}  // namespace megamoe::test
