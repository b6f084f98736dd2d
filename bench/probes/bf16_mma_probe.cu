// bf16_mma_probe: do wgmma (m64n64k16, BF16 -> F32, A from shared memory or from
// registers, B from shared memory) and mma.sync (m16n8k16, the router's instruction) give
// the same float for every output element of the same chain of 16-deep steps? If they do,
// a wgmma router tile computes bit for bit the logits of the mma.sync tiles, so the router
// may use either per tile shape without the logits depending on the token count (route.cu's
// NOTE). Measured on an H200: identical, 1.2 M elements.
// The data: BF16 with exponents spread over 2^-24..2^24, random signs, so the partial
// sums cancel and the alignment / truncation inside the tensor cores shows; and a
// start value C. Each trial compares all 64 x N elements after a chain of kSteps steps.
//
// Build (here or on the device machine):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Isrc/kernels \
//        bench/probes/bf16_mma_probe.cu -o bf16_mma_probe
// Run: ./bf16_mma_probe [trials, default 200]
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda_check.h"
#include "sm90_ptx.cuh"

namespace sm90 = megamoe::sm90;

constexpr int kM = 64, kN = 64, kK = 64;  // one 128-byte swizzled row of K per operand row
constexpr int kSteps = kK / 16;

// D[64 x 64] += A[64 x 16] * B[64 x 16]^T, BF16 inputs both K-major from 128-byte-swizzled
// shared memory (sm90_ptx.cuh's descriptors), F32 accumulators (Wgmma<64>'s layout).
__device__ __forceinline__ void wgmma_bf16_ss(float (&d)[32], uint64_t a, uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
      "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, 1, 1, 1, 0, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b));
}
// The same with A from registers (the warp's 16 rows, mma.sync's m16n8k16 A fragment).
__device__ __forceinline__ void wgmma_bf16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
      "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// 128-byte swizzle of a [rows][64] BF16 tile: 16-byte chunk c of row r at chunk c ^ (r % 8).
__device__ __forceinline__ int swz(int r, int k) { return r * 64 + (((k / 8) ^ (r % 8)) * 8) + k % 8; }

// One block of 128 threads: dw = the wgmma chain (A from shared memory), dr = the wgmma chain
// (A from registers), dm = the mma.sync chain, all from C.
__global__ void probe_kernel(const uint16_t* A, const uint16_t* B, const float* C, float* dw, float* dr,
                             float* dm) {
  __shared__ __align__(1024) uint16_t sa[kM * kK];
  __shared__ __align__(1024) uint16_t sb[kN * kK];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int i = tid; i < kM * kK; i += 128) sa[swz(i / kK, i % kK)] = A[i];
  for (int i = tid; i < kN * kK; i += 128) sb[swz(i / kK, i % kK)] = B[i];
  sm90::fence_proxy_async_shared();
  __syncthreads();

  // wgmma: fragment element i of thread (warp, lane): row warp*16 + lane/4 + 8*((i/2)%2),
  // column (i/4)*8 + (lane%4)*2 + i%2.
  float d[32];
  auto row_w = [&](int i) { return warp * 16 + lane / 4 + 8 * ((i / 2) % 2); };
  auto col_w = [&](int i) { return (i / 4) * 8 + (lane % 4) * 2 + i % 2; };
  for (int i = 0; i < 32; ++i) d[i] = C[row_w(i) * kN + col_w(i)];
  const uint32_t da = sm90::smem_desc_sw128_lo(sa), db = sm90::smem_desc_sw128_lo(sb);
  sm90::wgmma_fence();
#pragma unroll
  for (int s = 0; s < kSteps; ++s)
    wgmma_bf16_ss(d, sm90::smem_desc_sw128_at(da + s * 2), sm90::smem_desc_sw128_at(db + s * 2));
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  for (int i = 0; i < 32; ++i) dw[row_w(i) * kN + col_w(i)] = d[i];

  // The same chain with A from registers (ldmatrix; the router's form): into dr.
  for (int i = 0; i < 32; ++i) d[i] = C[row_w(i) * kN + col_w(i)];
  uint32_t af[kSteps][4];
  const int ar = warp * 16 + lane % 16;
  for (int s = 0; s < kSteps; ++s)
    ldmatrix_x4(sm90::smem_u32(sa) + ar * 128 + (((2 * s + lane / 16) ^ (ar % 8)) * 16), af[s]);
  sm90::wgmma_fence();
#pragma unroll
  for (int s = 0; s < kSteps; ++s) wgmma_bf16_rs(d, af[s], sm90::smem_desc_sw128_at(db + s * 2));
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  for (int i = 0; i < 32; ++i) dr[row_w(i) * kN + col_w(i)] = d[i];

  // mma.sync: warp w takes rows 16w..16w+15, all 64 columns as 8 n8 tiles.
  const int g = lane / 4, tq = lane % 4;
  for (int nt = 0; nt < kN / 8; ++nt) {
    float acc[4];
    for (int q = 0; q < 4; ++q) acc[q] = C[(warp * 16 + g + 8 * (q / 2)) * kN + nt * 8 + 2 * tq + q % 2];
    for (int s = 0; s < kSteps; ++s) {
      auto ld2 = [&](const uint16_t* m, int r, int k) {
        return uint32_t(m[r * kK + k]) | (uint32_t(m[r * kK + k + 1]) << 16);
      };
      const int k0 = s * 16 + 2 * tq;
      const uint32_t af[4] = {ld2(A, warp * 16 + g, k0), ld2(A, warp * 16 + g + 8, k0),
                              ld2(A, warp * 16 + g, k0 + 8), ld2(A, warp * 16 + g + 8, k0 + 8)};
      sm90::mma_bf16_16816(acc, af, ld2(B, nt * 8 + g, k0), ld2(B, nt * 8 + g, k0 + 8));
    }
    for (int q = 0; q < 4; ++q) dm[(warp * 16 + g + 8 * (q / 2)) * kN + nt * 8 + 2 * tq + q % 2] = acc[q];
  }
}

static uint16_t to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
static double from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

int main(int argc, char** argv) {
  const int trials = argc > 1 ? std::atoi(argv[1]) : 200;
  std::mt19937 rng(12345);
  std::vector<uint16_t> A(kM * kK), B(kN * kK);
  std::vector<float> C(kM * kN), dw(kM * kN), dr(kM * kN), dm(kM * kN);
  uint16_t *gA, *gB;
  float *gC, *gw, *gr, *gm;
  MEGAMOE_CUDA_CHECK(cudaMalloc(&gA, A.size() * 2));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&gB, B.size() * 2));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&gC, C.size() * 4));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&gw, C.size() * 4));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&gr, C.size() * 4));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&gm, C.size() * 4));
  long long diff = 0, diff_rs = 0, total = 0, w_better = 0, m_better = 0;
  for (int t = 0; t < trials; ++t) {
    // exponent spread by trial: 0 (all near 1), then up to +-24
    const int spread = t % 25;
    std::uniform_int_distribution<int> ex(-spread, spread);
    std::uniform_real_distribution<float> mant(1.0f, 2.0f);
    auto val = [&] { return std::ldexp(mant(rng), ex(rng)) * (rng() % 2 ? 1.0f : -1.0f); };
    for (auto& v : A) v = to_bf16(val());
    for (auto& v : B) v = to_bf16(val());
    for (auto& v : C) v = t % 2 ? val() : 0.0f;
    MEGAMOE_CUDA_CHECK(cudaMemcpy(gA, A.data(), A.size() * 2, cudaMemcpyHostToDevice));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(gB, B.data(), B.size() * 2, cudaMemcpyHostToDevice));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(gC, C.data(), C.size() * 4, cudaMemcpyHostToDevice));
    MEGAMOE_CUDA_CHECK(cudaMemset(gw, 0xFF, C.size() * 4));
    MEGAMOE_CUDA_CHECK(cudaMemset(gr, 0xFF, C.size() * 4));
    MEGAMOE_CUDA_CHECK(cudaMemset(gm, 0xFF, C.size() * 4));
    probe_kernel<<<1, 128>>>(gA, gB, gC, gw, gr, gm);
    MEGAMOE_CUDA_CHECK(cudaGetLastError());
    MEGAMOE_CUDA_CHECK(cudaMemcpy(dw.data(), gw, C.size() * 4, cudaMemcpyDeviceToHost));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(dr.data(), gr, C.size() * 4, cudaMemcpyDeviceToHost));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(dm.data(), gm, C.size() * 4, cudaMemcpyDeviceToHost));
    for (int i = 0; i < kM * kN; ++i) {
      ++total;
      if (std::memcmp(&dr[i], &dw[i], 4) != 0) ++diff_rs;
      if (std::memcmp(&dw[i], &dm[i], 4) == 0) continue;
      ++diff;
      const int r = i / kN, c = i % kN;
      double exact = C[i];
      for (int k = 0; k < kK; ++k) exact += from_bf16(A[r * kK + k]) * from_bf16(B[c * kK + k]);
      const double ew = std::fabs(dw[i] - exact), em = std::fabs(dm[i] - exact);
      w_better += ew < em, m_better += em < ew;
      if (diff <= 5)
        std::printf("trial %d spread %d (%d,%d): wgmma %.9g mma.sync %.9g exact %.9g\n", t, spread, r, c,
                    dw[i], dm[i], exact);
    }
  }
  std::printf("elements %lld, different bits %lld (wgmma closer %lld, mma.sync closer %lld)\n", total, diff,
              w_better, m_better);
  std::printf("A from registers against A from shared memory: different bits %lld\n", diff_rs);
  std::printf("%s\n", diff == 0 && diff_rs == 0
                          ? "IDENTICAL: wgmma (both forms) and mma.sync give the same floats"
                          : "DIFFERENT");
  return 0;
}
