// `megamoe bench`: times the CUDA layer against the floors (streaming-read
// bandwidth and the FP8 tensor-core rate) and the cuBLASLt baseline, all
// measured in the same run, and returns the results as JSON.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megamoe/model/shape.h"

namespace megamoe::api {

struct BenchOptions {
  std::vector<std::string> presets{"glm-5.3-flash", "glm-5", "deepseek-v3"};
  std::vector<int> tokens{1, 8, 64, 256, 1024, 4096, 16384};
  bool ep8_share = true;  // also the one-rank share of an 8-way expert-parallel layer
  bool baseline = true;   // cuBLASLt expert-by-expert baseline
  // Also time the routing's kernels one by one and a streaming read of each case's
  // weight bytes after the same L2 flush.
  bool diagnostics = false;
  // > 0: also the board energy of each case's layer (NVML), over graph replays for
  // this many seconds after the timing (bench::measure_energy). Off by default: it
  // adds seconds a case.
  double energy_seconds = 0;
  // ranks > 1: the expert-parallel layer over that many virtual ranks on this GPU,
  // `tokens` per rank, against one device running all R * T tokens (the
  // virtual-rank overhead); the figures above are not measured then.
  int ranks = 1;
  std::string ep_transport = "virtual";  // or "nccl": rank r on GPU r, one process
  // Overrides of every preset's shape (0 / -1: keep), e.g. the DeepSeek-V4-Flash
  // shape as glm-5.3-flash with --experts 256 --topk 6 --shared-experts 0.
  int experts = 0, topk = 0, shared_experts = -1;
  int warmup = 3;
  int iters = 15;
  double tc_peak_tflops = 1424.0;  // best library's block-scaled FP8 dense GEMM on an H200
};

// A preset's shape with the options' overrides applied (validated).
MoeShape bench_shape(const std::string& preset, const BenchOptions& opt);

// Runs every case; `log` receives one human-readable line per case.
nlohmann::json run_bench(const BenchOptions& opt, const std::function<void(const std::string&)>& log);

}  // namespace megamoe::api
