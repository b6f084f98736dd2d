// The host side of `megamoe bench` (bench/include/megamoe_bench/bench.h): options, the
// results path, and each case's record and line, built from measured figures
// (CPU code, so the field layout is tested without a GPU).
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <stdexcept>

#include "megamoe_bench/bench.h"
#include "megamoe_bench/routing_gen.h"

namespace megamoe::api {

void make_quick(BenchOptions& opt) {
  opt.iters = 5;
  opt.sustained_seconds = 0.25;
  opt.ramp_seconds = 0.05;
  opt.dense_m = 8192;
}

void validate_bench_options(const BenchOptions& opt) {
  if (opt.routings.empty()) throw std::invalid_argument("--routing: expected at least one, found none");
  for (const std::string& r : opt.routings) parse_routing(r);
  if (opt.regimes.empty())
    throw std::invalid_argument("--regime: expected sustained, burst or both, found none");
  for (const std::string& r : opt.regimes)
    if (r != "sustained" && r != "burst")
      throw std::invalid_argument(fmt::format("--regime: expected sustained, burst or both, found '{}'", r));
  if (!(opt.sustained_seconds > 0) || !(opt.ramp_seconds >= 0) || !(opt.side_window_fraction > 0))
    throw std::invalid_argument(fmt::format(
        "bench: expected a sustained window > 0 s, a ramp >= 0 s and a side window > 0, found {} s, {} s, {}",
        opt.sustained_seconds, opt.ramp_seconds, opt.side_window_fraction));
  if (!(opt.burst_gap_ms >= 0))
    throw std::invalid_argument(fmt::format("--burst-gap-ms: expected >= 0, found {}", opt.burst_gap_ms));
  if (opt.dense_m < 128 || opt.dense_m % 128 != 0)
    throw std::invalid_argument(
        fmt::format("--dense-m: expected a multiple of 128, >= 128, found {}", opt.dense_m));
  if (opt.iters < 1) throw std::invalid_argument(fmt::format("--iters: expected >= 1, found {}", opt.iters));
}

MoeShape bench_shape(const std::string& preset, const BenchOptions& opt) {
  MoeShape s = find_preset(preset).shape;
  if (opt.experts > 0) s.experts = opt.experts;
  if (opt.topk > 0) s.topk = opt.topk;
  if (opt.shared_experts >= 0) s.shared_experts = opt.shared_experts;
  if (s.n_group > 1 && s.experts % s.n_group != 0) s.n_group = 1, s.topk_group = 1;
  s.validate();
  return s;
}

std::string bench_results_path(const std::string& device_name) {
  std::string lower = device_name;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return char(std::tolower(c)); });
  // (whole words: "H100" or "H200" followed by a non-digit or the end)
  auto has = [&](const std::string& w) {
    for (size_t p = lower.find(w); p != std::string::npos; p = lower.find(w, p + 1)) {
      const size_t e = p + w.size();
      if ((p == 0 || !std::isalnum((unsigned char)lower[p - 1])) &&
          (e == lower.size() || !std::isdigit((unsigned char)lower[e])))
        return true;
    }
    return false;
  };
  const bool h100 = has("h100"), h200 = has("h200");
  if (h100 != h200) return h100 ? "bench/results/h100.json" : "bench/results/h200.json";
  throw std::invalid_argument(fmt::format(
      "--json auto: expected an H100 or H200 device (bench/results/h100.json, h200.json), found '{}'; "
      "give --json a path",
      device_name));
}

namespace {

void check_figures(const BenchCaseFigures& f) {
  if (f.regime != "sustained" && f.regime != "burst")
    throw std::invalid_argument(
        fmt::format("bench_case_record: regime expected sustained or burst, found '{}'", f.regime));
  if (!(f.us > 0) || !(f.dense_tflops > 0) || !(f.read_bw > 0) || !(f.flops >= 0) || !(f.weight_bytes >= 0))
    throw std::invalid_argument(
        fmt::format("bench_case_record: expected us > 0, dense_tflops > 0, read_bw > 0, flops and bytes >= "
                    "0; found us {}, "
                    "dense_tflops {}, read_bw {}, flops {}, bytes {}",
                    f.us, f.dense_tflops, f.read_bw, f.flops, f.weight_bytes));
}

struct Derived {
  double tflops, hbm_floor_us, tc_floor_us, floor_us, dense_fraction, weight_TBps, speedup;
};

Derived derive(const BenchCaseFigures& f) {
  Derived d;
  d.tflops = f.flops / (f.us * 1e-6) * 1e-12;
  d.hbm_floor_us = f.weight_bytes / f.read_bw * 1e6;
  d.tc_floor_us = f.flops / (f.dense_tflops * 1e12) * 1e6;
  d.floor_us = std::max(d.hbm_floor_us, d.tc_floor_us);
  d.dense_fraction = d.tflops / f.dense_tflops;
  d.weight_TBps = f.weight_bytes / (f.us * 1e-6) * 1e-12;
  d.speedup = f.baseline_us > 0 ? f.baseline_us / f.us : 0.0;
  return d;
}

}  // namespace

nlohmann::json bench_case_record(const BenchCaseFigures& f) {
  check_figures(f);
  const Derived d = derive(f);
  nlohmann::json c;
  c["preset"] = f.preset;
  c["shape"] = f.shape;
  c["tokens"] = f.tokens;
  c["local_experts"] = f.local_experts;
  c["ep_share"] = f.ep_share;
  c["routing"] = f.routing;
  c["regime"] = f.regime;
  c["us"] = f.us;
  c["us_p10"] = f.us_p10;
  c["us_p90"] = f.us_p90;
  c["calls"] = f.calls;
  c["route_us"] = f.route_us;
  c["after_routing_us"] = f.us - f.route_us;
  c["tflops"] = d.tflops;
  c["dense_tflops"] = f.dense_tflops;
  c["dense_fraction"] = d.dense_fraction;
  c["floor_us"] = d.floor_us;
  c["hbm_floor_us"] = d.hbm_floor_us;
  c["tc_floor_us"] = d.tc_floor_us;
  c["ratio_to_floor"] = f.us / d.floor_us;
  c["experts_hit"] = f.experts_hit;
  c["hot_expert_rows"] = f.hot_expert_rows;
  c["weight_bytes"] = f.weight_bytes;
  c["weight_TBps"] = d.weight_TBps;
  c["sm_clock_mhz"] = f.sm_clock_mhz;
  c["power_w"] = f.power_w;
  c["baseline_us"] = f.baseline_us;
  if (!f.baseline_timing.empty()) c["baseline_timing"] = f.baseline_timing;
  c["speedup_vs_baseline"] = d.speedup;
  c["nonfinite_outputs"] = f.nonfinite;
  c["config"] = f.config;
  return c;
}

std::string bench_case_line(const BenchCaseFigures& f) {
  check_figures(f);
  const Derived d = derive(f);
  return fmt::format(
      "{:14s} E={:3d} T={:5d} {} {:9s}: {:9.1f} us (p10 {:.1f}, p90 {:.1f}; route {:.1f}) floor {:8.1f} "
      "(x{:.2f}) "
      "{:7.1f} TFLOP/s = {:.3f} of dense {:.0f} | {:4.0f} MHz {:3.0f} W | {:5.2f} TB/s | cuBLASLt {:9.1f} us "
      "(x{:.2f}) | {}",
      f.preset, f.local_experts, f.tokens, f.routing, f.regime, f.us, f.us_p10, f.us_p90, f.route_us,
      d.floor_us, f.us / d.floor_us, d.tflops, d.dense_fraction, f.dense_tflops, f.sm_clock_mhz, f.power_w,
      d.weight_TBps, f.baseline_us, d.speedup, f.config);
}

}  // namespace megamoe::api
