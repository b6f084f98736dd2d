// Device ceilings and timing helpers for `megamoe bench` (see
// bench/include/megamoe_bench/baselines.h): the streaming-read bandwidth, the L2
// flush and device-event timing with median and spread.
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../../src/kernels/cuda_check.h"
#include "megamoe_bench/baselines.h"

namespace megamoe::bench {
namespace {

constexpr int kReadThreads = 512;
constexpr int kReadUnroll = 8;  // independent 16-byte loads in flight per thread

// Grid-stride streaming read. Each thread issues kReadUnroll independent loads
// before consuming any, so every SM keeps enough bytes in flight to cover
// HBM latency; the XOR of everything read is written per block so the loads
// cannot be removed.
__global__ void __launch_bounds__(kReadThreads)
    stream_read_kernel(const uint4* __restrict__ src, size_t n, uint32_t* __restrict__ sink) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  for (; i + (kReadUnroll - 1) * stride < n; i += kReadUnroll * stride) {
    uint4 v[kReadUnroll];
#pragma unroll
    for (int u = 0; u < kReadUnroll; ++u) v[u] = __ldcs(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kReadUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = __ldcs(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  // Warp then block XOR reduction.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ uint32_t warp_acc[kReadThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_acc[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t a = 0;
    for (int w = 0; w < kReadThreads / 32; ++w) a ^= warp_acc[w];
    sink[blockIdx.x] = a;
  }
}

struct EventPair {
  cudaEvent_t start = nullptr, stop = nullptr;
  EventPair() {
    MEGAMOE_CUDA_CHECK(cudaEventCreate(&start));
    MEGAMOE_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~EventPair() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
};

// Sorted-sample percentile by linear interpolation.
double percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const double pos = p * double(sorted.size() - 1);
  const size_t lo = size_t(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  const double f = pos - double(lo);
  return sorted[lo] * (1 - f) + sorted[hi] * f;
}

// The median, extremes and p10 / p90 of a set of samples (µs).
Timing timing_of(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  Timing t;
  t.median_us = percentile(us, 0.5);
  t.min_us = us.front();
  t.max_us = us.back();
  t.p10_us = percentile(us, 0.1);
  t.p90_us = percentile(us, 0.9);
  return t;
}

}  // namespace

double measure_read_bandwidth(size_t bytes, int iters, cudaStream_t stream, bool flush_l2_each) {
  if (bytes < 16 || iters < 1) throw std::invalid_argument("measure_read_bandwidth: bytes >= 16, iters >= 1");
  int dev = 0, sms = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  int per_sm = 0;
  MEGAMOE_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, stream_read_kernel, kReadThreads, 0));
  const int grid = sms * std::max(per_sm, 1);

  const size_t n = bytes / sizeof(uint4);
  uint4* buf = nullptr;
  uint32_t* sink = nullptr;
  MEGAMOE_CUDA_CHECK(cudaMalloc(&buf, n * sizeof(uint4)));
  double result = 0;
  try {
    MEGAMOE_CUDA_CHECK(cudaMalloc(&sink, grid * sizeof(uint32_t)));
    // Touch every page once so the timed passes read committed memory.
    MEGAMOE_CUDA_CHECK(cudaMemsetAsync(buf, 0x5A, n * sizeof(uint4), stream));
    const Timing t = time_device(
        [&](cudaStream_t s) {
          stream_read_kernel<<<grid, kReadThreads, 0, s>>>(buf, n, sink);
          MEGAMOE_CUDA_CHECK_LAUNCH();
        },
        stream, 1, iters, flush_l2_each);
    result = double(n * sizeof(uint4)) / (t.median_us * 1e-6);
  } catch (...) {
    cudaFree(sink);
    cudaFree(buf);
    throw;
  }
  MEGAMOE_CUDA_CHECK(cudaFree(sink));
  MEGAMOE_CUDA_CHECK(cudaFree(buf));
  return result;
}

void flush_l2(cudaStream_t stream, const std::vector<int>& others) {
  // NOTE: kept for the life of the process (one per device, never freed): a
  // static destructor would run after the CUDA context may be gone.
  struct Flush {
    void* p = nullptr;
    size_t bytes = 0;
    cudaStream_t s = nullptr;  // (another device's flush)
    cudaEvent_t done = nullptr;
    cudaEvent_t fork = nullptr;  // (the calling device's: the other devices' flushes wait on it)
  };
  static std::map<int, Flush> buffers;
  int dev = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
  auto buffer = [&](int d) -> Flush& {
    auto it = buffers.find(d);
    if (it == buffers.end()) {
      Flush f;
      int l2 = 0;
      MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, d));
      f.bytes = 2 * size_t(std::max(l2, 1 << 20));
      MEGAMOE_CUDA_CHECK(cudaMalloc(&f.p, f.bytes));
      it = buffers.emplace(d, f).first;
    }
    return it->second;
  };
  Flush& own = buffer(dev);
  bool forked = false;
  for (int d : others) {
    if (d == dev) continue;
    // NOTE: another device's flush waits for the work on `stream` so far (the last timed
    // run): on its own stream it would run at once, all iterations' flushes ahead of the
    // runs they should precede, and that device would start every timed run warm.
    if (!forked) {
      if (!own.fork) MEGAMOE_CUDA_CHECK(cudaEventCreateWithFlags(&own.fork, cudaEventDisableTiming));
      MEGAMOE_CUDA_CHECK(cudaEventRecord(own.fork, stream));
      forked = true;
    }
    MEGAMOE_CUDA_CHECK(cudaSetDevice(d));  // (d current: its buffer, stream and event are made there)
    Flush& f = buffer(d);
    if (!f.s) {
      MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&f.s, cudaStreamNonBlocking));
      MEGAMOE_CUDA_CHECK(cudaEventCreateWithFlags(&f.done, cudaEventDisableTiming));
    }
    MEGAMOE_CUDA_CHECK(cudaStreamWaitEvent(f.s, own.fork, 0));
    MEGAMOE_CUDA_CHECK(cudaMemsetAsync(f.p, 0, f.bytes, f.s));
    MEGAMOE_CUDA_CHECK(cudaEventRecord(f.done, f.s));
    MEGAMOE_CUDA_CHECK(cudaSetDevice(dev));
    MEGAMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, f.done, 0));
  }
  MEGAMOE_CUDA_CHECK(cudaMemsetAsync(own.p, 0, own.bytes, stream));
}

Timing time_device(const std::function<void(cudaStream_t)>& fn, cudaStream_t stream, int warmup, int iters,
                   bool flush_l2_each, const std::vector<int>& flush_others) {
  if (iters < 1) throw std::invalid_argument("time_device: iters >= 1");
  for (int i = 0; i < warmup; ++i) fn(stream);
  std::vector<EventPair> ev(iters);
  for (int i = 0; i < iters; ++i) {
    if (flush_l2_each) flush_l2(stream, flush_others);
    MEGAMOE_CUDA_CHECK(cudaEventRecord(ev[i].start, stream));
    fn(stream);
    MEGAMOE_CUDA_CHECK(cudaEventRecord(ev[i].stop, stream));
  }
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> us(iters);
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[i].start, ev[i].stop));
    us[i] = double(ms) * 1e3;
  }
  return timing_of(std::move(us));
}

namespace {

// NVML through dlopen: nothing links against the driver's management library, so the
// tools still start on a machine without it. Only the entry points used here are
// declared (C ABI, opaque device handle; NVML_CLOCK_SM is 1 in nvmlClockType_t).
struct Nvml {
  using Device = void*;
  static constexpr int kClockSm = 1;
  int (*Init)() = nullptr;
  int (*HandleByPciBusId)(const char*, Device*) = nullptr;
  int (*TotalEnergy)(Device, unsigned long long*) = nullptr;
  int (*ClockInfo)(Device, int, unsigned int*) = nullptr;
  int (*PowerUsage)(Device, unsigned int*) = nullptr;

  static const Nvml& get() {
    static std::mutex m;
    static Nvml api;
    static bool loaded = false;
    static std::string error;
    std::lock_guard<std::mutex> lock(m);
    if (loaded) return api;
    if (!error.empty()) throw std::runtime_error(error);
    void* h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) error = std::string("NVML: cannot load libnvidia-ml.so.1 (") + dlerror() + ")";
    Nvml a;
    if (h) {
      a.Init = reinterpret_cast<int (*)()>(dlsym(h, "nvmlInit_v2"));
      a.HandleByPciBusId =
          reinterpret_cast<int (*)(const char*, Device*)>(dlsym(h, "nvmlDeviceGetHandleByPciBusId_v2"));
      a.TotalEnergy = reinterpret_cast<int (*)(Device, unsigned long long*)>(
          dlsym(h, "nvmlDeviceGetTotalEnergyConsumption"));
      a.ClockInfo = reinterpret_cast<int (*)(Device, int, unsigned int*)>(dlsym(h, "nvmlDeviceGetClockInfo"));
      a.PowerUsage = reinterpret_cast<int (*)(Device, unsigned int*)>(dlsym(h, "nvmlDeviceGetPowerUsage"));
      if (!a.Init || !a.HandleByPciBusId)
        error = "NVML: libnvidia-ml.so.1 lacks nvmlInit_v2 / nvmlDeviceGetHandleByPciBusId_v2";
      else if (const int r = a.Init(); r != 0)
        error = "NVML: nvmlInit_v2 failed (NVML error " + std::to_string(r) + ")";
    }
    if (!error.empty()) throw std::runtime_error(error);
    api = a;
    loaded = true;
    return api;
  }

  // The NVML handle of the current CUDA device.
  Device device() const {
    int dev = 0;
    MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
    char bus[32] = {};
    MEGAMOE_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof(bus), dev));
    Device d = nullptr;
    if (const int r = HandleByPciBusId(bus, &d); r != 0)
      throw std::runtime_error(std::string("NVML: no device for ") + bus + " (NVML error " +
                               std::to_string(r) + ")");
    return d;
  }

  // Millijoules since the driver loaded, for the current CUDA device.
  unsigned long long read_mJ() const {
    if (!TotalEnergy)
      throw std::runtime_error("energy: libnvidia-ml.so.1 lacks nvmlDeviceGetTotalEnergyConsumption");
    unsigned long long mJ = 0;
    if (const int r = TotalEnergy(device(), &mJ); r != 0)
      throw std::runtime_error("energy: nvmlDeviceGetTotalEnergyConsumption failed (NVML error " +
                               std::to_string(r) + ")");
    return mJ;
  }

  // The SM clock (MHz) and board power (W) of device d.
  void read_clock_power(Device d, double& mhz, double& watts) const {
    if (!ClockInfo || !PowerUsage)
      throw std::runtime_error(
          "NVML: libnvidia-ml.so.1 lacks nvmlDeviceGetClockInfo / nvmlDeviceGetPowerUsage");
    unsigned int clk = 0, mw = 0;
    if (const int r = ClockInfo(d, kClockSm, &clk); r != 0)
      throw std::runtime_error("NVML: nvmlDeviceGetClockInfo(NVML_CLOCK_SM) failed (NVML error " +
                               std::to_string(r) + ")");
    if (const int r = PowerUsage(d, &mw); r != 0)
      throw std::runtime_error("NVML: nvmlDeviceGetPowerUsage failed (NVML error " + std::to_string(r) + ")");
    mhz = clk;
    watts = mw * 1e-3;
  }
};

double median_of(std::vector<double> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  return percentile(v, 0.5);
}

// Samples the SM clock and power of one device from a host thread every period_ms
// until stopped; NVML errors in the thread are rethrown by stop().
class NvmlSampler {
 public:
  NvmlSampler(const Nvml& nvml, Nvml::Device d, int period_ms) : nvml_(nvml), d_(d), period_ms_(period_ms) {}
  void start() {
    stop_ = false;
    thread_ = std::thread([this] {
      try {
        while (!stop_.load()) {
          double mhz = 0, w = 0;
          nvml_.read_clock_power(d_, mhz, w);
          clock_.push_back(mhz);
          power_.push_back(w);
          std::this_thread::sleep_for(std::chrono::milliseconds(period_ms_));
        }
      } catch (...) {
        error_ = std::current_exception();
      }
    });
  }
  void stop(RegimeTiming& out) {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    if (error_) std::rethrow_exception(error_);
    out.sm_clock_mhz = median_of(clock_);
    out.power_w = median_of(power_);
    out.samples = int(clock_.size());
  }
  ~NvmlSampler() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  const Nvml& nvml_;
  Nvml::Device d_;
  int period_ms_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::exception_ptr error_;
  std::vector<double> clock_, power_;
};

}  // namespace

EnergyRun measure_energy(const std::function<void(cudaStream_t)>& fn, cudaStream_t stream, double seconds,
                         double call_us_estimate, bool flush_l2_each) {
  const Nvml& nvml = Nvml::get();
  // Enough calls for `seconds`, enqueued in batches so the host never runs far ahead.
  const int calls = std::max(1, int(std::ceil(seconds * 1e6 / std::max(call_us_estimate, 1.0))));
  const int batch = std::max(1, std::min(calls, int(std::ceil(0.05e6 / std::max(call_us_estimate, 1.0)))));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const unsigned long long e0 = nvml.read_mJ();
  const auto t0 = std::chrono::steady_clock::now();
  for (int done = 0; done < calls;) {
    const int n = std::min(batch, calls - done);
    for (int i = 0; i < n; ++i) {
      if (flush_l2_each) flush_l2(stream);
      fn(stream);
    }
    done += n;
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  const auto t1 = std::chrono::steady_clock::now();
  const unsigned long long e1 = nvml.read_mJ();
  EnergyRun r;
  r.calls = calls;
  r.mJ_per_call = double(e1 - e0) / calls;
  r.watts = double(e1 - e0) * 1e-3 / std::chrono::duration<double>(t1 - t0).count();
  return r;
}

const char* regime_name(Regime r) { return r == Regime::kSustained ? "sustained" : "burst"; }

void check_nvml_clock_and_power() {
  const Nvml& nvml = Nvml::get();
  double mhz = 0, w = 0;
  nvml.read_clock_power(nvml.device(), mhz, w);
}

RegimeTiming time_regime(const std::function<void(cudaStream_t)>& fn, cudaStream_t stream, Regime regime,
                         const RegimeOptions& opt) {
  if (opt.burst_calls < 1 || !(opt.sustained_seconds > 0) || !(opt.ramp_seconds >= 0) ||
      !(opt.burst_gap_ms >= 0))
    throw std::invalid_argument(
        "time_regime: burst_calls >= 1, sustained_seconds > 0, ramp_seconds >= 0, "
        "burst_gap_ms >= 0");
  const Nvml* nvml = opt.sample_nvml ? &Nvml::get() : nullptr;
  const Nvml::Device nv_dev = nvml ? nvml->device() : nullptr;
  auto call = [&](cudaStream_t s) {
    if (opt.flush_l2_each) flush_l2(s);
    fn(s);
  };
  // Warm-up, and the time one flushed call takes (sizes the sustained batches).
  EventPair w;
  for (int i = 0; i < 2; ++i) call(stream);
  MEGAMOE_CUDA_CHECK(cudaEventRecord(w.start, stream));
  call(stream);
  MEGAMOE_CUDA_CHECK(cudaEventRecord(w.stop, stream));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  float warm_ms = 0;
  MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&warm_ms, w.start, w.stop));

  RegimeTiming out;
  std::vector<double> us;
  if (regime == Regime::kBurst) {
    std::vector<EventPair> ev(opt.burst_calls);
    std::vector<double> clock, power;
    for (int i = 0; i < opt.burst_calls; ++i) {
      MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(opt.burst_gap_ms));
      if (opt.flush_l2_each) flush_l2(stream);
      MEGAMOE_CUDA_CHECK(cudaEventRecord(ev[i].start, stream));
      fn(stream);
      MEGAMOE_CUDA_CHECK(cudaEventRecord(ev[i].stop, stream));
      if (nvml) {
        double mhz = 0, watts = 0;
        nvml->read_clock_power(nv_dev, mhz, watts);
        clock.push_back(mhz);
        power.push_back(watts);
      }
    }
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (auto& e : ev) {
      float ms = 0;
      MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e.start, e.stop));
      us.push_back(double(ms) * 1e3);
    }
    out.sm_clock_mhz = median_of(clock);
    out.power_w = median_of(power);
    out.samples = int(clock.size());
  } else {
    // Batches of ~20 ms of calls; the host enqueues batch n+1 before it waits for batch
    // n, so the device never idles between them. Timed batches keep an event pair a
    // call (two pools, used in turn).
    const double call_ms = std::max(double(warm_ms), 1e-3);
    const int batch = std::clamp(int(std::ceil(20.0 / call_ms)), 1, 2048);
    std::vector<EventPair> pool[2] = {std::vector<EventPair>(batch), std::vector<EventPair>(batch)};
    struct Pending {
      EventPair* done;  // (its stop: the batch's last call)
      int pool, calls;
      bool timed;
    };
    std::deque<Pending> pending;
    int turn = 0;
    auto collect = [&](const Pending& p) {
      MEGAMOE_CUDA_CHECK(cudaEventSynchronize(p.done->stop));
      if (!p.timed) return;
      for (int i = 0; i < p.calls; ++i) {
        float ms = 0;
        MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, pool[p.pool][i].start, pool[p.pool][i].stop));
        us.push_back(double(ms) * 1e3);
      }
    };
    auto window = [&](double seconds, bool timed) {
      const auto t0 = std::chrono::steady_clock::now();
      do {
        // (a pool is reused only after the batch that used it was collected)
        if (pending.size() == 2) collect(pending.front()), pending.pop_front();
        const int p = turn;
        turn ^= 1;
        for (int i = 0; i < batch; ++i) {
          if (opt.flush_l2_each) flush_l2(stream);
          MEGAMOE_CUDA_CHECK(cudaEventRecord(pool[p][i].start, stream));
          fn(stream);
          MEGAMOE_CUDA_CHECK(cudaEventRecord(pool[p][i].stop, stream));
        }
        pending.push_back(Pending{&pool[p][batch - 1], p, batch, timed});
      } while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds);
    };
    if (opt.ramp_seconds > 0) window(opt.ramp_seconds, false);
    std::unique_ptr<NvmlSampler> sampler;
    if (nvml) {
      // (the ramp's batches drain first, so the samples cover the timed calls)
      while (!pending.empty()) collect(pending.front()), pending.pop_front();
      sampler = std::make_unique<NvmlSampler>(*nvml, nv_dev, 25);
      sampler->start();
    }
    window(opt.sustained_seconds, true);
    while (!pending.empty()) collect(pending.front()), pending.pop_front();
    if (sampler) sampler->stop(out);
  }
  out.calls = int(us.size());
  out.t = timing_of(std::move(us));
  return out;
}

}  // namespace megamoe::bench
