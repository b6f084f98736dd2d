// kloop_probe: the prefill K loop (tokens in M, 128 tokens x 128 weight rows x
// 128-deep stages, two consumer warpgroups) taken out of the fused kernel, to
// measure what a stage costs in cycles with and without the scale fold, with two or
// three consumer warpgroups, with and without the ring's mbarriers and loads, and with
// the stage handed back before or after the fold, and (v24) in clusters of two or four
// CTAs whose stages are filled by TMA multicast, and (v49) a wide stage whose 128 token
// rows are gathered, one TMA box of one row each, as a GEMM1 reading one quantized copy of
// each token (in place of phase 0's slot copies) would load them. Timing only: the bytes
// are random, the sums unchecked; but first a check that one-row boxes land in the
// 128-byte swizzle exactly as one 8-row box does. The variant list reproduces the K-loop tables of
// docs/performance-history.md (prefill tiles; the raw logs are in git history, 91dccce).
//
// Build (here or on the device machine):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Isrc/kernels \
//        bench/probes/kloop_probe.cu -o kloop_probe
// Run: ./kloop_probe [stages per CTA, default 4000] [a substring of the variants to run]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "sm90_ptx.cuh"

namespace sm90 = megamoe::sm90;

#define CK(x)                                                                         \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

// kNW consumer warpgroups in the block (2: the kernel's; 3: a 192-token tile at 152
// registers a consumer thread), each 64 token rows of the stage.
// kWide (v25): 256 weight rows a stage (two 128-row output blocks against one 128-token
// tile), 48 KB, four stages.
template <int kNW, bool kWide = false>
struct Geo {
  static constexpr int kStages = kWide ? 4 : kNW == 3 ? 5 : 6;
  static constexpr int kWBytes = (kWide ? 256 : 128) * 128, kXBytes = 64 * kNW * 128, kSBytes = 64 * kNW * 4;
  // 1024-byte aligned (the 128-byte swizzle's TMA destination); kNW = 2: 33792, as the kernel's
  static constexpr int kStageBytes = (kWBytes + kXBytes + kSBytes + 1023) / 1024 * 1024;
  static constexpr int kSmem = kStages * kStageBytes + 2 * kStages * 8 + 1024;
  static constexpr int kConsumerRegs = kNW == 3 ? 152 : 224;
};

// Fold arrangements.
enum Fold : int {
  kNone = 0,        // chain + wait only
  kAfterWait = 1,   // the kernel's: chain, wait 0, 64 FFMA (the release placed by kRel)
  kTwoBuffers = 2,  // two stages an iteration: chain k+1 runs during fold k
  kWide = 3,        // a 256-row weight stage: chain, wait, fold for rows 0-127, then 128-255 (one buffer)
  kG2 = 4,          // the kernel's GEMM2: two 64-deep chains (ba, bb) a stage, a fold each
  kWide2 = 5,       // GEMM2 on a 256-row stage: four 64-deep chain, wait, fold steps (one buffer)
  kWide1n64 = 6,    // GEMM1 on a 256-row stage in 64-row chains, two 32-float buffers: one chain
                    // runs while the previous one is folded
  kWide2n64 = 7,    // the same for GEMM2 (eight 64 x 64 x 64 chains a stage)
};

// The folds whose stage holds 256 weight rows (Geo's kWide).
__host__ __device__ constexpr bool wide_fold(int f) { return f == kWide || f == kWide2 || f == kWide1n64 || f == kWide2n64; }

// What fills a stage.
enum Loads : int {
  kNoBars = 0,    // nothing: the consumers cycle over the ring without mbarriers
  kArrive = 1,    // the ring's mbarriers, a producer that only arrives (no bytes)
  kBulk = 2,      // two bulk copies (weights, tokens) from an L2-resident buffer
  kTma = 3,       // TMA boxes of 128-byte rows with the kernel's geometry
  kTma64 = 4,     // the same with 64 token rows a stage (24 KB: a two-CTA multicast's L2 reads)
  kTmaW = 5,      // the weights' 16 KB only (the token rows stay): 16 KB from L2 into shared memory
  kSts = 6,       // the producer warpgroup stores 32 KB with st.shared (shared-memory bytes, no L2)
  kMc = 7,        // kCl = 2: the v23 pair (tokens multicast, 24 KB from L2); kCl = 4: a 2 x 2 cluster
                  // (weight halves and token halves multicast, 16 KB from L2); 32 KB into each CTA
  kMcW = 8,       // kCl = 2, the weights shared instead: weight half `rank` to both, own 128 token rows
  kGather = 9,    // wide stages: the weights by one box, the 128 token rows by 128 one-row boxes (random
                  // rows, the same for a tile's 64 K blocks), issued by the producer warp's 32 lanes
  kGather1 = 10,  // the same boxes, all issued by the producer thread alone (as the kernel's producer is)
};

// One poll of an mbarrier phase (test_wait: no suspension), for the backing-off producer.
__device__ __forceinline__ bool mbar_test(uint64_t* bar, uint32_t parity) {
  uint32_t r;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(r)
      : "r"(sm90::smem_u32(bar)), "r"(parity)
      : "memory");
  return r != 0;
}

// kRel: 0 = a stage handed back before its fold (the kernel's), 1 = after its fold,
// 2 = before, with the next stage's full-barrier wait also before the fold, 3 = after,
// with the next stage's wait before the fold.
// kX: 0 = as described; 1 = the producer backs off (nanosleep) between empty-barrier polls;
// 2 = the consumers skip the full-barrier wait (kArrive only: what the wait costs);
// 3 = the release without __syncwarp; 4 = the consumers poll the next stage's full barrier
// (test_wait, no suspension) before the fold and skip its wait when it had completed;
// 5 = the producer polls its empty barrier with test_wait (no suspension) instead of try_wait.
template <int kFold, int kWgs, int kBars, int kNW, int kRel, int kCl,
          int kX = 0>  // kBars: Loads; kCl: cluster size
__global__ void __launch_bounds__(128 * (kNW + 1), 1)
    kloop(const uint8_t* __restrict__ src, size_t src_bytes, const float* __restrict__ wscale, int nstages,
          long long* cycles, float* sink, const __grid_constant__ CUtensorMap wmap,
          const __grid_constant__ CUtensorMap xmap, int wrows, int xrows) {
  using G = Geo<kNW, wide_fold(kFold)>;
  constexpr int kStages = G::kStages, kWBytes = G::kWBytes, kXBytes = G::kXBytes,
                kStageBytes = G::kStageBytes;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const int tid = threadIdx.x;
  // Random E4M3 bytes without NaN (exponent below 15), random scales near 1.
  for (int i = tid; i < kStages * kStageBytes / 4; i += blockDim.x) {
    uint32_t h = (i * 2654435761u) ^ (blockIdx.x * 40503u);
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    reinterpret_cast<uint32_t*>(smem)[i] = h & 0xB7B7B7B7u;
  }
  for (int s = 0; s < kStages; ++s)
    for (int i = tid; i < 64 * kNW; i += blockDim.x)
      reinterpret_cast<float*>(smem + s * kStageBytes + kWBytes + kXBytes)[i] = 1.0f + i * 1e-3f;
  // A cluster CTA's stage is written by itself and by the peers it writes to (pair: the
  // other CTA; 2 x 2: the CTA of its token pair and the one of its weight pair), so its
  // empty barrier counts their consumer warps as well, and each consumer warp releases
  // the stage to all of them.
  const uint32_t rank = kCl > 1 ? sm90::cluster_ctarank() : 0;
  const uint32_t ob = rank & 1, tb = rank >> 1;
  constexpr int kWriters = kCl == 4 ? 3 : kCl;
  if (tid == 0)
    for (int s = 0; s < kStages; ++s)
      sm90::mbar_init(&full[s], 1), sm90::mbar_init(&empty[s], 4 * kWgs * kWriters);
  sm90::mbar_init_fence();
  sm90::fence_proxy_async_shared();  // the generic stores above, read by wgmma
  __syncthreads();
  if (kCl > 1) sm90::cluster_arrive(), sm90::cluster_wait();
  const int wg = tid / 128 - 1;
  if (wg < 0) {  // producer warpgroup
    sm90::setmaxnreg_dec<56>();
    if (kBars == kSts) {  // all 128 threads store the stage, thread 0 arrives
      for (int k = 0; k < nstages; ++k) {
        const int s = k % kStages;
        if (k >= kStages) sm90::mbar_wait(&empty[s], ((k / kStages) - 1) & 1);
        uint4* d = reinterpret_cast<uint4*>(smem + s * kStageBytes);
        const uint32_t v = 0x31313131u + (k & 7);
#pragma unroll
        for (int i = 0; i < (kWBytes + kXBytes) / 16 / 128; ++i) d[i * 128 + tid] = make_uint4(v, v, v, v);
        sm90::fence_proxy_async_shared();
        sm90::named_barrier(1, 128);
        if (tid == 0) sm90::mbar_arrive(&full[s]);
      }
      return;
    }
    if (kBars == kNoBars || tid >= (kBars == kGather ? 32 : 1)) return;  // (kGather1: thread 0)
    const size_t span = src_bytes / 65536;
    size_t blk = blockIdx.x * 7 % span;
    for (int k = 0; k < nstages; ++k) {
      const int s = k % kStages;
      if (k >= kStages) {
        if (kX == 1)
          while (!mbar_test(&empty[s], ((k / kStages) - 1) & 1)) __nanosleep(32);
        else if (kX == 5)
          while (!mbar_test(&empty[s], ((k / kStages) - 1) & 1)) {
          }
        else
          sm90::mbar_wait(&empty[s], ((k / kStages) - 1) & 1);
      }
      if (kBars == kArrive) {
        sm90::mbar_arrive(&full[s]);
      } else if (kBars == kGather || kBars == kGather1) {  // xmap: one-row boxes
        const int kc = (k % 64) * 128;
        uint8_t* st = smem + s * kStageBytes;
        if (tid == 0) {
          sm90::mbar_arrive_expect_tx(&full[s], kWBytes + kXBytes);
          const int wr = int((blockIdx.x * 37 + k / 64) * (kWBytes / 128) % wrows);
          sm90::tma_load_2d(st, &wmap, &full[s], kc, wr);
        }
        if (kBars == kGather) __syncwarp();  // (the expected bytes are set before any row can land)
        constexpr int kIssuers = kBars == kGather ? 32 : 1;
#pragma unroll 4
        for (int i = 0; i < kXBytes / 128 / kIssuers; ++i) {
          const int r = i * kIssuers + tid;
          uint32_t h = uint32_t(blockIdx.x * 131 + k / 64) * 2654435761u ^ uint32_t(r) * 40503u;
          h ^= h >> 15, h *= 0x2c1b3c6du, h ^= h >> 12;
          sm90::tma_load_2d(st + kWBytes + r * 128, &xmap, &full[s], kc, int(h % uint32_t(xrows)));
        }
      } else if (kBars == kTmaW) {
        sm90::mbar_arrive_expect_tx(&full[s], kWBytes);
        const int wr = int((blockIdx.x * 37 + k / 64) * 128 % wrows);
        sm90::tma_load_2d(smem + s * kStageBytes, &wmap, &full[s], (k % 64) * 128, wr);
      } else if (kBars == kMcW) {  // wmap's box 64 rows, xmap's 128
        sm90::mbar_arrive_expect_tx(&full[s], kWBytes + kXBytes);
        const int kc = (k % 64) * 128;
        const int cl = blockIdx.x / 2;
        uint8_t* st = smem + s * kStageBytes;
        const int wr = int((cl * 37 + k / 64) * 128 % wrows);
        const int xr = int((blockIdx.x * 11 + k / 64) * 128 % xrows);
        sm90::tma_load_2d_multicast(st + rank * 64 * 128, &wmap, &full[s], kc, wr + rank * 64, 3);
        sm90::tma_load_2d(st + kWBytes, &xmap, &full[s], kc, xr);
      } else if (kBars == kMc) {
        // wmap's box is 128 rows (pair) or 64 (2 x 2), xmap's 64 rows.
        sm90::mbar_arrive_expect_tx(&full[s], kWBytes + kXBytes);
        const int kc = (k % 64) * 128;
        const int cl = blockIdx.x / kCl;
        uint8_t* st = smem + s * kStageBytes;
        if (kCl == 2) {  // own weights; token half `rank` to both
          const int wr = int((blockIdx.x * 37 + k / 64) * 128 % wrows);
          const int xr = int((cl * 11 + k / 64) * 128 % xrows);
          sm90::tma_load_2d(st, &wmap, &full[s], kc, wr);
          sm90::tma_load_2d_multicast(st + kWBytes + rank * 64 * 128, &xmap, &full[s], kc, xr + rank * 64, 3);
        } else {  // weight half tb to the CTAs of output block ob; token half ob to those of token block tb
          const int wr = int(((cl * 2 + ob) * 37 + k / 64) * 128 % wrows);
          const int xr = int(((cl * 2 + tb) * 11 + k / 64) * 128 % xrows);
          sm90::tma_load_2d_multicast(st + tb * 64 * 128, &wmap, &full[s], kc, wr + tb * 64,
                                      uint16_t((1u << ob) | (4u << ob)));
          sm90::tma_load_2d_multicast(st + kWBytes + ob * 64 * 128, &xmap, &full[s], kc, xr + ob * 64,
                                      uint16_t(3u << (2 * tb)));
        }
      } else if (kBars == kTma || kBars == kTma64) {
        const int xb = kBars == kTma64 ? 64 * 128 : kXBytes;
        sm90::mbar_arrive_expect_tx(&full[s], kWBytes + xb);
        const int kc = (k % 64) * 128;
        const int wr = int((blockIdx.x * 37 + k / 64) * (kWBytes / 128) % wrows);
        const int xr = int((blockIdx.x * 11 + k / 64) * 64 * kNW % xrows);
        sm90::tma_load_2d(smem + s * kStageBytes, &wmap, &full[s], kc, wr);
        sm90::tma_load_2d(smem + s * kStageBytes + kWBytes, &xmap, &full[s], kc, xr);
      } else {  // 32 KB of weights and tokens from an L2-resident buffer, two bulk copies
        sm90::mbar_arrive_expect_tx(&full[s], kWBytes + kXBytes);
        sm90::bulk_load(smem + s * kStageBytes, src + blk * 65536, kWBytes, &full[s]);
        sm90::bulk_load(smem + s * kStageBytes + kWBytes, src + blk * 65536 + kWBytes, kXBytes, &full[s]);
        blk = blk + 1 == span ? 0 : blk + 1;
      }
    }
    return;
  }
  sm90::setmaxnreg_inc<G::kConsumerRegs>();
  if (wg >= kWgs) return;
  const int lane = tid % 32, warp = (tid / 32) % 4;
  const int lrow = warp * 16 + lane / 4;
  const int r0 = wg * 64 + lrow, r1 = r0 + 8;
  float acc[64], acc2[64], ba[64], bb[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f, acc2[i] = 0.f;
  const uint32_t dx0 = sm90::smem_desc_sw128_lo(smem + kWBytes + wg * 64 * 128);
  const uint32_t dw0 = sm90::smem_desc_sw128_lo(smem);
  // wo: the weight rows' offset (>> 4) in the stage (kWide: rows 128-255 at 16 KB).
  auto chain = [&](float(&buf)[64], int s, uint32_t wo = 0) {
    const uint32_t so = uint32_t(s) * (kStageBytes >> 4);
    sm90::wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k)
      sm90::Wgmma<128>::mma(buf, sm90::smem_desc_sw128_at(dx0 + so + 2 * k),
                            sm90::smem_desc_sw128_at(dw0 + wo + so + 2 * k), k);
    sm90::wgmma_commit();
  };
  // A 64-deep half chain (GEMM2: the activation scale changes every 64 columns).
  auto half_chain = [&](float(&buf)[64], int s, int h, uint32_t wo = 0) {
    const uint32_t so = uint32_t(s) * (kStageBytes >> 4);
    sm90::wgmma_fence();
#pragma unroll
    for (int k = 0; k < 2; ++k)
      sm90::Wgmma<128>::mma(buf, sm90::smem_desc_sw128_at(dx0 + so + 2 * (2 * h + k)),
                            sm90::smem_desc_sw128_at(dw0 + wo + so + 2 * (2 * h + k)), k);
    sm90::wgmma_commit();
  };
  auto products = [&](int s, int kb, float& g0, float& u0, float& g1, float& u1) {
    const float* ss = reinterpret_cast<const float*>(smem + s * kStageBytes + kWBytes + kXBytes);
    const float sg = __ldg(wscale + (kb & 63)), su = __ldg(wscale + 64 + (kb & 63));
    const float x0 = ss[r0], x1 = ss[r1];
    g0 = x0 * sg, u0 = x0 * su, g1 = x1 * sg, u1 = x1 * su;
  };
  auto fold_into = [&](float(&a)[64], const float(&buf)[64], float g0, float u0, float g1, float u1) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float q0 = (j % 2 == 0) ? g0 : u0, q1 = (j % 2 == 0) ? g1 : u1;
      a[j * 4 + 0] = fmaf(buf[j * 4 + 0], q0, a[j * 4 + 0]);
      a[j * 4 + 1] = fmaf(buf[j * 4 + 1], q0, a[j * 4 + 1]);
      a[j * 4 + 2] = fmaf(buf[j * 4 + 2], q1, a[j * 4 + 2]);
      a[j * 4 + 3] = fmaf(buf[j * 4 + 3], q1, a[j * 4 + 3]);
    }
  };
  auto fold = [&](const float(&buf)[64], float g0, float u0, float g1, float u1) {
    fold_into(acc, buf, g0, u0, g1, u1);
  };
  auto wait_full = [&](int k) {
    if (kBars && kX != 2) sm90::mbar_wait(&full[k % kStages], (k / kStages) & 1);
  };
  // The peers this CTA's consumers release to (kCl = 2: the other; 4: rank ^ 1, rank ^ 2).
  const uint32_t peer_a = sm90::mapa_shared(sm90::smem_u32(empty), rank ^ 1);
  const uint32_t peer_b = sm90::mapa_shared(sm90::smem_u32(empty), rank ^ 2);
  auto release = [&](int k) {
    if (kBars) {
      if (kX != 3) __syncwarp();
      if (lane == 0) {
        sm90::mbar_arrive(&empty[k % kStages]);
        if (kCl > 1) sm90::mbar_arrive_cluster(peer_a + (k % kStages) * 8);
        if (kCl > 2) sm90::mbar_arrive_cluster(peer_b + (k % kStages) * 8);
      }
    }
  };
  __syncwarp();
  const long long t0 = clock64();
  if (kFold == kTwoBuffers) {
    // Two stages an iteration, nothing in flight across the back-edge (ptxas serializes
    // the chains otherwise, C7514): stage 1's chain runs during stage 0's fold.
    float g0, u0, g1, u1;
    for (int k = 0; k < nstages; k += 2) {
      wait_full(k);
      wait_full(k + 1);
      chain(ba, k % kStages);
      chain(bb, (k + 1) % kStages);
      products(k % kStages, k, g0, u0, g1, u1);
      sm90::wgmma_wait<1>();
      fold(ba, g0, u0, g1, u1);
      if (kRel & 1) release(k);
      products((k + 1) % kStages, k + 1, g0, u0, g1, u1);
      sm90::wgmma_wait<0>();
      if (!(kRel & 1)) release(k), release(k + 1);
      fold(bb, g0, u0, g1, u1);
      if (kRel & 1) release(k + 1);
    }
  } else if (kFold == kG2) {
    for (int k = 0; k < nstages; ++k) {
      const int s = k % kStages;
      wait_full(k);
      half_chain(ba, s, 0);
      half_chain(bb, s, 1);
      float g0, u0, g1, u1;
      products(s, k, g0, u0, g1, u1);
      sm90::wgmma_wait<1>();
      fold(ba, g0, g0, g1, g1);
      sm90::wgmma_wait<0>();
      if (!(kRel & 1)) release(k);
      fold(bb, u0, u0, u1, u1);
      if (kRel & 1) release(k);
    }
  } else if (kFold == kWide2) {
    for (int k = 0; k < nstages; ++k) {
      const int s = k % kStages;
      wait_full(k);
      float g0, u0, g1, u1;
      half_chain(ba, s, 0);
      products(s, k, g0, u0, g1, u1);
      sm90::wgmma_wait<0>();
      fold(ba, g0, g0, g1, g1);
      half_chain(ba, s, 1);
      sm90::wgmma_wait<0>();
      fold(ba, u0, u0, u1, u1);
      half_chain(ba, s, 0, (128 * 128) >> 4);
      sm90::wgmma_wait<0>();
      fold_into(acc2, ba, g0, g0, g1, g1);
      half_chain(ba, s, 1, (128 * 128) >> 4);
      sm90::wgmma_wait<0>();
      if (!(kRel & 1)) release(k);
      fold_into(acc2, ba, u0, u0, u1, u1);
      if (kRel & 1) release(k);
    }
  } else if (kFold == kWide1n64 || kFold == kWide2n64) {
    // Chain c of a stage: block b, weight-row half r (and GEMM2: K half h), into buffer c % 2.
    float bx[32], by[32];
    constexpr int kChains = kFold == kWide1n64 ? 4 : 8;
    auto chain64 = [&](float(&buf)[32], int s, int c) {
      const int b = kFold == kWide1n64 ? c / 2 : c / 4, r = kFold == kWide1n64 ? c % 2 : (c / 2) % 2;
      const int h = kFold == kWide1n64 ? 0 : c % 2, steps = kFold == kWide1n64 ? 4 : 2;
      const uint32_t so = uint32_t(s) * (kStageBytes >> 4), wo = uint32_t(b * 128 + r * 64) * 128 / 16;
      sm90::wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (k < steps)
          sm90::Wgmma<64>::mma(buf, sm90::smem_desc_sw128_at(dx0 + so + 2 * (2 * h + k)),
                               sm90::smem_desc_sw128_at(dw0 + wo + so + 2 * (2 * h + k)), k);
      sm90::wgmma_commit();
    };
    auto fold64 = [&](const float(&buf)[32], int c, float g0, float u0, float g1, float u1) {
      const int b = kFold == kWide1n64 ? c / 2 : c / 4, r = kFold == kWide1n64 ? c % 2 : (c / 2) % 2;
      const int h = kFold == kWide1n64 ? 0 : c % 2;
      const float q0a = kFold == kWide1n64 ? g0 : (h ? u0 : g0), q1a = kFold == kWide1n64 ? g1 : (h ? u1 : g1);
      const float q0b = kFold == kWide1n64 ? u0 : q0a, q1b = kFold == kWide1n64 ? u1 : q1a;
      float(&a)[64] = b ? acc2 : acc;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float q0 = (j % 2 == 0) ? q0a : q0b, q1 = (j % 2 == 0) ? q1a : q1b;
        a[r * 32 + j * 4 + 0] = fmaf(buf[j * 4 + 0], q0, a[r * 32 + j * 4 + 0]);
        a[r * 32 + j * 4 + 1] = fmaf(buf[j * 4 + 1], q0, a[r * 32 + j * 4 + 1]);
        a[r * 32 + j * 4 + 2] = fmaf(buf[j * 4 + 2], q1, a[r * 32 + j * 4 + 2]);
        a[r * 32 + j * 4 + 3] = fmaf(buf[j * 4 + 3], q1, a[r * 32 + j * 4 + 3]);
      }
    };
    for (int k = 0; k < nstages; ++k) {
      const int s = k % kStages;
      wait_full(k);
      float g0, u0, g1, u1;
      chain64(bx, s, 0);
      chain64(by, s, 1);
      products(s, k, g0, u0, g1, u1);
#pragma unroll
      for (int c = 0; c < kChains; ++c) {
        if (c + 1 < kChains)
          sm90::wgmma_wait<1>();
        else
          sm90::wgmma_wait<0>();
        if (c + 1 == kChains) release(k);
        if (c % 2 == 0) {
          fold64(bx, c, g0, u0, g1, u1);
          if (c + 2 < kChains) chain64(bx, s, c + 2);
        } else {
          fold64(by, c, g0, u0, g1, u1);
          if (c + 2 < kChains) chain64(by, s, c + 2);
        }
      }
    }
  } else if (kFold == kWide) {
    // One wait and one release a stage for two 128 x 128 x 128 units; the other
    // warpgroup's chains run during this one's folds.
    for (int k = 0; k < nstages; ++k) {
      const int s = k % kStages;
      wait_full(k);
      chain(ba, s);
      float g0, u0, g1, u1;
      products(s, k, g0, u0, g1, u1);
      sm90::wgmma_wait<0>();
      fold(ba, g0, u0, g1, u1);
      chain(ba, s, (128 * 128) >> 4);
      sm90::wgmma_wait<0>();
      if (!(kRel & 1)) release(k);
      fold_into(acc2, ba, u0, g0, u1, g1);
      if (kRel & 1) release(k);
    }
  } else {
    if (kRel >= 2) wait_full(0);
    bool next_full = false;  // kX = 4: the next stage's barrier had completed at the poll
    for (int k = 0; k < nstages; ++k) {
      const int s = k % kStages;
      if (kRel < 2 && !(kX == 4 && next_full)) wait_full(k);
      chain(ba, s);
      float g0, u0, g1, u1;
      products(s, k, g0, u0, g1, u1);
      sm90::wgmma_wait<0>();
      if (!(kRel & 1)) release(k);
      if (kX == 4)
        next_full = k + 1 < nstages && mbar_test(&full[(k + 1) % kStages], ((k + 1) / kStages) & 1);
      if (kRel >= 2 && k + 1 < nstages) wait_full(k + 1);
      if (kFold == kAfterWait) fold(ba, g0, u0, g1, u1);
      if (kRel & 1) release(k);
      if (kFold == kNone) acc[0] += ba[0];  // keeps ba live: one value a stage
    }
  }
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) s += acc[i] + acc2[i];
  if (s == 12345.f) sink[tid] = s;  // keeps the sums live
  if (tid % 128 == 0) cycles[blockIdx.x * 4 + wg] = t1 - t0;
  // No CTA leaves while a peer may still arrive on its barriers (exited producer
  // threads count as arrived).
  if (kCl > 1) sm90::cluster_arrive(), sm90::cluster_wait();
}

// One-row boxes against one 8-row box of the same rows r0..r0+7 (columns 0..127): the
// gathered stage is right only if the 128-byte swizzle follows the shared-memory address,
// so that row r's box at offset r * 128 lands as row r of a full box. bad[0]: bytes where
// the two differ; bad[1]: bytes where the 8-row box differs from the swizzle computed here
// (chunk j of row r at chunk j ^ (r % 8)) from the rows' pattern.
__global__ void gather_layout_check(const __grid_constant__ CUtensorMap rows1,
                                    const __grid_constant__ CUtensorMap rows8, int r0, int* bad) {
  __shared__ __align__(1024) uint8_t a[1024];
  __shared__ __align__(1024) uint8_t b[1024];
  __shared__ uint64_t bar;
  const int lane = threadIdx.x;
  if (lane == 0) sm90::mbar_init(&bar, 1);
  sm90::mbar_init_fence();
  __syncwarp();
  if (lane == 0) {
    sm90::mbar_arrive_expect_tx(&bar, 2048);
    sm90::tma_load_2d(a, &rows8, &bar, 0, r0);
  }
  __syncwarp();
  if (lane < 8) sm90::tma_load_2d(b + lane * 128, &rows1, &bar, 0, r0 + lane);
  sm90::mbar_wait(&bar, 0);
  int n0 = 0, n1 = 0;
  for (int i = lane; i < 1024; i += 32) {
    const int r = i / 128, chunk = (i % 128) / 16, j = i % 16;
    const int c = ((chunk ^ (r % 8)) * 16) + j;  // the source column that lands at byte i
    n0 += a[i] != b[i];
    n1 += a[i] != uint8_t(((r0 + r) * 131 + c * 7) & 0x77);
  }
  for (int o = 16; o > 0; o >>= 1) n0 += __shfl_xor_sync(~0u, n0, o), n1 += __shfl_xor_sync(~0u, n1, o);
  if (lane == 0) bad[0] = n0, bad[1] = n1;
}

struct Variant2 {
  const char* name;
  void (*fn)(const uint8_t*, size_t, const float*, int, long long*, float*, CUtensorMap, CUtensorMap, int,
             int);
  int wgs, nw, bars;
  bool hbm;
  int cl;
  bool wide;  // kWide: two 128 x 128 x 128 units a stage
};

template <int F, int W, int B, int NW = 2, int R = 0, int CL = 1, int X = 0>
Variant2 make(const char* name, bool hbm = false) {
  return {name, kloop<F, W, B, NW, R, CL, X>, W, NW, B, hbm, CL, wide_fold(F)};
}

int main(int argc, char** argv) {
  const int nstages = argc > 1 ? std::atoi(argv[1]) : 4000;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t src_bytes = size_t(16) << 20;  // L2-resident source of the loads
  uint8_t* src;
  float *wscale, *sink;
  long long* cycles;
  CK(cudaMalloc(&src, src_bytes));
  CK(cudaMemset(src, 0x31, src_bytes));
  CK(cudaMalloc(&wscale, 128 * 4));
  std::vector<float> hs(128);
  for (int i = 0; i < 128; ++i) hs[i] = 0.5f + i * 1e-3f;
  CK(cudaMemcpy(wscale, hs.data(), 512, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&sink, 4096));
  CK(cudaMalloc(&cycles, sms * 4 * sizeof(long long)));
  const Variant2 vs[] = {
      make<kNone, 2, kNoBars>("no fold, no bars"),
      make<kAfterWait, 2, kNoBars>("fold, no bars"),
      make<kNone, 2, kArrive>("no fold, bars"),
      make<kAfterWait, 2, kArrive, 2, 0>("fold, bars, rel before"),
      make<kAfterWait, 2, kArrive, 2, 1>("fold, bars, rel after"),
      make<kAfterWait, 2, kArrive, 2, 2>("fold, bars, rel before, wait early"),
      make<kAfterWait, 2, kArrive, 2, 3>("fold, bars, rel after, wait early"),
      make<kTwoBuffers, 2, kArrive, 2, 0>("pairs, bars, rel before"),
      make<kTwoBuffers, 2, kArrive, 2, 1>("pairs, bars, rel after"),
      make<kNone, 2, kTma>("no fold, TMA 32K L2"),
      make<kAfterWait, 2, kTma, 2, 0>("fold, TMA 32K L2, rel before"),
      make<kAfterWait, 2, kTma, 2, 1>("fold, TMA 32K L2, rel after"),
      make<kAfterWait, 2, kTma, 2, 3>("fold, TMA 32K L2, rel after, wait early"),
      make<kTwoBuffers, 2, kTma, 2, 1>("pairs, TMA 32K L2, rel after"),
      make<kNone, 2, kTma64>("no fold, TMA 24K L2"),
      make<kAfterWait, 2, kTma64, 2, 0>("fold, TMA 24K L2, rel before"),
      make<kAfterWait, 2, kTma64, 2, 1>("fold, TMA 24K L2, rel after"),
      make<kAfterWait, 2, kTma64, 2, 3>("fold, TMA 24K L2, rel after, wait early"),
      make<kNone, 2, kTma>("no fold, TMA 32K w HBM", true),
      make<kAfterWait, 2, kTma, 2, 0>("fold, TMA 32K w HBM, rel before", true),
      make<kAfterWait, 2, kTma, 2, 1>("fold, TMA 32K w HBM, rel after", true),
      make<kNone, 2, kBulk>("no fold, bulk 32K"),
      make<kAfterWait, 2, kBulk>("fold, bulk 32K, rel before"),
      make<kNone, 3, kNoBars, 3>("3 WG no fold, no bars"),
      make<kAfterWait, 3, kNoBars, 3>("3 WG fold, no bars"),
      make<kAfterWait, 3, kArrive, 3, 0>("3 WG fold, bars, rel before"),
      make<kAfterWait, 3, kArrive, 3, 1>("3 WG fold, bars, rel after"),
      make<kNone, 3, kTma, 3>("3 WG no fold, TMA 40K L2"),
      make<kAfterWait, 3, kTma, 3, 0>("3 WG fold, TMA 40K L2, rel before"),
      make<kAfterWait, 3, kTma, 3, 1>("3 WG fold, TMA 40K L2, rel after"),
      make<kAfterWait, 3, kTma, 3, 0>("3 WG fold, TMA 40K w HBM, rel before", true),
      make<kNone, 2, kTmaW>("no fold, TMA 16K (w only) L2"),
      make<kAfterWait, 2, kTmaW, 2, 1>("fold, TMA 16K (w only) L2, rel after"),
      make<kNone, 2, kSts>("no fold, st.shared 32K"),
      make<kAfterWait, 2, kSts, 2, 1>("fold, st.shared 32K, rel after"),
      make<kNone, 2, kMc, 2, 0, 2>("no fold, pair mc (24K L2)"),
      make<kAfterWait, 2, kMc, 2, 0, 2>("fold, pair mc, rel before"),
      make<kAfterWait, 2, kMc, 2, 1, 2>("fold, pair mc, rel after"),
      make<kAfterWait, 2, kMc, 2, 1, 2>("fold, pair mc, w HBM, rel after", true),
      make<kNone, 2, kMc, 2, 0, 4>("no fold, 2x2 mc (16K L2)"),
      make<kAfterWait, 2, kMc, 2, 0, 4>("fold, 2x2 mc, rel before"),
      make<kAfterWait, 2, kMc, 2, 1, 4>("fold, 2x2 mc, rel after"),
      make<kAfterWait, 2, kMc, 2, 1, 4>("fold, 2x2 mc, w HBM, rel after", true),
      make<kNone, 2, kMcW, 2, 0, 2>("no fold, w-pair mc (24K L2)"),
      make<kAfterWait, 2, kMcW, 2, 0, 2>("fold, w-pair mc, rel before"),
      make<kAfterWait, 2, kMcW, 2, 1, 2>("fold, w-pair mc, rel after"),
      make<kAfterWait, 2, kMcW, 2, 0, 2>("fold, w-pair mc, w HBM, rel before", true),
      make<kAfterWait, 2, kMcW, 2, 1, 2>("fold, w-pair mc, w HBM, rel after", true),
      make<kAfterWait, 2, kMc, 2, 0, 2>("fold, pair mc, w HBM, rel before", true),
      make<kAfterWait, 2, kArrive, 2, 0, 1, 1>("fold, bars, rel before, prod sleeps"),
      make<kAfterWait, 2, kArrive, 2, 1, 1, 1>("fold, bars, rel after, prod sleeps"),
      make<kAfterWait, 2, kArrive, 2, 0, 1, 2>("fold, bars, rel before, no full wait"),
      make<kAfterWait, 2, kArrive, 2, 1, 1, 2>("fold, bars, rel after, no full wait"),
      make<kAfterWait, 2, kArrive, 2, 0, 1, 3>("fold, bars, rel before, no syncwarp"),
      make<kAfterWait, 2, kMc, 2, 0, 2, 1>("fold, pair mc, rel before, prod sleeps"),
      make<kAfterWait, 2, kMc, 2, 1, 2, 1>("fold, pair mc, rel after, prod sleeps"),
      // v25: the next stage's barrier polled before the fold; a spinning producer; wide stages.
      make<kAfterWait, 2, kArrive, 2, 0, 1, 4>("fold, bars, rel before, poll next"),
      make<kAfterWait, 2, kArrive, 2, 1, 1, 4>("fold, bars, rel after, poll next"),
      make<kAfterWait, 2, kTma64, 2, 0, 1, 4>("fold, TMA 24K L2, rel before, poll next"),
      make<kAfterWait, 2, kMc, 2, 0, 2, 4>("fold, pair mc, rel before, poll next"),
      make<kAfterWait, 2, kMcW, 2, 0, 2, 4>("fold, w-pair mc, w HBM, rel before, poll next", true),
      make<kAfterWait, 2, kArrive, 2, 0, 1, 5>("fold, bars, rel before, prod spins"),
      make<kAfterWait, 2, kMc, 2, 0, 2, 5>("fold, pair mc, rel before, prod spins"),
      make<kWide, 2, kNoBars>("wide, no bars (per unit)"),
      make<kWide, 2, kArrive, 2, 0>("wide, bars, rel before (per unit)"),
      make<kWide, 2, kArrive, 2, 1>("wide, bars, rel after (per unit)"),
      make<kWide, 2, kTma, 2, 0>("wide, TMA 48K L2, rel before (per unit)"),
      make<kWide, 2, kTma, 2, 1>("wide, TMA 48K L2, rel after (per unit)"),
      make<kWide, 2, kTma, 2, 0>("wide, TMA 48K w HBM, rel before (per unit)", true),
      make<kWide, 2, kTma, 2, 1>("wide, TMA 48K w HBM, rel after (per unit)", true),
      make<kG2, 2, kArrive, 2, 0>("GEMM2, bars, rel before"),
      make<kG2, 2, kTma64, 2, 0>("GEMM2, TMA 24K L2, rel before"),
      make<kWide2, 2, kArrive, 2, 0>("wide GEMM2, bars, rel before (per unit)"),
      make<kWide2, 2, kTma, 2, 0>("wide GEMM2, TMA 48K L2, rel before (per unit)"),
      make<kWide1n64, 2, kNoBars>("wide n64 x2, no bars (per unit)"),
      make<kWide1n64, 2, kArrive, 2, 0>("wide n64 x2, bars (per unit)"),
      make<kWide1n64, 2, kTma, 2, 0>("wide n64 x2, TMA 48K L2 (per unit)"),
      make<kWide2n64, 2, kArrive, 2, 0>("wide GEMM2 n64 x2, bars (per unit)"),
      make<kWide2n64, 2, kTma, 2, 0>("wide GEMM2 n64 x2, TMA 48K L2 (per unit)"),
      // v49: token rows gathered by one-row boxes (L2: from 2048 rows; HBM: weights and rows
      // from the 1 GB buffer's 131072 rows), against the same stages loaded by two boxes above.
      make<kWide, 2, kGather, 2, 0>("wide, gather 128 rows L2, rel before (per unit)"),
      make<kWide, 2, kGather, 2, 0>("wide, gather 128 rows HBM, rel before (per unit)", true),
      make<kWide2, 2, kGather, 2, 0>("wide GEMM2, gather 128 rows L2, rel before (per unit)"),
      make<kWide2, 2, kGather, 2, 0>("wide GEMM2, gather 128 rows HBM, rel before (per unit)", true),
      make<kWide, 2, kGather1, 2, 0>("wide, gather 128 rows L2 by 1 thread, rel before (per unit)"),
      make<kWide, 2, kGather1, 2, 0>("wide, gather 128 rows HBM by 1 thread, rel before (per unit)", true),
  };
  // Tensor maps with the kernel's box geometry (128-byte rows, 128-byte swizzle): an
  // L2-resident 16 MB [2048][8192] and an HBM-sized 1 GB [131072][8192] source.
  using EncodeFn =
      CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                   const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  void* ep = nullptr;
  cudaDriverEntryPointQueryResult q{};
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ep, 12000, cudaEnableDefault, &q));
  auto encode = reinterpret_cast<EncodeFn>(ep);
  uint8_t* big;
  const size_t big_bytes = size_t(1) << 30;
  CK(cudaMalloc(&big, big_bytes));
  CK(cudaMemset(big, 0x32, big_bytes));
  auto make_map = [&](void* base, uint64_t rows, uint32_t box_rows, CUtensorMapL2promotion promo) {
    CUtensorMap m{};
    cuuint64_t d[2] = {8192, rows}, st[1] = {8192};
    cuuint32_t b[2] = {128, box_rows}, es[2] = {1, 1};
    if (encode(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base, d, st, b, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, promo, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      std::fprintf(stderr, "encode failed\n");
      std::exit(1);
    }
    return m;
  };
  const CUtensorMap w_l2 = make_map(src, 2048, 128, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  const CUtensorMap w_hbm = make_map(big, 131072, 128, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  const CUtensorMap x2 = make_map(src, 2048, 128, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  const CUtensorMap x3 = make_map(src, 2048, 192, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  const CUtensorMap x64 = make_map(src, 2048, 64, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  const CUtensorMap w_l2_64 = make_map(src, 2048, 64, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  const CUtensorMap w_hbm_64 = make_map(big, 131072, 64, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  const CUtensorMap w_l2_256 = make_map(src, 2048, 256, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  const CUtensorMap w_hbm_256 = make_map(big, 131072, 256, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  const CUtensorMap x1 = make_map(src, 2048, 1, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  const CUtensorMap x1_hbm = make_map(big, 131072, 1, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  const CUtensorMap x8 = make_map(src, 2048, 8, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  {  // rows 0..15 of src carry a pattern for the layout check (the timing ignores the bytes)
    std::vector<uint8_t> pat(16 * 8192);
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < 8192; ++c) pat[size_t(r) * 8192 + c] = uint8_t((r * 131 + c * 7) & 0x77);
    CK(cudaMemcpy(src, pat.data(), pat.size(), cudaMemcpyHostToDevice));
    int* bad;
    CK(cudaMalloc(&bad, 2 * sizeof(int)));
    for (int r0 : {0, 5}) {
      int h[2] = {-1, -1};
      gather_layout_check<<<1, 32>>>(x1, x8, r0, bad);
      CK(cudaGetLastError());
      CK(cudaMemcpy(h, bad, sizeof(h), cudaMemcpyDeviceToHost));
      std::printf(
          "one-row boxes from row %d: %d of 1024 bytes differ from one 8-row box; the 8-row box "
          "differs from the address-based 128-byte swizzle in %d\n",
          r0, h[0], h[1]);
    }
    CK(cudaFree(bad));
  }
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::printf(
      "%d stages a CTA, %d CTAs; cycles a stage (median / max over CTAs), ms, TFLOP/s of the CTA tiles\n",
      nstages, sms);
  const char* only = argc > 2 ? argv[2] : nullptr;
  for (int round = 0; round < 2; ++round)
    for (const Variant2& v : vs) {
      if (only && !std::strstr(v.name, only)) continue;
      const int smem = v.wide      ? Geo<2, true>::kSmem
                       : v.nw == 3 ? Geo<3>::kSmem
                                   : Geo<2>::kSmem,
                threads = 128 * (v.nw + 1), units = v.wide ? 2 : 1;
      CK(cudaFuncSetAttribute(v.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const bool w64 = (v.bars == kMc && v.cl == 4) || v.bars == kMcW;
      const CUtensorMap& wm = v.wide  ? (v.hbm ? w_hbm_256 : w_l2_256)
                              : v.hbm ? (w64 ? w_hbm_64 : w_hbm)
                                      : (w64 ? w_l2_64 : w_l2);
      const bool gather = v.bars == kGather || v.bars == kGather1;
      const CUtensorMap& xm = gather                              ? (v.hbm ? x1_hbm : x1)
                              : v.bars == kTma64 || v.bars == kMc ? x64
                              : v.nw == 3                         ? x3
                                                                  : x2;  // kMcW: x2
      const int wrows = v.hbm ? 131072 : 2048, xrows = gather && v.hbm ? 131072 : 2048;
      // A cluster launch runs as many CTAs as the clusters that fit at once.
      cudaLaunchConfig_t cfg{};
      cudaLaunchAttribute at[1];
      at[0].id = cudaLaunchAttributeClusterDimension;
      at[0].val.clusterDim.x = v.cl, at[0].val.clusterDim.y = 1, at[0].val.clusterDim.z = 1;
      cfg.blockDim = dim3(threads), cfg.dynamicSmemBytes = smem, cfg.attrs = at,
      cfg.numAttrs = v.cl > 1 ? 1 : 0;
      int grid = sms;
      if (v.cl > 1) {
        CK(cudaFuncSetAttribute(v.fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        cfg.gridDim = dim3(sms / v.cl * v.cl);
        int clusters = 0;
        CK(cudaOccupancyMaxActiveClusters(&clusters, v.fn, &cfg));
        grid = std::min(sms / v.cl, clusters) * v.cl;
        if (round == 0)
          std::printf("  (cluster of %d: %d clusters at once, %d CTAs)\n", v.cl, clusters, grid);
      }
      cfg.gridDim = dim3(grid);
      CK(cudaLaunchKernelEx(&cfg, v.fn, (const uint8_t*)src, src_bytes, (const float*)wscale, nstages / 10,
                            cycles, sink, wm, xm, wrows, xrows));  // warm-up
      CK(cudaGetLastError());
      CK(cudaEventRecord(e0));
      CK(cudaLaunchKernelEx(&cfg, v.fn, (const uint8_t*)src, src_bytes, (const float*)wscale, nstages, cycles,
                            sink, wm, xm, wrows, xrows));
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      std::vector<long long> c(sms * 4);
      CK(cudaMemcpy(c.data(), cycles, c.size() * 8, cudaMemcpyDeviceToHost));
      std::vector<double> per;
      for (int i = 0; i < grid; ++i) per.push_back(double(c[i * 4]) / nstages / units);
      std::sort(per.begin(), per.end());
      const double flop = 2.0 * 64 * 128 * 128 * double(nstages) * grid * v.wgs * units;
      std::printf("%-34s %7.1f / %7.1f cyc  %8.3f ms  %7.1f TFLOP/s  (clock %.2f GHz)\n", v.name,
                  per[grid / 2], per.back(), ms, flop / ms / 1e9, per[grid / 2] * units * nstages / ms / 1e6);
    }
  return 0;
}
