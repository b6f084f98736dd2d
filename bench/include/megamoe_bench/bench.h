// `megamoe bench`: times the CUDA layer against the floors (streaming-read
// bandwidth, and the compute floor at the rate of a dense block-scaled FP8 GEMM of
// the layer's shapes on the same card) and the cuBLASLt baseline, all measured in
// the same run, in two regimes (sustained, burst), and returns the results as JSON.
// Part of the megamoe_bench target (bench/): linked into the command and the tests,
// never into the library a user links nor installed with it.
#pragma once

#include <cstddef>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megamoe/model/shape.h"

namespace megamoe::api {

struct BenchOptions {
  std::vector<std::string> presets{"glm-5.3-flash", "glm-5", "deepseek-v3"};
  std::vector<int> tokens{1, 8, 64, 256, 1024, 4096, 8192, 16384};
  // "uniform" (the layer's router on random x) and / or "zipf:S" (routing_gen.h: the
  // layer runs on generated ids through external routing, its router timed alongside).
  std::vector<std::string> routings{"uniform"};
  // "sustained" and / or "burst" (bench::Regime); every case is timed in each.
  std::vector<std::string> regimes{"sustained", "burst"};
  double sustained_seconds = 1.0;  // the layer's (and the dense GEMM's) timed window
  double ramp_seconds = 0.2;       // untimed replays before it
  // The routing alone and the cuBLASLt baseline run right after the layer (the card
  // still at its cap) for this fraction of the window.
  double side_window_fraction = 0.25;
  double burst_gap_ms = 50;
  int dense_m = 16384;    // rows of the dense GEMM pair (enough to saturate the card)
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
  int iters = 15;  // burst: timed calls a case (expert-parallel mode: timed replays)
  uint64_t routing_seed = 48;
};

// `--quick`: fewer timed calls and shorter windows, for a check that everything runs.
void make_quick(BenchOptions& opt);

// Throws std::invalid_argument naming the bad option (routings, regimes, windows).
void validate_bench_options(const BenchOptions& opt);

// A preset's shape with the options' overrides applied (validated).
MoeShape bench_shape(const std::string& preset, const BenchOptions& opt);

// `--json auto`: bench/results/h100.json or h200.json from the device's name
// ("NVIDIA H100 80GB HBM3" -> h100); throws std::invalid_argument for another card.
std::string bench_results_path(const std::string& device_name);

// The name of the current CUDA device (throws without one).
std::string bench_device_name();

// One case in one regime, as measured; bench_case_record derives the rest.
struct BenchCaseFigures {
  std::string preset, shape, routing, regime, config, baseline_timing;
  int tokens = 0, local_experts = 0, ep_share = 1;
  size_t experts_hit = 0;
  double hot_expert_rows = 0;  // the busiest expert's rows / the mean over the experts
  double weight_bytes = 0;     // the experts hit and the shared one
  double flops = 0;            // T x flops a token
  double read_bw = 0;          // bytes/s, the in-run streaming read
  double dense_tflops = 0;     // the in-run dense GEMM pair of this regime
  double us = 0, us_p10 = 0, us_p90 = 0, route_us = 0;
  double baseline_us = -1;  // -1: not measured
  double sm_clock_mhz = -1, power_w = -1;
  int calls = 0;
  size_t nonfinite = 0;
};

// The case's JSON entry: the figures plus tflops, floors (floor_us = max(read floor,
// compute floor at dense_tflops)), dense_fraction, ratios. Throws std::invalid_argument
// on a regime other than "sustained" / "burst" or a non-positive time or rate.
nlohmann::json bench_case_record(const BenchCaseFigures& f);

// The human-readable line of the same.
std::string bench_case_line(const BenchCaseFigures& f);

// Runs every case; `log` receives one human-readable line per case.
nlohmann::json run_bench(const BenchOptions& opt, const std::function<void(const std::string&)>& log);

}  // namespace megamoe::api
