// Internal building blocks of the CPU reference, shared by the single-rank
// layer (moe.cpp) and the expert-parallel simulation (ep.cpp), so both run the
// same expert arithmetic and the EP result is byte-identical by construction.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "megamoe/model/shape.h"
#include "megamoe/numerics/fp8.h"
#include "megamoe/weights/layout.h"

namespace megamoe::ref::detail {

// One expert MLP's weights (a routed expert or the shared one).
struct ExpertWeights {
  const uint8_t* w13 = nullptr;      // [2*inter][H]
  const float* w13_scale = nullptr;  // [2*ceil(inter/128)][ceil(H/128)]
  const uint8_t* w2 = nullptr;       // [H][inter]
  const float* w2_scale = nullptr;   // [ceil(H/128)][ceil(inter/128)]
  int inter = 0;
};
ExpertWeights routed_expert(const MoeShape& s, const MoeWeightsView& w, int e);
ExpertWeights shared_expert(const MoeShape& s, const MoeWeightsView& w);

// E4M3 codes split for the tensor-core model (num::fp8_mma_step): per code the signed
// significand (hidden bit included) and the exponent field, zero codes at kSplitZeroExp
// and NaN codes at kSplitNanExp, so one max over exponent sums finds a step's largest
// product and any NaN.
constexpr int kSplitZeroExp = -100;
constexpr int kSplitNanExp = 120;
struct SplitRow {
  const int8_t* sig = nullptr;
  const int8_t* exp = nullptr;
};
struct SplitCodes {
  std::vector<int8_t> sig, exp;
  int cols = 0;
  SplitCodes() = default;
  SplitCodes(const uint8_t* q, size_t rows, int cols);
  SplitRow row(size_t r) const { return {sig.data() + r * cols, exp.data() + r * cols}; }
};

// The block dot products both GEMMs are built from, as the kernel's tensor cores
// compute them: part[j*nb + b] = the chain of wgmma k-steps (num::fp8_mma_chain) over
// the columns of block b (`blk` wide, a multiple of num::kMmaStepK; the last block
// may be partial; nb = ceil(n/blk)) of the codes w[c] times a[j][c], for j < m.
void dot_e4m3_mma_blocks(const uint8_t* w, int n, int blk, const SplitRow* a, int m, float* part);
// The portable path alone (the one above picks an AVX2 build where the CPU has it);
// tests check both against num::fp8_mma_chain.
void dot_e4m3_mma_blocks_portable(const uint8_t* w, int n, int blk, const SplitRow* a, int m, float* part);

// x -> E4M3 per token per 128 columns (docs/numerics.md §4): codes q [T][H] and scales
// s [T][ceil(H/128)].
void quantize_acts(const num::bf16_t* x, int T, int H, uint8_t* q, float* s);

// The rows one expert processes in kernel-faithful mode. Row j reads the
// activation codes xq.row(rows[j]) with scales s[rows[j]][:], is weighted by
// weight[j] (1.0 for the shared expert) and writes H bf16 values to out[j].
struct FaithfulTask {
  ExpertWeights w;
  const SplitCodes* xq = nullptr;
  const float* s = nullptr;
  std::vector<int32_t> rows;
  std::vector<float> weight;
  std::vector<num::bf16_t*> out;
};
// Runs every task (GEMM1 + SwiGLU + requantization, then GEMM2) on `threads`
// threads. Each output element is computed by one thread in a fixed order, so
// the bytes do not depend on the thread count.
void run_faithful(const MoeShape& s, std::vector<FaithfulTask>& tasks, int threads);

// The ordered reduction (docs/numerics.md §7): y[t][h] = bf16(sum in float over the slots
// 0..S-1 with valid[t*S + k] set, each term the bf16 slot value); y as float.
void combine_faithful(const num::bf16_t* slots, const uint8_t* valid, int T, int S, int H, float* y);

int resolve_threads(int requested);

// Runs f(i) for i in [0, n) on up to `threads` threads (the caller is one of
// them); items are claimed from an atomic counter.
template <class F>
void parallel_for(int n, int threads, F&& f) {
  threads = std::min(threads, n);
  if (threads <= 1) {
    for (int i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<int> next{0};
  auto worker = [&] {
    for (int i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(i);
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

}  // namespace megamoe::ref::detail
