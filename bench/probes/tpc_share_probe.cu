// tpc_share_probe: do two CTAs on one TPC read the same bytes more cheaply than two CTAs
// elsewhere? The prefill layer ran up to a third slower when the schedule's units were
// permuted over the CTAs (docs/performance-history.md, schedule; a plain launch puts
// blockIdx 2k, 2k + 1 on one TPC, placement_probe.cu). Here every CTA (one an SM, the fused kernel's
// 384 threads and ~225 KB of shared memory) only streams bytes from global memory into a
// four-stage shared ring by 32 KB bulk copies, and CTA b reads the region of the pair
// {b, partner(b)} in step with its partner:
//   own   partner(b) = b: every CTA its own bytes (the baseline);
//   tpc   partner(b) = b ^ 1: TPC mates read the same bytes;
//   next  partner(b) = b ^ 2: CTAs of neighbouring TPC pairs (16 SM ids apart) share;
//   far   partner(b) = b +- G / 2: CTAs far apart share.
// Each pattern runs from HBM (32 MB regions, L2 flushed first) and from L2 (256 KB regions read
// 128 times). Timing only: the bytes are not used.
// Build (here or on the device machine):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Isrc/kernels \
//        bench/probes/tpc_share_probe.cu -o tpc_share_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "cuda_check.h"
#include "sm90_ptx.cuh"

namespace sm90 = megamoe::sm90;

constexpr int kSmem = 229888;  // the wide-tile kernel's dynamic shared memory (one CTA an SM)
constexpr int kChunk = 32768;
constexpr int kStages = 4;

__device__ int partner(int b, int mode, int G) {
  const int p = mode == 0   ? b
                : mode == 1 ? (b ^ 1)
                : mode == 2 ? (b ^ 2)
                            : (b < G / 2 ? b + G / 2 : b - G / 2);
  return p < G ? p : b;
}

__global__ void __launch_bounds__(384, 1)
    stream(const uint8_t* base, size_t region_bytes, int loops, int mode, unsigned long long* cycles) {
  extern __shared__ __align__(1024) uint8_t smem[];
  if (threadIdx.x != 0) return;
  const int b = blockIdx.x;
  const uint8_t* src = base + size_t(min(b, partner(b, mode, gridDim.x))) * region_bytes;
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + kStages * kChunk);
  for (int s = 0; s < kStages; ++s) sm90::mbar_init(&bar[s], 1);
  sm90::mbar_init_fence();
  const int chunks = int(region_bytes / kChunk), total = chunks * loops;
  const unsigned long long t0 = clock64();
  for (int i = 0; i < total + kStages; ++i) {
    const int s = i % kStages;
    if (i >= kStages) sm90::mbar_wait(&bar[s], ((i / kStages) - 1) & 1);
    if (i < total) {
      sm90::mbar_arrive_expect_tx(&bar[s], kChunk);
      sm90::bulk_load(smem + s * kChunk, src + size_t(i % chunks) * kChunk, kChunk, &bar[s]);
    }
  }
  cycles[b] = clock64() - t0;
}

int main() {
  int G = 0;
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&G, cudaDevAttrMultiProcessorCount, 0));
  MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const size_t hbm_region = size_t(32) << 20, l2_region = size_t(256) << 10;
  uint8_t *buf = nullptr, *flush = nullptr;
  unsigned long long* cycles = nullptr;
  MEGAMOE_CUDA_CHECK(cudaMalloc(&buf, size_t(G) * hbm_region));
  MEGAMOE_CUDA_CHECK(cudaMemset(buf, 1, size_t(G) * hbm_region));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&flush, size_t(256) << 20));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&cycles, G * sizeof(unsigned long long)));
  cudaEvent_t e0, e1;
  MEGAMOE_CUDA_CHECK(cudaEventCreate(&e0));
  MEGAMOE_CUDA_CHECK(cudaEventCreate(&e1));
  const char* names[] = {"own", "tpc", "next", "far"};
  std::printf("%d CTAs, 32 KB bulk copies, %d stages; GB/s = bytes the CTAs received / time\n", G, kStages);
  for (int l2 = 0; l2 < 2; ++l2) {
    const size_t region = l2 ? l2_region : hbm_region;
    const int loops = l2 ? 128 : 1;
    for (int round = 0; round < 2; ++round)
      for (int mode = 0; mode < 4; ++mode) {
        std::vector<float> us;
        for (int rep = 0; rep < 5; ++rep) {
          if (!l2) MEGAMOE_CUDA_CHECK(cudaMemset(flush, rep, size_t(256) << 20));  // L2 flushed
          if (l2) stream<<<G, 384, kSmem>>>(buf, region, 1, mode, cycles);         // L2 warmed
          MEGAMOE_CUDA_CHECK(cudaEventRecord(e0));
          stream<<<G, 384, kSmem>>>(buf, region, loops, mode, cycles);
          MEGAMOE_CUDA_CHECK(cudaEventRecord(e1));
          MEGAMOE_CUDA_CHECK(cudaEventSynchronize(e1));
          float ms = 0;
          MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
          us.push_back(ms * 1e3f);
        }
        std::sort(us.begin(), us.end());
        const double bytes = double(G) * region * loops;
        std::printf("%s %-4s round %d: median %8.1f us (min %8.1f), %7.0f GB/s received\n",
                    l2 ? "L2 " : "HBM", names[mode], round, us[2], us[0], bytes / (us[2] * 1e-6) * 1e-9);
      }
  }
  return 0;
}
