// Where the persistent grid's CTAs land: the SM (%smid) of each blockIdx for a grid of one
// CTA an SM with the fused kernel's resources (384 threads, ~225 KB of shared memory), launched
// (a) on an idle GPU, three times; (b) as a programmatic dependent of a busy kernel (the
// routing's shape: many small CTAs that trigger at once), as v37's programmatic launch did. v37
// measured the layer at 4096 tokens +8..+33 % slower when the schedule's units are permuted over
// the CTAs (MEGAMOE_UNIT_STRIDE) and +19..+23 % when launched programmatically: this says
// what mapping the default launch gives and how the programmatic one differs.
// Build (here or on the device machine):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Isrc/kernels \
//        bench/probes/placement_probe.cu -o placement_probe
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "cuda_check.h"
#include "sm90_ptx.cuh"

namespace sm90 = megamoe::sm90;

constexpr int kSmem = 229888;  // the wide-tile kernel's dynamic shared memory

__global__ void __launch_bounds__(384, 1) occupy(unsigned* sm, unsigned long long* start) {
  extern __shared__ unsigned char smem[];
  if (threadIdx.x == 0) {
    start[blockIdx.x] = sm90::globaltimer_ns();
    sm90::grid_dependency_wait();
    sm[blockIdx.x] = sm90::smid();
    smem[0] = 1;
  }
}

// The routing's stand-in: 512 CTAs of 256 threads and 33 KB, each spinning ~40 us after
// letting its dependent launch.
__global__ void __launch_bounds__(256) busy(int* sink) {
  __shared__ float buf[8448];
  sm90::launch_dependents();
  const uint64_t t0 = sm90::globaltimer_ns();
  float v = threadIdx.x;
  while (sm90::globaltimer_ns() - t0 < 40000) v = v * 1.0001f + buf[threadIdx.x];
  if (v == 12345.f) sink[0] = 1;
}

int main() {
  int G = 0;
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&G, cudaDevAttrMultiProcessorCount, 0));
  MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(occupy, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  unsigned* d_sm;
  unsigned long long* d_t;
  int* sink;
  MEGAMOE_CUDA_CHECK(cudaMalloc(&d_sm, G * sizeof(unsigned)));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&d_t, G * sizeof(unsigned long long)));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&sink, 4));
  std::vector<unsigned> sm(G);
  std::vector<unsigned long long> t(G);
  auto report = [&](const char* what) {
    cudaMemcpy(sm.data(), d_sm, G * sizeof(unsigned), cudaMemcpyDeviceToHost);
    cudaMemcpy(t.data(), d_t, G * sizeof(unsigned long long), cudaMemcpyDeviceToHost);
    unsigned long long t0 = t[0];
    for (auto v : t) t0 = v < t0 ? v : t0;
    int adjacent = 0;  // blockIdx 2k, 2k + 1 on SMs 2j, 2j + 1 (one TPC if TPCs pair even / odd SM ids)
    for (int b = 0; b + 1 < G; b += 2) adjacent += (sm[b] / 2 == sm[b + 1] / 2);
    std::printf("%s: blockIdx pairs on SM pairs %d of %d\n  smid by blockIdx:", what, adjacent, G / 2);
    for (int b = 0; b < G; ++b) std::printf("%s%u", b % 22 ? " " : "\n   ", sm[b]);
    std::printf("\n  start us by blockIdx:");
    for (int b = 0; b < G; ++b) std::printf("%s%.1f", b % 22 ? " " : "\n   ", (t[b] - t0) * 1e-3);
    std::printf("\n");
  };
  for (int r = 0; r < 3; ++r) {
    occupy<<<G, 384, kSmem>>>(d_sm, d_t);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    char name[64];
    std::snprintf(name, sizeof name, "plain launch %d", r);
    report(name);
  }
  {  // (v43) two plain launches back to back, no synchronization between them: the plan's
     // unit probe (fused_moe.cu's probe_sm_units) launched that way found them different
    unsigned* d_sm2;
    MEGAMOE_CUDA_CHECK(cudaMalloc(&d_sm2, G * sizeof(unsigned)));
    occupy<<<G, 384, kSmem>>>(d_sm, d_t);
    occupy<<<G, 384, kSmem>>>(d_sm2, d_t);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    report("back to back 0");
    MEGAMOE_CUDA_CHECK(cudaMemcpy(d_sm, d_sm2, G * sizeof(unsigned), cudaMemcpyDeviceToDevice));
    report("back to back 1");
  }
  for (int r = 0; r < 2; ++r) {
    busy<<<512, 256>>>(sink);
    cudaLaunchConfig_t cfg{};
    cudaLaunchAttribute attr = sm90::programmatic_serialization();
    cfg.gridDim = dim3(G), cfg.blockDim = dim3(384), cfg.dynamicSmemBytes = kSmem;
    cfg.attrs = &attr, cfg.numAttrs = 1;
    MEGAMOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, occupy, d_sm, d_t));
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    report(r ? "programmatic after busy 1" : "programmatic after busy 0");
  }
  for (int r = 0; r < 1; ++r) {  // the same busy kernel, then a plain launch
    busy<<<512, 256>>>(sink);
    occupy<<<G, 384, kSmem>>>(d_sm, d_t);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    report("plain after busy");
  }
  return 0;
}
