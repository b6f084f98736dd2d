// Device ceilings and timing helpers for `megamoe bench` (see
// include/megamoe/bench/baselines.h): the streaming-read bandwidth, the L2
// flush and device-event timing with median and spread.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "megamoe/bench/baselines.h"

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
  std::sort(us.begin(), us.end());
  Timing t;
  t.median_us = percentile(us, 0.5);
  t.min_us = us.front();
  t.max_us = us.back();
  t.p10_us = percentile(us, 0.1);
  t.p90_us = percentile(us, 0.9);
  return t;
}

namespace {

// NVML's energy counter through dlopen: nothing links against the driver's management
// library, so the tools still start on a machine without it. Only the three entry
// points used here are declared (C ABI, opaque device handle).
struct NvmlEnergy {
  using Device = void*;
  int (*Init)() = nullptr;
  int (*HandleByPciBusId)(const char*, Device*) = nullptr;
  int (*TotalEnergy)(Device, unsigned long long*) = nullptr;

  static const NvmlEnergy& get() {
    static std::mutex m;
    static NvmlEnergy api;
    static std::string error;
    std::lock_guard<std::mutex> lock(m);
    if (api.TotalEnergy) return api;
    if (!error.empty()) throw std::runtime_error(error);
    void* h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) error = std::string("energy: cannot load libnvidia-ml.so.1 (") + dlerror() + ")";
    NvmlEnergy a;
    if (h) {
      a.Init = reinterpret_cast<int (*)()>(dlsym(h, "nvmlInit_v2"));
      a.HandleByPciBusId =
          reinterpret_cast<int (*)(const char*, Device*)>(dlsym(h, "nvmlDeviceGetHandleByPciBusId_v2"));
      a.TotalEnergy = reinterpret_cast<int (*)(Device, unsigned long long*)>(
          dlsym(h, "nvmlDeviceGetTotalEnergyConsumption"));
      if (!a.Init || !a.HandleByPciBusId || !a.TotalEnergy)
        error = "energy: libnvidia-ml.so.1 lacks nvmlDeviceGetTotalEnergyConsumption";
      else if (const int r = a.Init(); r != 0)
        error = "energy: nvmlInit_v2 failed (NVML error " + std::to_string(r) + ")";
    }
    if (!error.empty()) throw std::runtime_error(error);
    api = a;
    return api;
  }

  // Millijoules since the driver loaded, for the current CUDA device.
  unsigned long long read_mJ() const {
    int dev = 0;
    MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
    char bus[32] = {};
    MEGAMOE_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof(bus), dev));
    Device d = nullptr;
    if (const int r = HandleByPciBusId(bus, &d); r != 0)
      throw std::runtime_error(std::string("energy: no NVML device for ") + bus + " (NVML error " +
                               std::to_string(r) + ")");
    unsigned long long mJ = 0;
    if (const int r = TotalEnergy(d, &mJ); r != 0)
      throw std::runtime_error("energy: nvmlDeviceGetTotalEnergyConsumption failed (NVML error " +
                               std::to_string(r) + ")");
    return mJ;
  }
};

}  // namespace

EnergyRun measure_energy(const std::function<void(cudaStream_t)>& fn, cudaStream_t stream, double seconds,
                         double call_us_estimate, bool flush_l2_each) {
  const NvmlEnergy& nvml = NvmlEnergy::get();
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

}  // namespace megamoe::bench
