// The benchmark driver behind `megamoe bench` (see bench/include/megamoe_bench/bench.h).
// Every figure a case reports is measured in the same process: the streaming
// read bandwidth (the decode floor), a dense block-scaled FP8 GEMM pair of the
// preset's shapes (the compute floor's rate), our layer, its routing alone, and
// the cuBLASLt baseline fed with the same routing, each in the sustained and the
// burst regime (bench::time_regime) with the SM clock and power of the layer's
// window.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <vector>

#include "../../src/api/device_run.h"
#include "../../src/kernels/cuda_check.h"
#include "megamoe/api/ep_layer.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/kernels/fused_moe.h"
#include "megamoe/weights/host_weights.h"
#include "megamoe_bench/baselines.h"
#include "megamoe_bench/bench.h"
#include "megamoe_bench/routing_gen.h"

namespace megamoe::api {

namespace {

// Weight bytes one expert streams (E4M3 weights + float scales) for intermediate `inter`.
double expert_bytes(const MoeShape& s, int inter) {
  const double H = s.hidden, I = inter;
  const double scales =
      (2.0 * std::ceil(I / 128) * std::ceil(H / 128) + std::ceil(H / 128) * std::ceil(I / 128)) * 4;
  return 3.0 * H * I + scales;
}

// The shared expert's weight bytes a forward of T tokens streams (once, if any token).
double shared_bytes(const MoeShape& s, int T) {
  return s.has_shared() && T > 0 ? expert_bytes(s, s.shared_inter()) : 0.0;
}

// x for T tokens: N(0,1)-ish via the sum of two uniforms; fresh per T.
std::vector<num::bf16_t> bench_input(int T, int H) {
  std::vector<num::bf16_t> x(size_t(T) * H);
  uint64_t st = 0x9E3779B97F4A7C15ull * (T + 1);
  for (auto& v : x) {
    st ^= st << 13, st ^= st >> 7, st ^= st << 17;
    const float u =
        float(st >> 40) * (1.0f / 16777216.0f) + float((st >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
    v = num::bf16_encode((u - 1.0f) * 2.45f);
  }
  return x;
}

// `body` captured once as a CUDA graph; calling the object launches it on a stream.
class CapturedGraph {
 public:
  CapturedGraph(cudaStream_t stream, const std::function<void(cudaStream_t)>& body) {
    cudaGraph_t g = nullptr;
    MEGAMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      body(stream);
    } catch (...) {
      // (the stream leaves capture mode, so it stays usable for what follows)
      if (cudaStreamEndCapture(stream, &g) == cudaSuccess && g) cudaGraphDestroy(g);
      cudaGetLastError();
      throw;
    }
    MEGAMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    MEGAMOE_CUDA_CHECK(cudaGraphInstantiate(&exec_, g, 0));
    MEGAMOE_CUDA_CHECK(cudaGraphDestroy(g));
  }
  ~CapturedGraph() { cudaGraphExecDestroy(exec_); }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  void operator()(cudaStream_t stream) const { MEGAMOE_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraphExec_t exec_ = nullptr;
};

// Graph replays of `body`, timed (median, p10, p90 of device time); each after an L2
// flush of this device and of `devices` (expert-parallel ranks on their own GPUs).
bench::Timing time_graph(cudaStream_t stream, const BenchOptions& opt,
                         const std::function<void(cudaStream_t)>& body,
                         const std::vector<int>& devices = {}) {
  const CapturedGraph g(stream, body);
  return bench::time_device(std::cref(g), stream, opt.warmup, opt.iters, true, devices);
}

// The expert-parallel layer over opt.ranks virtual ranks, T tokens per rank, against
// one device running all R * T tokens: time, exchanged bytes, and whether the bytes
// of the outputs agree.
void bench_ep_case(const BenchOptions& opt, const std::string& name, const HostMoeWeights& hw, const void* dw,
                   int T, double read_bw, double dense_tflops, cudaStream_t stream, nlohmann::json& out,
                   const std::function<void(const std::string&)>& log) {
  const MoeShape& s = hw.shape;
  const int R = opt.ranks, Tall = R * T;
  const std::vector<num::bf16_t> x = bench_input(Tall, s.hidden);
  DeviceBuffer dx(x.size() * 2), dy1(x.size() * 2);
  MEGAMOE_CUDA_CHECK(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  auto* xp = static_cast<const num::bf16_t*>(dx.p);
  EpLayerOptions eo;
  eo.ranks = R;
  eo.max_tokens = std::max(1, T);
  eo.transport = parse_ep_transport(opt.ep_transport);
  CudaEpMoeLayer ep(hw, eo);
  // Each rank's x and y on its device (virtual ranks: all on this one).
  int dev0 = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev0));
  std::vector<DeviceBuffer> rx, ry;
  std::vector<const num::bf16_t*> xs(R);
  std::vector<num::bf16_t*> ys(R);
  const size_t slice = size_t(T) * s.hidden;
  for (int i = 0; i < R; ++i) {
    MEGAMOE_CUDA_CHECK(cudaSetDevice(ep.device(i)));
    rx.emplace_back(slice * 2);
    ry.emplace_back(slice * 2);
    MEGAMOE_CUDA_CHECK(
        cudaMemcpy(rx[i].p, x.data() + ep.local_ranks()[i] * slice, slice * 2, cudaMemcpyHostToDevice));
    xs[i] = static_cast<const num::bf16_t*>(rx[i].p);
    ys[i] = static_cast<num::bf16_t*>(ry[i].p);
  }
  MEGAMOE_CUDA_CHECK(cudaSetDevice(dev0));
  const std::vector<int> tokens(R, T);
  std::vector<int> devices;  // every rank starts with a cold L2, as one device does
  for (int i = 0; i < R; ++i) devices.push_back(ep.device(i));
  const bench::Timing t_ep = time_graph(
      stream, opt, [&](cudaStream_t st) { ep.forward(xs, ys, tokens, st); }, devices);
  ep.check();
  MoeLayerOptions lo;
  lo.max_tokens = std::max(1, Tall);
  CudaMoeLayer one(s, dw, lo);
  auto* y1 = static_cast<num::bf16_t*>(dy1.p);
  const bench::Timing t_one =
      time_graph(stream, opt, [&](cudaStream_t st) { one.forward(xp, y1, Tall, nullptr, st); });
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<num::bf16_t> a(x.size()), b(x.size());
  for (int i = 0; i < R; ++i)
    MEGAMOE_CUDA_CHECK(
        cudaMemcpy(a.data() + ep.local_ranks()[i] * slice, ys[i], slice * 2, cudaMemcpyDeviceToHost));
  MEGAMOE_CUDA_CHECK(cudaMemcpy(b.data(), y1, b.size() * 2, cudaMemcpyDeviceToHost));
  const bool same = a == b;
  // Rows that cross ranks: a slot whose expert another rank owns moves its FP8 row
  // and scales there and its BF16 result back.
  // Per owner rank: the experts its rows hit and the rows it receives (on R GPUs the
  // busiest rank sets the time; a per-rank report would show each).
  const int El = s.experts / R;
  std::vector<std::set<int>> hit_by(R);
  std::vector<int64_t> rows_by(R, 0);
  int64_t remote = 0;
  for (int r = 0; r < R; ++r) {
    std::vector<int32_t> ids(size_t(T) * s.topk);
    MEGAMOE_CUDA_CHECK(cudaMemcpy(ids.data(), ep.topk_ids(r), ids.size() * 4, cudaMemcpyDeviceToHost));
    for (int32_t id : ids) {
      if (id < 0) continue;
      hit_by[id / El].insert(id);
      ++rows_by[id / El];
      remote += id / El != r;
    }
  }
  const double row_bytes = s.hidden + s.hidden / 128 * 4.0 + 8 + s.hidden * 2.0;
  const double moved = remote * row_bytes;
  size_t hit = 0;  // experts hit, every rank's
  for (const std::set<int>& h : hit_by) hit += h.size();
  const double wbytes = hit * expert_bytes(s, s.inter) + shared_bytes(s, T);
  const double floor_us =
      std::max(wbytes / read_bw, double(Tall) * s.flops_per_token() / (dense_tflops * 1e12)) * 1e6;
  // One rank's own floor (its experts' bytes, its rows' and its shared-expert tokens' flops):
  // the floor of the layer on R GPUs is the busiest rank's.
  double rank_floor_us = 0;
  for (int r = 0; r < R; ++r) {
    const double bytes = hit_by[r].size() * expert_bytes(s, s.inter) + shared_bytes(s, T);
    const double flops =
        double(rows_by[r]) * s.expert_flops(s.inter) + double(T) * s.expert_flops(s.shared_inter());
    rank_floor_us = std::max(rank_floor_us, std::max(bytes / read_bw, flops / (dense_tflops * 1e12)) * 1e6);
  }
  const double tflops = double(Tall) * s.flops_per_token() / (t_ep.median_us * 1e-6) * 1e-12;
  const double link_gbps = moved / (t_ep.median_us * 1e-6) * 1e-9;
  nlohmann::json c;
  c["preset"] = name;
  c["shape"] = s.describe();
  c["ranks"] = R;
  c["tokens_per_rank"] = T;
  c["tokens"] = Tall;
  c["local_experts"] = El;
  c["us"] = t_ep.median_us;
  c["us_p10"] = t_ep.p10_us;
  c["us_p90"] = t_ep.p90_us;
  c["one_device_us"] = t_one.median_us;
  c["virtual_rank_overhead"] = t_ep.median_us / t_one.median_us;
  c["floor_us"] = floor_us;  // one device running every rank's work
  c["rank_floor_us"] = rank_floor_us;
  c["tflops"] = tflops;  // every rank's together
  c["tflops_per_rank"] = tflops / R;
  c["rows_crossing_ranks"] = remote;
  c["bytes_moved"] = moved;
  c["exchange_GBps"] = link_gbps;  // every rank's together
  c["exchange_GBps_per_rank"] = link_gbps / R;
  c["transport"] = opt.ep_transport;
  c["link"] = eo.transport == EpTransport::kNccl ? "NVLink (NCCL windows)"
                                                 : "virtual ranks: one GPU's memory, not NVLink";
  c["bytes_equal_one_device"] = same;
  c["config"] = ep.config_for(T);
  out["cases"].push_back(c);
  log(fmt::format(
      "{:14s} R={} ({}) T={:5d}/rank: {:9.1f} us (p10 {:.1f}, p90 {:.1f}; a rank's floor {:.1f}) "
      "{:.1f} TFLOP/s a rank | one device, {} tokens: {:9.1f} us (x{:.2f}) | {:.1f} MB across ranks, "
      "{:.1f} GB/s a rank | bytes {} | {}",
      name, R, opt.ep_transport, T, t_ep.median_us, t_ep.p10_us, t_ep.p90_us, rank_floor_us, tflops / R, Tall,
      t_one.median_us, t_ep.median_us / t_one.median_us, moved * 1e-6, link_gbps / R,
      same ? "equal" : "DIFFER", ep.config_for(T)));
}

}  // namespace

std::string bench_device_name() {
  int dev = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  MEGAMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  return prop.name;
}

nlohmann::json run_bench(const BenchOptions& opt, const std::function<void(const std::string&)>& log) {
  validate_bench_options(opt);
  const auto t_start = std::chrono::steady_clock::now();
  cudaStream_t stream;
  MEGAMOE_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaDeviceProp prop{};
  int dev = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
  MEGAMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  const double read_bw = bench::measure_read_bandwidth(size_t(4) << 30, 20, stream);
  log(fmt::format("device {} ({} SMs), streaming read {:.3f} TB/s", prop.name, prop.multiProcessorCount,
                  read_bw * 1e-12));
  nlohmann::json out;
  out["device"] = prop.name;
  out["card"] = prop.name;
  out["sms"] = prop.multiProcessorCount;
  out["read_bw_TBps"] = read_bw * 1e-12;
  out["cases"] = nlohmann::json::array();

  if (opt.ranks > 1) {
    // Expert parallelism: the dense GEMM pair timed as the EP cases are (back-to-back
    // replays after flushes), its rate the compute floor.
    out["ranks"] = opt.ranks;
    out["dense_fp8"] = nlohmann::json::array();
    for (const std::string& name : opt.presets) {
      const MoeShape s = bench_shape(name, opt);
      bench::DenseFp8GemmPair dense(opt.dense_m, s.hidden, s.inter);
      dense.run(stream);
      const bench::Timing td = time_graph(stream, opt, [&](cudaStream_t st) { dense.run(st); });
      const double dense_tflops = dense.flops() / (td.median_us * 1e-6) * 1e-12;
      out["dense_fp8"].push_back({{"preset", name}, {"timing", "replays"}, {"tflops", dense_tflops}});
      if (!out.contains("dense_fp8_tflops")) out["dense_fp8_tflops"] = {{"replays", dense_tflops}};
      log(fmt::format("{}: dense FP8 GEMM pair m={} (N=2I K=H, N=H K=I): {:.0f} TFLOP/s", name, opt.dense_m,
                      dense_tflops));
      HostMoeWeights hw = make_random_weights(s, 1234);
      DeviceBuffer dw(hw.bytes());
      MEGAMOE_CUDA_CHECK(cudaMemcpy(dw.p, hw.data(), hw.bytes(), cudaMemcpyHostToDevice));
      for (int T : opt.tokens) bench_ep_case(opt, name, hw, dw.p, T, read_bw, dense_tflops, stream, out, log);
    }
    cudaStreamDestroy(stream);
    return out;
  }

  bench::check_nvml_clock_and_power();  // (every case records the SM clock and power)
  std::vector<bench::Regime> regimes;
  for (const std::string& r : opt.regimes)
    regimes.push_back(r == "sustained" ? bench::Regime::kSustained : bench::Regime::kBurst);
  bench::RegimeOptions full;
  full.sustained_seconds = opt.sustained_seconds;
  full.ramp_seconds = opt.ramp_seconds;
  full.burst_calls = opt.iters;
  full.burst_gap_ms = opt.burst_gap_ms;
  // The routing alone and the baseline follow the layer at once: no ramp, a shorter window.
  bench::RegimeOptions side = full;
  side.sustained_seconds = opt.sustained_seconds * opt.side_window_fraction;
  side.ramp_seconds = 0;

  out["routing"] = opt.routings;  // (each case names its own)
  out["regimes"] = opt.regimes;
  out["timing"] = {{"sustained_seconds", opt.sustained_seconds},
                   {"ramp_seconds", opt.ramp_seconds},
                   {"side_window_seconds", side.sustained_seconds},
                   {"burst_calls", opt.iters},
                   {"burst_gap_ms", opt.burst_gap_ms},
                   {"l2_flush_each_call", true}};
  out["dense_fp8"] = nlohmann::json::array();
  for (const std::string& name : opt.presets) {
    const MoeShape shape = bench_shape(name, opt);
    // The yardstick of this preset: the layer's two GEMM shapes, dense, timed as its cases.
    std::map<std::string, double> dense_tflops;
    {
      bench::DenseFp8GemmPair dense(opt.dense_m, shape.hidden, shape.inter);
      dense.run(stream);
      MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      const CapturedGraph g(stream, [&](cudaStream_t st) { dense.run(st); });
      nlohmann::json d;
      d["preset"] = name;
      d["m"] = dense.m();
      d["gemm1"] = {{"n", 2 * shape.inter}, {"k", shape.hidden}};
      d["gemm2"] = {{"n", shape.hidden}, {"k", shape.inter}};
      d["scales"] = "1x128 activations (VEC128_32F), 128x128 weights (BLK128x128_32F), BF16 out, cuBLASLt";
      d["flops"] = dense.flops();
      for (bench::Regime r : regimes) {
        const bench::RegimeTiming rt = bench::time_regime(std::cref(g), stream, r, full);
        const double tf = dense.flops() / (rt.t.median_us * 1e-6) * 1e-12;
        dense_tflops[bench::regime_name(r)] = tf;
        d[bench::regime_name(r)] = {{"tflops", tf},          {"us", rt.t.median_us},
                                    {"us_p10", rt.t.p10_us}, {"us_p90", rt.t.p90_us},
                                    {"calls", rt.calls},     {"sm_clock_mhz", rt.sm_clock_mhz},
                                    {"power_w", rt.power_w}};
        log(fmt::format(
            "{:14s} dense FP8 GEMM pair m={} (N={} K={}; N={} K={}) {:9s}: {:8.1f} us, {:6.0f} TFLOP/s, "
            "{:4.0f} MHz, {:3.0f} W",
            name, dense.m(), 2 * shape.inter, shape.hidden, shape.hidden, shape.inter, bench::regime_name(r),
            rt.t.median_us, tf, rt.sm_clock_mhz, rt.power_w));
      }
      out["dense_fp8"].push_back(d);
      // The top level's: GLM-5's when it runs (the issue's targets), else the first
      // preset's; each case records its own preset's rate.
      if (!out.contains("dense_fp8_tflops") || name == "glm-5") {
        out["dense_fp8_tflops"] = dense_tflops;
        out["dense_gemm"] = d;
      }
    }

    std::vector<std::pair<MoeShape, int>> shapes;  // (shape, local-expert divisor)
    shapes.push_back({shape, 1});
    if (opt.ep8_share && shape.experts % 8 == 0) {
      MoeShape ep = shape;
      ep.experts /= 8;  // E/8 local experts receiving T*K rows
      ep.n_group = 1, ep.topk_group = 1;
      shapes.push_back({ep, 8});
    }
    for (const auto& [s, ep_div] : shapes) {
      HostMoeWeights hw = make_random_weights(s, 1234);
      DeviceBuffer dw(hw.bytes());
      MEGAMOE_CUDA_CHECK(cudaMemcpy(dw.p, hw.data(), hw.bytes(), cudaMemcpyHostToDevice));
      const MoeWeightsView dview = MoeWeightsView::at(dw.p, hw.layout, s);
      for (const std::string& routing_text : opt.routings) {
        const RoutingSpec routing = parse_routing(routing_text);
        const bool external = routing.kind == RoutingSpec::Kind::kZipf;
        for (int T : opt.tokens) {
          const std::vector<num::bf16_t> x = bench_input(T, s.hidden);
          DeviceBuffer dx(x.size() * 2), dy(x.size() * 2);
          MEGAMOE_CUDA_CHECK(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
          MoeLayerOptions lo;
          lo.max_tokens = T;
          CudaMoeLayer layer(s, dw.p, lo);
          auto* xp = static_cast<const num::bf16_t*>(dx.p);
          auto* yp = static_cast<num::bf16_t*>(dy.p);
          // zipf: generated ids (the same popularity order for every T of the run) through
          // external routing.
          GeneratedRouting gen;
          if (external) gen = zipf_routing(s, T, routing.zipf_s, opt.routing_seed);
          DeviceBuffer dids(gen.ids.size() * 4), dwts(gen.weights.size() * 4);
          RoutingInput ext;
          if (external) {
            MEGAMOE_CUDA_CHECK(
                cudaMemcpy(dids.p, gen.ids.data(), gen.ids.size() * 4, cudaMemcpyHostToDevice));
            MEGAMOE_CUDA_CHECK(
                cudaMemcpy(dwts.p, gen.weights.data(), gen.weights.size() * 4, cudaMemcpyHostToDevice));
            ext.ids = dids.p;
            ext.id_bytes = 4;
            ext.weights = static_cast<const float*>(dwts.p);
          }
          // As served: the forward and the routing alone as CUDA-graph replays, the token
          // count in device memory (no per-launch host gaps in the figures). External
          // routing: the router still runs first (its cost is the same whatever ids it
          // finds), so the times compare with uniform's.
          DeviceBuffer dT(sizeof(int));
          MEGAMOE_CUDA_CHECK(cudaMemcpy(dT.p, &T, sizeof(int), cudaMemcpyHostToDevice));
          const int* dTp = static_cast<const int*>(dT.p);
          auto forward = [&](cudaStream_t st2) {
            if (external) {
              layer.route(xp, T, dTp, st2);
              layer.forward(xp, yp, T, dTp, st2, ext);
            } else {
              layer.forward(xp, yp, T, dTp, st2);
            }
          };
          // One eager forward: the ids and the outputs this case reports.
          if (external)
            layer.forward(xp, yp, T, nullptr, stream, ext);
          else
            layer.forward(xp, yp, T, nullptr, stream);
          MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
          layer.check();
          kernels::fused_moe_print_profile(T);
          std::vector<int32_t> ids(size_t(T) * s.topk);
          std::vector<float> wts(ids.size());
          MEGAMOE_CUDA_CHECK(
              cudaMemcpy(ids.data(), layer.topk_ids(), ids.size() * 4, cudaMemcpyDeviceToHost));
          MEGAMOE_CUDA_CHECK(
              cudaMemcpy(wts.data(), layer.topk_weights(), wts.size() * 4, cudaMemcpyDeviceToHost));
          if (external && ids != gen.ids)
            throw std::runtime_error(
                fmt::format("bench: {} T={}: the layer's ids differ from the {} ids it was given", name, T,
                            routing.text()));
          std::vector<num::bf16_t> y(x.size());
          MEGAMOE_CUDA_CHECK(cudaMemcpy(y.data(), dy.p, y.size() * 2, cudaMemcpyDeviceToHost));
          size_t nonfinite = 0;
          for (auto v : y) nonfinite += !std::isfinite(num::bf16_decode(v));

          // The read floor: the experts actually hit (and the shared one).
          std::vector<int> rows(s.experts, 0);
          for (int32_t id : ids)
            if (id >= 0 && id < s.experts) ++rows[id];
          const size_t hit = size_t(std::count_if(rows.begin(), rows.end(), [](int r) { return r > 0; }));
          const double bytes = hit * expert_bytes(s, s.inter) + shared_bytes(s, T);
          const double flops = double(T) * s.flops_per_token();
          const double mean_rows = double(T) * s.topk / s.experts;
          const double hot = mean_rows > 0 ? *std::max_element(rows.begin(), rows.end()) / mean_rows : 0.0;

          const CapturedGraph g_fwd(stream, forward);
          const CapturedGraph g_route(stream, [&](cudaStream_t st2) { layer.route(xp, T, dTp, st2); });

          std::unique_ptr<bench::CublasLtMoeBaseline> base;
          std::unique_ptr<CapturedGraph> g_base;
          const bench::DeviceRoutedBatch* batch = nullptr;
          std::string base_timing;
          if (opt.baseline && T > 0) {
            base = std::make_unique<bench::CublasLtMoeBaseline>(s, dview, T);
            batch = &base->plan(ids.data(), wts.data(), T, stream);
            // Timed as ours: one graph replay of our routing and the expert-by-expert GEMMs
            // (2 x the experts hit launches), after one eager run that settles cuBLASLt's
            // choices. The batch's counts come from the routing before timing (a served
            // expert-by-expert layer would copy them to the host every forward: not counted).
            base->forward(*batch, xp, yp, stream);
            MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
            try {
              g_base = std::make_unique<CapturedGraph>(stream, [&](cudaStream_t st2) {
                layer.route(xp, T, dTp, st2);
                base->forward(*batch, xp, yp, st2);
              });
              base_timing = "graph";
            } catch (const std::exception& e) {
              // Said in the log and the JSON: such a ratio counts the launches too.
              log(
                  fmt::format("{} T={}: the cuBLASLt baseline cannot be captured in a graph ({}); timed as "
                              "eager launches plus our routing's graph",
                              name, T, e.what()));
              base_timing = "eager";
            }
          }

          double diag_logits_us = -1, diag_topk_us = -1, diag_read_us = -1;
          if (opt.diagnostics && T > 0) {
            // The routing's kernels alone (after a full routing, so the top-k reads real
            // logits); each figure includes a graph launch.
            auto parts = [&](int mask) {
              kernels::set_route_parts_for_timing(mask);
              const bench::Timing t =
                  time_graph(stream, opt, [&](cudaStream_t st2) { layer.route(xp, T, dTp, st2); });
              kernels::set_route_parts_for_timing(kernels::kRoutePartLogits | kernels::kRoutePartTopk);
              return t.median_us;
            };
            diag_logits_us = parts(kernels::kRoutePartLogits);
            diag_topk_us = parts(kernels::kRoutePartTopk);
            // The streaming read of this case's weight bytes after the same L2 flush.
            const size_t case_bytes = size_t(bytes) / 16 * 16;
            diag_read_us =
                case_bytes / bench::measure_read_bandwidth(case_bytes, opt.iters, stream, true) * 1e6;
            log(fmt::format(
                "{:14s} E={:3d} T={:5d}: logits alone {:.1f} us, top-k alone {:.1f}; "
                "reading the case's {:.1f} MB after a flush: {:.1f} us",
                name, s.experts, T, diag_logits_us, diag_topk_us, case_bytes * 1e-6, diag_read_us));
          }

          std::vector<nlohmann::json> records;
          for (bench::Regime r : regimes) {
            const bench::RegimeTiming ours = bench::time_regime(std::cref(g_fwd), stream, r, full);
            const bench::RegimeTiming route = bench::time_regime(std::cref(g_route), stream, r, side);
            double base_us = -1;
            if (g_base) {
              base_us = bench::time_regime(std::cref(*g_base), stream, r, side).t.median_us;
            } else if (base) {
              base_us = bench::time_regime([&](cudaStream_t st2) { base->forward(*batch, xp, yp, st2); },
                                           stream, r, side)
                            .t.median_us +
                        route.t.median_us;
            }
            BenchCaseFigures f;
            f.preset = name;
            f.shape = s.describe();
            f.routing = routing.text();
            f.regime = bench::regime_name(r);
            f.config = layer.config_for(T);
            f.baseline_timing = base_timing;
            f.tokens = T;
            f.local_experts = s.experts;
            f.ep_share = ep_div;
            f.experts_hit = hit;
            f.hot_expert_rows = hot;
            f.weight_bytes = bytes;
            f.flops = flops;
            f.read_bw = read_bw;
            f.dense_tflops = dense_tflops.at(f.regime);
            f.us = ours.t.median_us;
            f.us_p10 = ours.t.p10_us;
            f.us_p90 = ours.t.p90_us;
            f.route_us = route.t.median_us;
            f.baseline_us = base_us;
            f.sm_clock_mhz = ours.sm_clock_mhz;
            f.power_w = ours.power_w;
            f.calls = ours.calls;
            f.nonfinite = nonfinite;
            nlohmann::json c = bench_case_record(f);
            c["routing_source"] = external ? "external (the router timed alongside)" : "router";
            if (opt.diagnostics && T > 0) {
              c["route_logits_alone_us"] = diag_logits_us;
              c["route_topk_alone_us"] = diag_topk_us;
              c["read_after_flush_us"] = diag_read_us;
            }
            records.push_back(c);
            log(bench_case_line(f));
          }
          layer.check();
          if (opt.energy_seconds > 0 && T > 0) {
            const bench::EnergyRun energy =
                bench::measure_energy(std::cref(g_fwd), stream, opt.energy_seconds,
                                      records.front()["us"].get<double>(), true);
            for (auto& c : records) {
              c["energy_mJ"] = energy.mJ_per_call;
              c["energy_power_W"] = energy.watts;
              c["energy_calls"] = energy.calls;
            }
            log(fmt::format("{:14s} E={:3d} T={:5d}: {:.1f} mJ a layer, {:.0f} W over {} calls", name,
                            s.experts, T, energy.mJ_per_call, energy.watts, energy.calls));
          }
          for (auto& c : records) out["cases"].push_back(c);
        }
      }
    }
  }
  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  out["wall_seconds"] = wall_s;
  log(fmt::format("{} case records in {:.0f} s", out["cases"].size(), wall_s));
  cudaStreamDestroy(stream);
  return out;
}

}  // namespace megamoe::api
