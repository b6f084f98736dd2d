// Probe of the Hopper FP8 tensor cores' accumulation (wgmma m64n8k32, E4M3 x E4M3 ->
// F32): runs chains of 1, 2 and 4 wgmma (K = 32, 64, 128) on random inputs, from zero
// (scale_d = 0) and from a given accumulator, and writes inputs and results to a file
// for fitting num::fp8_mma's model offline (bench/results/NOTES.md, v16).
// Build: nvcc -std=c++17 -O2 -gencode arch=compute_90a,code=sm_90a -Iinclude
//        -Isrc/kernels bench/probes/wgmma_fp8_accum.cu -o wgmma_probe
// Run:   wgmma_probe TRIALS OUT_FILE
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "megamoe/numerics/fp8.h"
#include "sm90_ptx.cuh"

namespace {

constexpr int kM = 64, kN = 8, kK = 128;  // one 128-byte swizzled row per operand row
constexpr int kExperiments = 6;           // chains of 1, 2, 4 wgmma; from zero, from C
__device__ __forceinline__ int chain_len(int e) { return 1 << (e % 3); }  // 1, 2, 4

__global__ void probe(const uint8_t* A, const uint8_t* B, const float* C, float* D) {
  __shared__ __align__(1024) uint8_t sa[kM * kK];
  __shared__ __align__(1024) uint8_t sb[kN * kK];
  const int trial = blockIdx.x, t = threadIdx.x;
  const uint8_t* a = A + size_t(trial) * kM * kK;
  const uint8_t* b = B + size_t(trial) * kN * kK;
  // The 128-byte swizzle: 16-byte chunk c of row r lands at chunk c ^ (r % 8).
  for (int i = t; i < kM * 8; i += 128) {
    const int r = i / 8, c = i % 8;
    *reinterpret_cast<uint4*>(sa + r * 128 + ((c ^ (r & 7)) * 16)) =
        *reinterpret_cast<const uint4*>(a + r * 128 + c * 16);
  }
  for (int i = t; i < kN * 8; i += 128) {
    const int r = i / 8, c = i % 8;
    *reinterpret_cast<uint4*>(sb + r * 128 + ((c ^ (r & 7)) * 16)) =
        *reinterpret_cast<const uint4*>(b + r * 128 + c * 16);
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int w = t / 32, l = t % 32;
  const int row0 = w * 16 + l / 4, col0 = 2 * (l % 4);
  const uint32_t da = megamoe::sm90::smem_desc_sw128_lo(sa), db = megamoe::sm90::smem_desc_sw128_lo(sb);
  for (int e = 0; e < kExperiments; ++e) {
    const int len = chain_len(e);
    const bool from_c = e >= 3;
    float d[4] = {0, 0, 0, 0};
    const float* c = C + size_t(trial) * kM * kN;
    if (from_c) {
      d[0] = c[row0 * kN + col0], d[1] = c[row0 * kN + col0 + 1];
      d[2] = c[(row0 + 8) * kN + col0], d[3] = c[(row0 + 8) * kN + col0 + 1];
    }
    megamoe::sm90::wgmma_fence();
    for (int s = 0; s < len; ++s)
      megamoe::sm90::Wgmma<8>::mma(d, megamoe::sm90::smem_desc_sw128_at(da + 2 * s),
                                   megamoe::sm90::smem_desc_sw128_at(db + 2 * s),
                                   (s == 0 && !from_c) ? 0 : 1);
    megamoe::sm90::wgmma_commit();
    megamoe::sm90::wgmma_wait<0>();
    float* out = D + (size_t(trial) * kExperiments + e) * kM * kN;
    out[row0 * kN + col0] = d[0], out[row0 * kN + col0 + 1] = d[1];
    out[(row0 + 8) * kN + col0] = d[2], out[(row0 + 8) * kN + col0 + 1] = d[3];
  }
}

// Every float x with -104 < x < 89: does the device's expf round as exp(double(x)) does?
// Mismatching inputs (up to `cap`) go to `bad` (the SwiGLU's other source of difference
// from the CPU reference, whose std::exp is glibc's).
__global__ void expf_census(unsigned long long* count, uint32_t* bad, unsigned cap) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < (uint64_t(1) << 32);
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float x = __uint_as_float(uint32_t(i));
    if (!(x > -104.0f && x < 89.0f)) continue;
    const float dev = expf(x), cr = float(exp(double(x)));
    if (__float_as_uint(dev) != __float_as_uint(cr)) {
      const unsigned long long k = atomicAdd(count, 1ull);
      if (k < cap) bad[k] = uint32_t(i);
    }
  }
}

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t err_ = (x);                                                                     \
    if (err_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  const int trials = argc > 1 ? std::atoi(argv[1]) : 512;
  const char* path = argc > 2 ? argv[2] : "wgmma_probe.bin";
  std::mt19937_64 rng(12345);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<uint8_t> A(size_t(trials) * kM * kK), B(size_t(trials) * kN * kK);
  std::vector<float> C(size_t(trials) * kM * kN);
  // Four input families by trial % 4: small exact values (checks the fragment layout),
  // Gaussian scaled to the E4M3 range (the quantized activations), any finite code,
  // Gaussian times 2^U(-8, 8) per element (wide exponent spread).
  auto code = [&](int fam) -> uint8_t {
    for (;;) {
      uint8_t q;
      if (fam == 0) {
        const float v[5] = {-1.0f, -0.5f, 0.0f, 0.5f, 1.0f};
        q = megamoe::num::e4m3_encode(v[byte(rng) % 5]);
      } else if (fam == 1) {
        q = megamoe::num::e4m3_encode(gauss(rng) * 112.0f);
      } else if (fam == 2) {
        q = uint8_t(byte(rng));
      } else {
        q = megamoe::num::e4m3_encode(gauss(rng) * std::ldexp(1.0f, int(byte(rng) % 17) - 8));
      }
      if ((q & 0x7F) != 0x7F) return q;
    }
  };
  for (int tr = 0; tr < trials; ++tr) {
    const int fam = tr % 4;
    for (int i = 0; i < kM * kK; ++i) A[size_t(tr) * kM * kK + i] = code(fam);
    for (int i = 0; i < kN * kK; ++i) B[size_t(tr) * kN * kK + i] = code(fam);
    // Accumulators: about the size of a 128-deep sum of the family, times 2^U(-6, 6).
    const float typ = fam == 0 ? 4.0f : fam == 1 ? 112.0f * 112.0f * 11.0f : fam == 2 ? 1e5f : 30.0f;
    for (int i = 0; i < kM * kN; ++i)
      C[size_t(tr) * kM * kN + i] = fam == 0 ? float(int(uni(rng) * 8)) * 0.25f
                                             : uni(rng) * typ * std::ldexp(1.0f, int(byte(rng) % 13) - 6);
  }
  uint8_t *dA, *dB;
  float *dC, *dD;
  CK(cudaMalloc(&dA, A.size()));
  CK(cudaMalloc(&dB, B.size()));
  CK(cudaMalloc(&dC, C.size() * 4));
  CK(cudaMalloc(&dD, size_t(trials) * kExperiments * kM * kN * 4));
  CK(cudaMemcpy(dA, A.data(), A.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dB, B.data(), B.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dC, C.data(), C.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dD, 0xFF, size_t(trials) * kExperiments * kM * kN * 4));  // poison (NaN)
  probe<<<trials, 128>>>(dA, dB, dC, dD);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<float> D(size_t(trials) * kExperiments * kM * kN);
  CK(cudaMemcpy(D.data(), dD, D.size() * 4, cudaMemcpyDeviceToHost));
  FILE* f = std::fopen(path, "wb");
  if (!f) return 1;
  const int hdr[5] = {trials, kM, kN, kK, kExperiments};
  std::fwrite(hdr, sizeof hdr, 1, f);
  std::fwrite(A.data(), 1, A.size(), f);
  std::fwrite(B.data(), 1, B.size(), f);
  std::fwrite(C.data(), 4, C.size(), f);
  std::fwrite(D.data(), 4, D.size(), f);
  std::fclose(f);
  std::printf("wrote %s: %d trials\n", path, trials);
  // expf census.
  constexpr unsigned kCap = 1u << 20;
  unsigned long long* dcount;
  uint32_t* dbad;
  CK(cudaMalloc(&dcount, 8));
  CK(cudaMalloc(&dbad, kCap * 4));
  CK(cudaMemset(dcount, 0, 8));
  expf_census<<<132 * 8, 256>>>(dcount, dbad, kCap);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  unsigned long long count = 0;
  CK(cudaMemcpy(&count, dcount, 8, cudaMemcpyDeviceToHost));
  std::vector<uint32_t> bad(count < kCap ? count : kCap);
  CK(cudaMemcpy(bad.data(), dbad, bad.size() * 4, cudaMemcpyDeviceToHost));
  std::printf("expf: %llu floats in (-104, 89) differ from exp(double) rounded\n", count);
  const std::string epath = std::string(path) + ".expf";
  FILE* g = std::fopen(epath.c_str(), "wb");
  if (!g) return 1;
  std::fwrite(bad.data(), 4, bad.size(), g);
  std::fclose(g);
  return 0;
}
