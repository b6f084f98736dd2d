// The `megamoe` command: demo, forward, bench, make-checkpoint, inspect, doctor.
// Every error names what is wrong and exits non-zero.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "commands.h"
#include "megamoe/api/ep_layer.h"
#include "megamoe/api/forward.h"
#include "megamoe/io/safetensors.h"
#include "megamoe/model/config.h"
#include "megamoe/reference/moe.h"
#include "megamoe/weights/host_weights.h"
#include "megamoe/weights/store.h"
#include "megamoe_bench/bench.h"
#include "megamoe_git_commit.h"

#if defined(MEGAMOE_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include "megamoe/transport/transport.h"
#endif

namespace fs = std::filesystem;
using namespace megamoe;

namespace {

double rel_l2(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : 0.0;
}

// ---------------------------------------------------------------- demo
struct DemoArgs {
  std::string preset = "glm-5.3-flash";
  int tokens = 64;
  std::string backend = "auto";
  int check_tokens = 4;
  uint64_t seed = 1;
};

int run_demo(const DemoArgs& a) {
  const Preset& p = find_preset(a.preset);
  const MoeShape& s = p.shape;
  if (a.tokens < 1) throw std::invalid_argument(fmt::format("--tokens {} must be >= 1", a.tokens));
  const api::Backend asked = api::parse_backend(a.backend);
  // (an explicit cuda without a device fails here, before the weights are made)
  const api::Backend b = api::resolve(asked);
  if (asked == api::Backend::kAuto) {
    std::string why;
    api::cuda_available(&why);
    fmt::print("backend: auto -> {}{}\n", api::to_string(b), b == api::Backend::kCpu ? " (" + why + ")" : "");
  }
  fmt::print("preset {} ({}): {}\n", p.name, p.model_type, s.describe());
  const auto t0 = std::chrono::steady_clock::now();
  HostMoeWeights w = make_random_weights(s, a.seed);
  const double gen_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("random block-FP8 layer: {:.2f} GB of weights in {:.1f} s (non-power-of-two scales)\n",
             w.bytes() * 1e-9, gen_s);
  const auto x = make_random_tokens(size_t(a.tokens) * s.hidden, a.seed + 7);
  const double gflop = a.tokens * s.flops_per_token() * 1e-9;
  if (b == api::Backend::kCpu && gflop > 100) {
    // (the CPU backend is the kernel-faithful reference: ~10 GFLOP/s, so say so before a
    // forward that runs for minutes)
    fmt::print(
        "forward on cpu: {} tokens, {:.0f} GFLOP: the CPU backend is the reference, not a fast path; "
        "this takes a while\n",
        a.tokens, gflop);
    std::fflush(stdout);
  }
  const api::ForwardOutput out = api::forward(b, w, x.data(), a.tokens);
  fmt::print("forward on {}: {} tokens in {:.3f} ms, {:.1f} GFLOP/s ({:.1f} GFLOP)\n",
             api::to_string(out.backend), a.tokens, out.seconds * 1e3, gflop / out.seconds, gflop);

  // Check a sample of tokens against the float64 reference with unquantized activations.
  const int n = std::min(a.check_tokens, a.tokens);
  std::vector<int32_t> ids(size_t(n) * s.topk);
  std::vector<float> wts(ids.size());
  ref::route(s, w.view(), x.data(), n, ids.data(), wts.data());
  int id_mismatch = 0;
  for (size_t i = 0; i < ids.size(); ++i) id_mismatch += ids[i] != out.ids[i];
  std::vector<float> exact(size_t(n) * s.hidden), got(exact.size());
  ref::moe_layer(s, w.view(), x.data(), n, ids.data(), wts.data(), ref::Mode::kExact, exact.data());
  for (size_t i = 0; i < got.size(); ++i) got[i] = num::bf16_decode(out.y[i]);
  const double err = rel_l2(got, exact);
  // Given the backend's own routing, the kernel-faithful reference computes the very bits
  // (it models the tensor cores' accumulation): any differing output is a bug.
  std::vector<float> faithful(exact.size());
  ref::moe_layer(s, w.view(), x.data(), n, out.ids.data(), out.weights.data(), ref::Mode::kKernelFaithful,
                 faithful.data());
  size_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += num::float_bits(got[i]) != num::float_bits(faithful[i]);
  fmt::print(
      "check on {} tokens: routing ids {} vs the reference; outputs {} the kernel-faithful reference's bits; "
      "relative L2 vs exact float64 = {:.3e} (FP8 activations explain a few 1e-2)\n",
      n, id_mismatch == 0 ? "identical" : fmt::format("{} DIFFER", id_mismatch),
      differ == 0 ? fmt::format("all {} equal to", got.size())
                  : fmt::format("{} of {} DIFFER from", differ, got.size()),
      err);
  if (id_mismatch || differ || !(err < 0.1)) {
    fmt::print(
        stderr,
        "demo: FAILED (ids differ, outputs differ from the kernel-faithful reference, or error too large)\n");
    return 1;
  }
  fmt::print("demo: OK\n");
  return 0;
}

// ---------------------------------------------------------------- make-input
struct MakeInputArgs {
  std::string checkpoint, out;
  int tokens = 16;
  uint64_t seed = 1;
};

int run_make_input(const MakeInputArgs& a) {
  tools::check_output_file("--out", a.out);
  const ModelDesc desc = load_config(a.checkpoint);
  const int H = desc.shape.hidden;
  const std::vector<num::bf16_t> x = make_random_tokens(size_t(a.tokens) * H, a.seed);
  const io::TensorToWrite t{"x", io::Dtype::kBF16, {a.tokens, H}, x.data(), x.size() * 2};
  io::write_safetensors(a.out, std::span<const io::TensorToWrite>(&t, 1));
  fmt::print("wrote {}: x BF16 [{}, {}] (random tokens, seed {}) for {}\n", a.out, a.tokens, H, a.seed,
             a.checkpoint);
  return 0;
}

// ---------------------------------------------------------------- forward
struct ForwardArgs {
  std::string checkpoint, input, output, backend = "auto";
  int layer = -1;
  int ranks = 1;
};

int run_forward(const ForwardArgs& a) {
  const api::Backend backend = api::resolve(api::parse_backend(a.backend));  // before any loading
  // (and the output: a forward that cannot write its result should not run first)
  tools::check_output_file("--output", a.output);
  std::error_code ec;
  if (std::filesystem::equivalent(a.output, a.input, ec))
    throw std::invalid_argument(
        fmt::format("--output {}: is the --input file; the forward would overwrite it", a.output));
  const ModelDesc desc = load_config(a.checkpoint);
  desc.require_moe_layer(a.layer, "--layer");
  if (desc.shape.experts % a.ranks != 0)
    throw std::invalid_argument(fmt::format("--ranks {}: must divide E = {} (each rank holds E / R experts)",
                                            a.ranks, desc.shape.experts));
  const io::Checkpoint ckpt(a.checkpoint);
  HostMoeWeights w = load_layer_via_store(ckpt, desc, a.layer);  // streaming, through the WeightStore
  const MoeShape& s = w.shape;
  const io::SafetensorsFile in(a.input);
  const io::TensorView xv = in.at("x");
  if (xv.dtype != io::Dtype::kBF16 || xv.shape.size() != 2 || xv.shape[1] != s.hidden)
    throw std::invalid_argument(fmt::format("{}: tensor 'x' must be BF16 [T, {}], found {} {}", a.input,
                                            s.hidden, io::to_string(xv.dtype), io::format_shape(xv.shape)));
  if (xv.shape[0] > std::numeric_limits<int>::max())
    throw std::invalid_argument(
        fmt::format("{}: tensor 'x' has {} tokens, more than one forward takes", a.input, xv.shape[0]));
  const int T = int(xv.shape[0]);
  std::vector<num::bf16_t> x(size_t(T) * s.hidden);
  std::memcpy(x.data(), xv.data, x.size() * 2);
  // (non-finite activations are not an error: such a token changes only its own row, as
  // the layers promise, api/moe_layer.h)
  const api::ForwardOutput out = api::forward(backend, w, x.data(), T, a.ranks);
  std::vector<io::TensorToWrite> t;
  t.push_back({"y", io::Dtype::kBF16, {T, s.hidden}, out.y.data(), out.y.size() * 2});
  t.push_back({"topk_ids", io::Dtype::kI32, {T, s.topk}, out.ids.data(), out.ids.size() * 4});
  t.push_back({"topk_weights", io::Dtype::kF32, {T, s.topk}, out.weights.data(), out.weights.size() * 4});
  io::write_safetensors(a.output, t,
                        {{"backend", api::to_string(out.backend)},
                         {"layer", std::to_string(a.layer)},
                         {"ranks", std::to_string(a.ranks)}});
  fmt::print("forward: layer {} of {} ({}), {} tokens on {} (ranks {}) in {:.3f} ms -> {}\n", a.layer,
             a.checkpoint, desc.family, T, api::to_string(out.backend), a.ranks, out.seconds * 1e3, a.output);
  return 0;
}

// ---------------------------------------------------------------- bench
struct BenchArgs {
  std::vector<std::string> presets;
  std::vector<int> tokens;
  std::string json;
  bool no_baseline = false, no_ep = false, diagnostics = false, quick = false;
  double energy = 0;
  int iters = 0;  // 0: 15 (5 with --quick)
  std::vector<std::string> routings;
  std::string regime = "both";
  double sustained_seconds = 0, burst_gap_ms = -1;  // 0 / -1: the defaults (--quick's)
  int dense_m = 0;
  int ranks = 1;
  std::string transport = "virtual";
  int experts = 0, topk = 0, shared_experts = -1;
  std::string commit, command;
};

int run_bench_cmd(const BenchArgs& a) {
  api::BenchOptions o;
  if (a.quick) api::make_quick(o);
  if (!a.presets.empty()) o.presets = a.presets;
  if (!a.tokens.empty()) o.tokens = a.tokens;
  if (!a.routings.empty()) o.routings = a.routings;
  if (a.regime != "both") o.regimes = {a.regime};  // (api::validate_bench_options names a bad one)
  if (a.sustained_seconds > 0) o.sustained_seconds = a.sustained_seconds;
  if (a.burst_gap_ms >= 0) o.burst_gap_ms = a.burst_gap_ms;
  if (a.dense_m > 0) o.dense_m = a.dense_m;
  o.baseline = !a.no_baseline;
  o.diagnostics = a.diagnostics;
  o.energy_seconds = a.energy;
  o.ep8_share = !a.no_ep;
  if (a.iters > 0) o.iters = a.iters;
  o.ranks = a.ranks;
  o.ep_transport = a.transport;
  o.experts = a.experts, o.topk = a.topk, o.shared_experts = a.shared_experts;
  if (a.ranks > 1 && a.tokens.empty()) o.tokens = {1, 8, 64, 256, 1024};  // per rank
  for (const auto& p : o.presets) api::bench_shape(p, o);                 // fail early on a bad name
  api::validate_bench_options(o);
  std::string why;
  if (!api::cuda_available(&why)) throw std::runtime_error("bench needs the CUDA backend: " + why);
#if defined(MEGAMOE_HAVE_CUDA)
  // --json auto: the card's file, named before the run so a wrong card fails at once.
  const std::string json_path = a.json == "auto" ? api::bench_results_path(api::bench_device_name()) : a.json;
  if (const auto dir = std::filesystem::path(json_path).parent_path();
      !dir.empty() && !std::filesystem::is_directory(dir))
    throw std::invalid_argument("--json: no folder " + dir.string() + " for " + json_path +
                                " (--json auto writes under bench/results: run from the repository root)");
  nlohmann::json j = api::run_bench(o, [](const std::string& line) {
    fmt::print("{}\n", line);
    std::fflush(stdout);
  });
  j["commit"] = a.commit;
  j["command"] = a.command;
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  j["date"] = date;
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    if (!f) throw std::runtime_error("--json: cannot write " + json_path);
    f << j.dump(2) << "\n";
    fmt::print("wrote {}\n", json_path);
  }
#endif
  return 0;
}

// ---------------------------------------------------------------- ep-check
struct EpCheckArgs {
  std::string preset = "glm-5.3-flash", transport = "virtual", rendezvous;
  int ranks = 2, tokens = 64, rank = -1;
  int experts = 0, topk = 0, shared_experts = -1;
  double timeout_s = 10;
};

int run_ep_check(const EpCheckArgs& a) {
  std::string why;
  if (!api::cuda_available(&why)) throw std::runtime_error("ep-check needs the CUDA backend: " + why);
#if defined(MEGAMOE_HAVE_CUDA)
  api::EpLayerOptions o;
  o.ranks = a.ranks;
  o.max_tokens = std::max(1, a.tokens);
  o.timeout_s = a.timeout_s;
  o.transport = api::parse_ep_transport(a.transport);
  if (a.rank >= 0) {  // one process per GPU (scripts/ep_launch.sh): this process is rank a.rank on device 0
    if (o.transport != api::EpTransport::kNccl) throw std::invalid_argument("--rank needs --transport nccl");
    if (a.rendezvous.empty()) throw std::invalid_argument("--rank needs --rendezvous FILE");
    o.local_ranks = {a.rank};
    o.devices = {0};
  }
  o.rendezvous = a.rendezvous;
  api::BenchOptions shape_opt;  // the same shape overrides as bench
  shape_opt.experts = a.experts, shape_opt.topk = a.topk, shape_opt.shared_experts = a.shared_experts;
  const MoeShape s = api::bench_shape(a.preset, shape_opt);
  const auto res = api::ep_self_check(s, a.tokens, o);
  bool ok = true;
  for (const auto& r : res) {
    fmt::print(
        "ep-check: {} R={} ({}) rank {} on device {}: {} tokens, forward {:.1f} us, bytes {} one device\n",
        a.preset, a.ranks, a.transport, r.rank, r.device, r.tokens, r.us,
        r.bytes_equal ? "equal to" : "DIFFER from");
    ok &= r.bytes_equal;
  }
  fmt::print("ep-check: {}\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
#else
  return 1;
#endif
}

// ---------------------------------------------------------------- doctor
// What this build will run on: the GPUs, the driver, the CUDA runtime, whether the CUDA
// backend is usable, and the NCCL the NCCL transport will load. Works without a GPU.
#if defined(MEGAMOE_HAVE_CUDA)
std::string cuda_version(int v) { return fmt::format("{}.{}", v / 1000, v % 1000 / 10); }

// The kernel module's release ("580.159.04"); empty where the driver does not say.
std::string driver_release() {
  std::ifstream f("/proc/driver/nvidia/version");
  std::string line, word, prev;
  if (!f || !std::getline(f, line)) return {};
  std::istringstream words(line);
  while (words >> word) {
    if (prev == "Module") return word;
    prev = word;
  }
  return {};
}

std::string driver_line() {
  int v = 0;
  const cudaError_t e = cudaDriverGetVersion(&v);
  if (e != cudaSuccess || v == 0) return "CUDA driver: none (no NVIDIA driver on this machine)";
  const std::string rel = driver_release();
  return fmt::format("CUDA driver: {}CUDA {} driver API", rel.empty() ? "" : rel + ", ", cuda_version(v));
}

std::string runtime_line() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return fmt::format("CUDA runtime: {} (linked statically)", cuda_version(v));
}

std::string nccl_line() {
  const transport::NcclLibrary& lib = transport::find_nccl();
  if (!lib.usable()) {
    return fmt::format("NCCL: none usable (the nccl transport needs {}; `megamoe doctor` lists the "
                       "candidates; MEGAMOE_NCCL_LIB names one)",
                       transport::nccl_requirement());
  }
  return fmt::format("NCCL: {} ({}, {})", lib.path, transport::nccl_version_string(lib.version),
                     lib.tried.back().origin);
}
#endif

// "megamoe 0.1.0 (commit abc1234)": the release (CMake's project version) and the build's commit.
std::string version_line() {
  return fmt::format("megamoe {} (commit {})", MEGAMOE_VERSION, MEGAMOE_GIT_COMMIT);
}

std::string version_text() {
  std::string s = version_line();
#if defined(MEGAMOE_HAVE_CUDA)
  s += "\n" + runtime_line() + "\n" + driver_line() + "\n" + nccl_line();
#else
  s += "\nCUDA: this build has no CUDA backend";
#endif
  return s;
}

int run_doctor() {
  fmt::print("{}\n", version_line());
  std::string why;
  const bool cuda_ok = api::cuda_available(&why);
#if defined(MEGAMOE_HAVE_CUDA)
  fmt::print("build: CUDA backend (sm_90a kernels), NCCL headers {}\n",
             transport::nccl_version_string(transport::nccl_headers_version()));
  fmt::print("{}\n{}\n", runtime_line(), driver_line());
  int n = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess) {
    cudaGetLastError();
    fmt::print("GPUs: none ({}: {})\n", cudaGetErrorName(e), cudaGetErrorString(e));
    n = 0;
  } else {
    fmt::print("GPUs: {}\n", n);
  }
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp p{};
    if (const cudaError_t e = cudaGetDeviceProperties(&p, d); e != cudaSuccess) {
      cudaGetLastError();
      fmt::print("  GPU {}: properties unreadable ({})\n", d, cudaGetErrorName(e));
      continue;
    }
    fmt::print("  GPU {}: {}, {} SMs, {:.1f} GiB, compute capability {}.{}\n", d, p.name, p.multiProcessorCount,
               p.totalGlobalMem / double(1ull << 30), p.major, p.minor);
  }
#else
  fmt::print("build: CPU only (configured without nvcc: no CUDA backend, no NCCL transport)\n");
#endif
  fmt::print("CUDA backend: {}\n", cuda_ok ? "usable" : "not usable: " + why);
#if defined(MEGAMOE_HAVE_CUDA)
  const transport::NcclLibrary& lib = transport::find_nccl();
  fmt::print("{}\n", nccl_line());
  fmt::print("NCCL candidates, in search order{}:\n",
             lib.explicit_choice ? " (MEGAMOE_NCCL_LIB set: the only one tried)" : "");
  for (const auto& c : lib.tried)
    fmt::print("  {}: {}{}: {}\n", c.origin, c.path,
               c.version ? " (" + transport::nccl_version_string(c.version) + ")" : "",
               c.refused.empty() ? "usable" : "refused: " + c.refused);
  if (lib.tried.empty()) fmt::print("  (none found)\n");
#else
  fmt::print("NCCL: not searched (the NCCL transport needs the CUDA backend)\n");
#endif
  return 0;
}

// Edit distance (insertions, deletions, substitutions), for "did you mean".
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// " (did you mean X?)" for the closest of `names` to `given`, where one is close enough to
// be a typo of it; "" otherwise.
std::string did_you_mean(const std::string& given, const std::vector<std::string>& names) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& n : names)
    if (const size_t d = edit_distance(given, n); d < best_d) best_d = d, best = n;
  const size_t limit = std::max<size_t>(2, given.size() / 3);
  return best_d <= limit ? " (did you mean " + best + "?)" : "";
}

// Checks the subcommand and the long options' names before CLI11 parses: CLI11 reports a
// missing required option or subcommand before an unknown one, so a typo would be named as
// "--checkpoint is required" or "A subcommand is required" instead of the typo itself.
// Returns the error ("" when the names are fine; values and requirements are CLI11's).
std::string check_names(const CLI::App& app, int argc, char** argv) {
  std::vector<std::string> subs;
  for (const CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; }))
    subs.push_back(s->get_name());
  const std::string sub_list = fmt::format("{}", fmt::join(subs, ", "));
  int i = 1;
  for (; i < argc; ++i) {  // the top level: --help and --version, then the subcommand
    const std::string a = argv[i];
    if (a == "-h" || a == "--help" || a == "--version") return "";  // CLI11 answers these
    if (a.starts_with("-"))
      return fmt::format("unknown option {} before the subcommand; the subcommands are: {}", a, sub_list);
    break;
  }
  if (i == argc) return "a subcommand is required, one of: " + sub_list;
  const std::string name = argv[i];
  const CLI::App* sub = nullptr;
  for (const CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; }))
    if (s->check_name(name)) sub = s;
  if (!sub)
    return fmt::format("unknown subcommand '{}'{}; the subcommands are: {}", name, did_you_mean(name, subs),
                       sub_list);
  std::vector<std::string> longs;
  for (const CLI::Option* o : sub->get_options())
    for (const auto& l : o->get_lnames()) longs.push_back("--" + l);
  for (++i; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;  // what follows is values only
    if (!a.starts_with("--") || a.size() == 2) continue;
    const std::string opt = a.substr(0, a.find('='));
    if (!sub->get_option_no_throw(opt))
      return fmt::format("unknown option {} for `megamoe {}`{}", opt, name, did_you_mean(opt, longs));
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "megamoe: FP8 Mixture-of-Experts layers (DeepSeek-V3 / GLM-5 family) on Hopper GPUs and the CPU"};
  app.require_subcommand(1);
  app.set_version_flag(
      "--version", version_text,
      "The release and the build's commit, then the CUDA runtime, driver and NCCL it will use");

  DemoArgs demo;
  auto* c_demo =
      app.add_subcommand("demo", "Run a random layer of a preset shape and check it against float64");
  c_demo->add_option("--preset", demo.preset, preset_names(" | "))->capture_default_str();
  c_demo->add_option("--tokens", demo.tokens, "tokens in the batch")->capture_default_str();
  c_demo->add_option("--backend", demo.backend, "auto | cpu | cuda")->capture_default_str();
  c_demo->add_option("--check-tokens", demo.check_tokens, "tokens checked against the exact reference")
      ->check(CLI::Range(1, 1 << 30))
      ->capture_default_str();
  c_demo->add_option("--seed", demo.seed)->check(tools::seed_check())->capture_default_str();

  MakeInputArgs mkin;
  auto* c_mkin =
      app.add_subcommand("make-input", "Write random tokens x (BF16 [T, H]) for `forward` on a checkpoint");
  c_mkin->add_option("--checkpoint", mkin.checkpoint, "checkpoint directory (its config.json gives H)")
      ->required();
  c_mkin->add_option("--tokens", mkin.tokens, "T")->check(CLI::Range(1, 1 << 24))->capture_default_str();
  c_mkin->add_option("--out", mkin.out, "safetensors file to write")->required();
  c_mkin->add_option("--seed", mkin.seed)->check(tools::seed_check())->capture_default_str();

  ForwardArgs fwd;
  auto* c_fwd =
      app.add_subcommand("forward", "Run one MoE layer of a checkpoint on x from a safetensors file");
  c_fwd->add_option("--checkpoint", fwd.checkpoint, "HF-layout checkpoint directory")->required();
  c_fwd->add_option("--layer", fwd.layer, "decoder layer index (an MoE layer)")->required();
  c_fwd->add_option("--input", fwd.input, "safetensors file with x: BF16 [T, H]")->required();
  c_fwd->add_option("--output", fwd.output, "safetensors file to write y, topk_ids, topk_weights")
      ->required();
  c_fwd->add_option("--backend", fwd.backend, "auto | cpu | cuda")->capture_default_str();
  c_fwd->add_option("--ranks", fwd.ranks, "expert-parallel ranks (tokens split evenly; must divide E)")
      ->check(CLI::Range(1, 1 << 10))
      ->capture_default_str();

  BenchArgs bench;
  auto* c_bench = app.add_subcommand(
      "bench", "Time the CUDA layer against the floors, an in-run dense FP8 GEMM and cuBLASLt (GPU only)");
  c_bench->add_option("--preset", bench.presets, "presets (default: glm-5.3-flash glm-5 deepseek-v3)");
  c_bench->add_option("--tokens", bench.tokens, "token counts (default: 1 8 64 256 1024 4096 8192 16384)");
  c_bench->add_option(
      "--json", bench.json,
      "write the results as JSON here (auto: bench/results/h100.json or h200.json by the card)");
  c_bench->add_option("--iters", bench.iters, "burst: timed calls a case (default 15, --quick 5)")
      ->check(CLI::PositiveNumber);
  c_bench->add_option(
      "--routing", bench.routings,
      "uniform (the router on random x) and / or zipf:S (expert popularity ~ 1/rank^S, external "
      "routing); default uniform");
  c_bench
      ->add_option("--regime", bench.regime,
                   "sustained (back-to-back replays, ~1 s a case) | burst (single calls after an idle gap) | "
                   "both")
      ->capture_default_str();
  c_bench->add_flag("--quick", bench.quick,
                    "shorter windows, 5 burst calls, a smaller dense GEMM: a check it runs");
  c_bench
      ->add_option("--sustained-seconds", bench.sustained_seconds,
                   "the timed window a case (default 1, --quick 0.25)")
      ->check(CLI::PositiveNumber);
  c_bench->add_option("--burst-gap-ms", bench.burst_gap_ms, "idle gap before each burst call (default 50)")
      ->check(CLI::NonNegativeNumber);
  c_bench
      ->add_option("--dense-m", bench.dense_m,
                   "rows of the dense FP8 GEMM pair (default 16384, --quick 8192)")
      ->check(CLI::PositiveNumber);
  c_bench->add_flag("--no-baseline", bench.no_baseline, "skip the cuBLASLt baseline");
  c_bench->add_flag("--no-ep", bench.no_ep, "skip the 8-way expert-parallel share");
  c_bench->add_flag("--diagnostics", bench.diagnostics,
                    "also time the routing kernels one by one and a read of each case's weight bytes");
  c_bench
      ->add_option("--energy", bench.energy,
                   "also the board energy of each layer (NVML) over this many seconds of replays")
      ->check(CLI::NonNegativeNumber);
  c_bench
      ->add_option("--ranks", bench.ranks,
                   "expert-parallel ranks (virtual ranks on this GPU; --tokens per rank, default 1 8 64 "
                   "256 1024), timed against one device running every rank's tokens")
      ->capture_default_str()
      ->check(CLI::Range(1, 16));
  c_bench->add_option("--transport", bench.transport, "with --ranks: virtual | nccl (rank r on GPU r)")
      ->capture_default_str();
  c_bench->add_option("--experts", bench.experts, "override every preset's expert count")
      ->check(tools::shape_override_range());
  c_bench->add_option("--topk", bench.topk, "override every preset's top-k")
      ->check(tools::shape_override_range());
  c_bench->add_option("--shared-experts", bench.shared_experts,
                      "override every preset's shared experts (0: none)");
  bench.commit = MEGAMOE_GIT_COMMIT;
  c_bench->add_option("--commit", bench.commit, "commit id recorded in the JSON (default: the build's)")
      ->capture_default_str();
  c_bench->add_option("--command", bench.command, "command line recorded in the JSON (default: this one)");

  std::vector<tools::Command> checkpoint_cmds = tools::add_checkpoint_commands(app);
  for (auto& c : tools::add_soak_commands(app)) checkpoint_cmds.push_back(c);

  EpCheckArgs epc;
  auto* c_epc = app.add_subcommand(
      "ep-check",
      "Run the expert-parallel layer on random data and compare every rank's bytes with one device");
  c_epc->add_option("--preset", epc.preset, preset_names(" | "))->capture_default_str();
  c_epc->add_option("--ranks", epc.ranks, "expert-parallel ranks R")
      ->capture_default_str()
      ->check(CLI::Range(1, 16));
  c_epc->add_option("--tokens", epc.tokens, "tokens per rank (rank r takes tokens - r % 3)")
      ->capture_default_str();
  c_epc->add_option("--transport", epc.transport, "virtual (R ranks on this GPU) | nccl")
      ->capture_default_str();
  c_epc->add_option("--rank", epc.rank, "one process per GPU: this process's rank (nccl, with --rendezvous)");
  c_epc->add_option("--rendezvous", epc.rendezvous, "file through which rank 0 hands out NCCL's unique id");
  c_epc->add_option("--experts", epc.experts, "override the preset's expert count")
      ->check(tools::shape_override_range());
  c_epc->add_option("--topk", epc.topk, "override the preset's top-k")->check(tools::shape_override_range());
  c_epc->add_option("--shared-experts", epc.shared_experts, "override the preset's shared experts (0: none)");
  c_epc->add_option("--timeout", epc.timeout_s, "seconds before a missing peer is an error")
      ->capture_default_str();

  auto* c_doctor = app.add_subcommand(
      "doctor", "Print the GPUs, driver, CUDA runtime, whether the CUDA backend is usable and the NCCL the "
                "nccl transport will load (and the candidates it refused); works without a GPU");

  // (CLI11_PARSE would exit with its own codes, 100+, and no "megamoe: error:" prefix: a bad
  // flag is an error like any other here, exit 1)
  if (const std::string bad = check_names(app, argc, argv); !bad.empty()) {
    fmt::print(stderr, "megamoe: error: {}\nRun with --help for more information.\n", bad);
    return 1;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    fmt::print(stderr, "megamoe: error: {}\nRun with --help for more information.\n", e.what());
    return 1;
  }
  if (*c_bench && bench.command.empty()) {  // this command line, as a shell would take it back
    bench.command = "megamoe";
    for (int i = 1; i < argc; ++i) {
      std::string arg = argv[i];
      if (arg.empty() || arg.find_first_of(" \t\n\"'$\\*?;&|<>()`") != std::string::npos) {
        std::string q = "'";
        for (char c : arg) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
        arg = q + "'";
      }
      bench.command += " " + arg;
    }
  }
  try {
    if (*c_doctor) return run_doctor();
    if (*c_epc) return run_ep_check(epc);
    if (*c_demo) return run_demo(demo);
    if (*c_mkin) return run_make_input(mkin);
    if (*c_fwd) return run_forward(fwd);
    if (*c_bench) return run_bench_cmd(bench);
    for (const auto& c : checkpoint_cmds)
      if (*c.app) return c.run();
  } catch (const std::bad_alloc&) {
    const double gb = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE)) * 1e-9;
    fmt::print(stderr,
               "megamoe: error: out of host memory (std::bad_alloc): the request does not fit this machine's "
               "{:.0f} GB; ask for fewer tokens or layers\n",
               gb);
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "megamoe: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
