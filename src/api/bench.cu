// The benchmark driver behind `megamoe bench` (see include/megamoe/api/bench.h).
// Every figure a case reports is measured in the same process: the streaming
// read bandwidth (the decode floor), our layer, its routing alone, and the
// cuBLASLt baseline fed with our routing.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <set>
#include <stdexcept>
#include <vector>

#include "../kernels/cuda_check.h"
#include "device_run.h"
#include "megamoe/api/bench.h"
#include "megamoe/api/ep_layer.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/bench/baselines.h"
#include "megamoe/kernels/fused_moe.h"
#include "megamoe/weights/host_weights.h"

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

// Board energy of graph replays of `body` (opt.energy_seconds of them, each after an L2
// flush, as timed); call_us sizes the loop.
bench::EnergyRun energy_graph(cudaStream_t stream, const BenchOptions& opt, double call_us,
                              const std::function<void(cudaStream_t)>& body) {
  const CapturedGraph g(stream, body);
  return bench::measure_energy(std::cref(g), stream, opt.energy_seconds, call_us, true);
}

// The expert-parallel layer over opt.ranks virtual ranks, T tokens per rank, against
// one device running all R * T tokens: time, exchanged bytes, and whether the bytes
// of the outputs agree.
void bench_ep_case(const BenchOptions& opt, const std::string& name, const HostMoeWeights& hw, const void* dw,
                   int T, double read_bw, cudaStream_t stream, nlohmann::json& out,
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
  // busiest rank sets the time; issue 6 reports per-rank figures).
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
      std::max(wbytes / read_bw, double(Tall) * s.flops_per_token() / (opt.tc_peak_tflops * 1e12)) * 1e6;
  // One rank's own floor (its experts' bytes, its rows' and its shared-expert tokens' flops):
  // the floor of the layer on R GPUs is the busiest rank's.
  double rank_floor_us = 0;
  for (int r = 0; r < R; ++r) {
    const double bytes = hit_by[r].size() * expert_bytes(s, s.inter) + shared_bytes(s, T);
    const double flops =
        double(rows_by[r]) * s.expert_flops(s.inter) + double(T) * s.expert_flops(s.shared_inter());
    rank_floor_us =
        std::max(rank_floor_us, std::max(bytes / read_bw, flops / (opt.tc_peak_tflops * 1e12)) * 1e6);
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

MoeShape bench_shape(const std::string& preset, const BenchOptions& opt) {
  MoeShape s = find_preset(preset).shape;
  if (opt.experts > 0) s.experts = opt.experts;
  if (opt.topk > 0) s.topk = opt.topk;
  if (opt.shared_experts >= 0) s.shared_experts = opt.shared_experts;
  if (s.n_group > 1 && s.experts % s.n_group != 0) s.n_group = 1, s.topk_group = 1;
  s.validate();
  return s;
}

nlohmann::json run_bench(const BenchOptions& opt, const std::function<void(const std::string&)>& log) {
  cudaStream_t stream;
  MEGAMOE_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaDeviceProp prop{};
  int dev = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
  MEGAMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  const double read_bw = bench::measure_read_bandwidth(size_t(4) << 30, 20, stream);
  log(fmt::format("device {} ({} SMs), streaming read {:.3f} TB/s, FP8 tensor-core ceiling {:.0f} TFLOP/s",
                  prop.name, prop.multiProcessorCount, read_bw * 1e-12, opt.tc_peak_tflops));
  nlohmann::json out;
  out["device"] = prop.name;
  out["sms"] = prop.multiProcessorCount;
  out["read_bw_TBps"] = read_bw * 1e-12;
  out["tc_peak_tflops"] = opt.tc_peak_tflops;
  out["cases"] = nlohmann::json::array();

  if (opt.ranks > 1) {
    out["ranks"] = opt.ranks;
    for (const std::string& name : opt.presets) {
      const MoeShape s = bench_shape(name, opt);
      HostMoeWeights hw = make_random_weights(s, 1234);
      DeviceBuffer dw(hw.bytes());
      MEGAMOE_CUDA_CHECK(cudaMemcpy(dw.p, hw.data(), hw.bytes(), cudaMemcpyHostToDevice));
      for (int T : opt.tokens) bench_ep_case(opt, name, hw, dw.p, T, read_bw, stream, out, log);
    }
    cudaStreamDestroy(stream);
    return out;
  }

  for (const std::string& name : opt.presets) {
    const MoeShape shape = bench_shape(name, opt);
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
      for (int T : opt.tokens) {
        const std::vector<num::bf16_t> x = bench_input(T, s.hidden);
        DeviceBuffer dx(x.size() * 2), dy(x.size() * 2);
        MEGAMOE_CUDA_CHECK(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
        MoeLayerOptions lo;
        lo.max_tokens = T;
        CudaMoeLayer layer(s, dw.p, lo);
        auto* xp = static_cast<const num::bf16_t*>(dx.p);
        auto* yp = static_cast<num::bf16_t*>(dy.p);
        // As served: the forward and the routing alone as CUDA-graph replays, the token
        // count in device memory (no per-launch host gaps in the figures).
        DeviceBuffer dT(sizeof(int));
        MEGAMOE_CUDA_CHECK(cudaMemcpy(dT.p, &T, sizeof(int), cudaMemcpyHostToDevice));
        const int* dTp = static_cast<const int*>(dT.p);
        const bench::Timing ours =
            time_graph(stream, opt, [&](cudaStream_t st2) { layer.forward(xp, yp, T, dTp, st2); });
        const bench::Timing route =
            time_graph(stream, opt, [&](cudaStream_t st2) { layer.route(xp, T, dTp, st2); });
        bench::EnergyRun energy;
        if (opt.energy_seconds > 0 && T > 0)
          energy = energy_graph(stream, opt, ours.median_us,
                                [&](cudaStream_t st2) { layer.forward(xp, yp, T, dTp, st2); });
        layer.forward(xp, yp, T, nullptr, stream);
        MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
        kernels::fused_moe_print_profile(T);
        std::vector<int32_t> ids(size_t(T) * s.topk);
        std::vector<float> wts(ids.size());
        MEGAMOE_CUDA_CHECK(cudaMemcpy(ids.data(), layer.topk_ids(), ids.size() * 4, cudaMemcpyDeviceToHost));
        MEGAMOE_CUDA_CHECK(
            cudaMemcpy(wts.data(), layer.topk_weights(), wts.size() * 4, cudaMemcpyDeviceToHost));
        std::vector<num::bf16_t> y(x.size());
        MEGAMOE_CUDA_CHECK(cudaMemcpy(y.data(), dy.p, y.size() * 2, cudaMemcpyDeviceToHost));
        size_t nonfinite = 0;
        for (auto v : y) nonfinite += !std::isfinite(num::bf16_decode(v));

        std::set<int> hit(ids.begin(), ids.end());
        hit.erase(-1);
        const double bytes = hit.size() * expert_bytes(s, s.inter) + shared_bytes(s, T);
        const double flops = double(T) * s.flops_per_token();
        const double hbm_floor_us = bytes / read_bw * 1e6;
        const double tc_floor_us = flops / (opt.tc_peak_tflops * 1e12) * 1e6;
        const double floor_us = std::max(hbm_floor_us, tc_floor_us);
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
          // The streaming read of this case's weight bytes after the same L2 flush: what
          // reading them costs as a kernel (launch, ramp, the flush's dirty lines), beside
          // the bandwidth floor.
          const size_t case_bytes = size_t(bytes) / 16 * 16;
          diag_read_us =
              case_bytes / bench::measure_read_bandwidth(case_bytes, opt.iters, stream, true) * 1e6;
          log(
              fmt::format("{:14s} E={:3d} T={:5d}: route {:.1f} us; logits alone {:.1f}, top-k alone {:.1f}; "
                          "reading the case's {:.1f} MB after a flush: {:.1f} us",
                          name, s.experts, T, route.median_us, diag_logits_us, diag_topk_us,
                          case_bytes * 1e-6, diag_read_us));
        }

        double base_us = -1;
        std::string base_timing;
        if (opt.baseline && T > 0) {
          bench::CublasLtMoeBaseline base(s, dview, T);
          const bench::DeviceRoutedBatch& b = base.plan(ids.data(), wts.data(), T, stream);
          // Timed as ours: one graph replay of our routing and the expert-by-expert GEMMs
          // (2 x the experts hit launches: eager, the host's launch gaps counted ~13-15 us
          // a GEMM at decode), after one eager run that settles cuBLASLt's choices. The
          // batch's counts come from the routing before timing (a served expert-by-expert
          // layer would copy them to the host every forward: not counted).
          base.forward(b, xp, yp, stream);
          MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
          try {
            base_us = time_graph(stream, opt, [&](cudaStream_t st2) {
                        layer.route(xp, T, dTp, st2);
                        base.forward(b, xp, yp, st2);
                      }).median_us;
            base_timing = "graph";
          } catch (const std::exception& e) {
            // Said in the log and the JSON: such a ratio counts the launches too.
            log(
                fmt::format("{} T={}: the cuBLASLt baseline cannot be captured in a graph ({}); timed as "
                            "eager launches plus our routing's graph",
                            name, T, e.what()));
            const bench::Timing bt = bench::time_device(
                [&](cudaStream_t st2) { base.forward(b, xp, yp, st2); }, stream, opt.warmup, opt.iters, true);
            base_us = bt.median_us + route.median_us;
            base_timing = "eager";
          }
        }
        nlohmann::json c;
        c["preset"] = name;
        c["shape"] = s.describe();
        c["tokens"] = T;
        c["local_experts"] = s.experts;
        c["ep_share"] = ep_div;
        c["us"] = ours.median_us;
        c["us_p10"] = ours.p10_us;
        c["us_p90"] = ours.p90_us;
        c["route_us"] = route.median_us;
        c["after_routing_us"] = ours.median_us - route.median_us;
        c["floor_us"] = floor_us;
        c["hbm_floor_us"] = hbm_floor_us;
        c["tc_floor_us"] = tc_floor_us;
        c["experts_hit"] = hit.size();
        c["weight_bytes"] = bytes;
        c["tflops"] = flops / (ours.median_us * 1e-6) * 1e-12;
        c["weight_TBps"] = bytes / (ours.median_us * 1e-6) * 1e-12;
        c["ratio_to_floor"] = ours.median_us / floor_us;
        c["baseline_us"] = base_us;
        if (!base_timing.empty()) c["baseline_timing"] = base_timing;  // "graph" from 2026-12-05 on
        c["speedup_vs_baseline"] = base_us > 0 ? base_us / ours.median_us : 0.0;
        c["nonfinite_outputs"] = nonfinite;
        c["config"] = layer.config_for(T);
        if (energy.calls > 0) {
          c["energy_mJ"] = energy.mJ_per_call;
          c["power_W"] = energy.watts;
          c["energy_calls"] = energy.calls;
        }
        if (opt.diagnostics && T > 0) {
          c["route_logits_alone_us"] = diag_logits_us;
          c["route_topk_alone_us"] = diag_topk_us;
          c["read_after_flush_us"] = diag_read_us;
        }
        out["cases"].push_back(c);
        const std::string energy_note = energy.calls > 0
                                            ? fmt::format(" | {:.1f} mJ a layer, {:.0f} W over {} calls",
                                                          energy.mJ_per_call, energy.watts, energy.calls)
                                            : std::string();
        log(fmt::format(
            "{:14s} E={:3d} T={:5d}: {:9.1f} us (p10 {:.1f}, p90 {:.1f}; route {:.1f}) floor {:8.1f} "
            "(x{:.2f}) {:7.1f} TFLOP/s {:5.2f} TB/s | cuBLASLt {:9.1f} us (x{:.2f}) | {}{}",
            name, s.experts, T, ours.median_us, ours.p10_us, ours.p90_us, route.median_us, floor_us,
            ours.median_us / floor_us, flops / (ours.median_us * 1e-6) * 1e-12,
            bytes / (ours.median_us * 1e-6) * 1e-12, base_us, base_us > 0 ? base_us / ours.median_us : 0.0,
            layer.config_for(T), energy_note));
      }
    }
  }
  cudaStreamDestroy(stream);
  return out;
}

}  // namespace megamoe::api
