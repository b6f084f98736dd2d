// store_probe: what bounds phase 0? At 16384 GLM-5 tokens phase 0 reads x (201 MB of BF16)
// and writes nine FP8 copies of each token into expert-sorted rows (906 MB) in ~680 µs, about
// 1.6 TB/s, and a warp keeping four times the loads in flight moved it by 1 %
// (docs/performance-history.md, v50). Here the fused kernel's grid (one CTA of 384 threads an
// SM) writes the same bytes in phase 0's shape -- a warp instruction stores 512 contiguous
// bytes, 16 a lane -- in four patterns:
//   seq      the 906 MB front to back (each warp its own run of 512-byte pieces);
//   rows9    phase 0's: a task is 512 columns of one token, stored into its nine rows,
//            rows spread over the buffer (a permutation of the 9 T rows), after loading the
//            token's 1 KB of x (x read: 201 MB);
//   rows9nx  the same stores without the loads of x;
//   adj9     the nine rows of a token adjacent (rows 9 t .. 9 t + 8), x loaded.
// Each runs 5 times after a warm-up; the figure is the median's write rate (and with x, the
// bytes moved). Timing only: the bytes are not checked.
// Build (here or on the device machine):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Isrc/kernels \
//        bench/probes/store_probe.cu -o store_probe
// Run: ./store_probe [tokens, default 16384] [hidden, default 6144]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.h"

enum Pattern : int { kSeq = 0, kRows9 = 1, kRows9NoX = 2, kAdj9 = 3 };
constexpr int kSlots = 9;
constexpr int kThreads = 384;

// The row of token t's copy k: adjacent, or spread by a multiplier coprime to the row count.
__device__ __forceinline__ long long row_of(int pattern, long long t, int k, long long rows) {
  const long long r = t * kSlots + k;
  return pattern == kAdj9 ? r : (r * 1000003LL) % rows;
}

__global__ void __launch_bounds__(kThreads, 1)
    store_kernel(int pattern, const uint4* __restrict__ x, uint8_t* __restrict__ out, int T, int H) {
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
  const int warps = gridDim.x * (kThreads / 32);
  const int chunks = H / 512;  // a task: 512 FP8 columns (1 KB of BF16 x)
  const long long tasks = (long long)T * chunks;
  const long long rows = (long long)T * kSlots;
  if (pattern == kSeq) {
    const long long pieces = rows * H / 512;
    for (long long p = warp; p < pieces; p += warps)
      reinterpret_cast<uint4*>(out + p * 512)[lane] = make_uint4(uint32_t(p), 1u, 2u, 3u);
    return;
  }
  for (long long task = warp; task < tasks; task += warps) {
    const long long t = task / chunks;
    const int c = int(task - t * chunks);
    uint4 v = make_uint4(uint32_t(task), 5u, 6u, 7u);
    if (pattern != kRows9NoX) {
      // 32 bytes of BF16 a lane -> 16 FP8 bytes (the bits only need to depend on the load)
      const uint4* src = x + (t * H * 2 + c * 1024) / 16 + lane * 2;
      const uint4 a = src[0], b = src[1];
      v = make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
    }
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const long long r = row_of(pattern, t, k, rows);
      reinterpret_cast<uint4*>(out + r * H + c * 512)[lane] = v;
    }
  }
}

int main(int argc, char** argv) {
  const int T = argc > 1 ? std::atoi(argv[1]) : 16384;
  const int H = argc > 2 ? std::atoi(argv[2]) : 6144;
  if (T <= 0 || H <= 0 || H % 512 != 0) {
    std::fprintf(stderr, "usage: store_probe [tokens > 0] [hidden, a multiple of 512]\n");
    return 2;
  }
  int sms = 0;
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t out_bytes = size_t(T) * kSlots * H, x_bytes = size_t(T) * H * 2;
  uint8_t* out = nullptr;
  uint4* x = nullptr;
  MEGAMOE_CUDA_CHECK(cudaMalloc(&out, out_bytes));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&x, x_bytes));
  MEGAMOE_CUDA_CHECK(cudaMemset(x, 0x3c, x_bytes));
  MEGAMOE_CUDA_CHECK(cudaMemset(out, 0, out_bytes));
  cudaEvent_t e0, e1;
  MEGAMOE_CUDA_CHECK(cudaEventCreate(&e0));
  MEGAMOE_CUDA_CHECK(cudaEventCreate(&e1));
  std::printf("T=%d H=%d: %.0f MB of copies, %.0f MB of x, %d CTAs of %d threads\n", T, H, out_bytes / 1e6,
              x_bytes / 1e6, sms, kThreads);
  const char* names[] = {"seq", "rows9", "rows9nx", "adj9"};
  for (int p : {kSeq, kRows9, kRows9NoX, kAdj9}) {
    std::vector<float> ms;
    for (int rep = 0; rep < 6; ++rep) {
      MEGAMOE_CUDA_CHECK(cudaEventRecord(e0));
      store_kernel<<<sms, kThreads>>>(p, x, out, T, H);
      MEGAMOE_CUDA_CHECK(cudaEventRecord(e1));
      MEGAMOE_CUDA_CHECK(cudaEventSynchronize(e1));
      float m = 0;
      MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&m, e0, e1));
      if (rep > 0) ms.push_back(m);  // (rep 0: the warm-up)
    }
    MEGAMOE_CUDA_CHECK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2] * 1e-3;
    const double moved = out_bytes + (p == kRows9 || p == kAdj9 ? x_bytes : 0);
    std::printf("%-8s %8.1f us  writes %.2f TB/s  moved %.2f TB/s\n", names[p], med * 1e6, out_bytes / med / 1e12,
                moved / med / 1e12);
  }
  MEGAMOE_CUDA_CHECK(cudaFree(out));
  MEGAMOE_CUDA_CHECK(cudaFree(x));
  return 0;
}
