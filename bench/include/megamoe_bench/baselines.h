// The baselines `megamoe bench` measures in the same run as the fused kernel:
//   - the streaming-read ceiling of the device (the decode floor) and the
//     timing helpers every benchmark uses (L2 flush, device-event timing);
//   - a whole-layer MoE built from cuBLASLt block-scaled FP8 GEMMs, expert by
//     expert, with our own quantization, SwiGLU and combine kernels.
// Host API over raw device pointers; CUDA builds only (MEGAMOE_HAVE_CUDA). Part of the
// megamoe_bench target (bench/), the one place that links cuBLASLt.
//
// cuBLASLt block scaling on sm_90 (built with CUDA 13.0 / cuBLAS 13.1), as
// concluded from cublasLt.h, the cuBLAS docs (cublasLtMatmul, "Scaling factors
// layouts", grouped-GEMM requirements naming VEC128_32F / BLK128x128_32F for
// compute capability 9.0), the cuBLAS 12.9 release blog, and PyTorch's
// torch._scaled_mm and its tests, which drive the same modes. The modes, D types
// (f32, bf16) and scale layouts below were confirmed on an H200 by
// tests/gpu/test_baselines.cu (2026-12-02); the list of unsupported pairs was not tried.
//   - FP8 on Hopper is "TN" only: A transposed, B not. In cuBLAS' column-major
//     terms we compute D[m=out][n=rows] = W^T(op A) * X(B), so A is the weight
//     ([out][K] row-major = K x out column-major, lda = K) and B the activations
//     ([rows][K] row-major, ldb = K); D is then [rows][out] row-major.
//   - A_SCALE_MODE = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F (weights) and
//     B_SCALE_MODE = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F (activations) is one
//     of the three supported pairs (1D x 1D, 2D x 1D, 1D x 2D; 2D x 2D is not).
//     No fast accumulation with block scales. Compute CUBLAS_COMPUTE_32F.
//   - Scales multiply (real = fp8 * scale), like the checkpoint's scale_inv.
//   - BLK128x128 scale tensor: one float per 128x128 block, K-block index
//     contiguous, one row of roundup(ceil(K/128), 4) floats per 128 output rows,
//     i.e. the checkpoint's [ceil(out/128)][ceil(K/128)] order when ceil(K/128)
//     is a multiple of 4 (all presets); otherwise we keep a padded copy.
//   - VEC128 scale tensor: one float per row per 128 K elements, row index
//     contiguous ("outer-dim-major"): [ceil(K/128)][rows], rows a multiple of 4
//     (16-byte columns). We pad every expert's row count to a multiple of 4.
//   - The heuristic is told each matrix pointer's actual alignment (its default
//     assumes 256 bytes); scale pointers must be 16-byte aligned (checked).

#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "megamoe/model/shape.h"
#include "megamoe/numerics/fp8.h"
#include "megamoe/weights/layout.h"

namespace megamoe::bench {

// ---- ceilings and timing ----

// Streaming read of a freshly allocated device buffer of `bytes` (make it many
// times the L2: default 4 GiB), 16-byte loads, many in flight; median of
// `iters` timed passes after one warm-up. Returns bytes per second.
// flush_l2_each: flush before every pass as the benchmark cases do (for a buffer
// of a case's size, the read time under the same conditions as the case).
double measure_read_bandwidth(size_t bytes = size_t(4) << 30, int iters = 20, cudaStream_t stream = nullptr,
                              bool flush_l2_each = false);

// Writes a buffer of twice the current device's L2 so the next kernel starts
// cold. The buffer is allocated once per device and kept for the process.
// `others`: devices whose L2 is flushed too (expert-parallel ranks on their own GPUs),
// each on a stream of its own that `stream` then waits for.
void flush_l2(cudaStream_t stream, const std::vector<int>& others = {});

struct Timing {
  double median_us = 0, min_us = 0, max_us = 0, p10_us = 0, p90_us = 0;
};

// Runs fn(stream) `warmup` times untimed, then `iters` times each between two
// device events; with flush_l2_each the L2 is flushed before every timed call
// (outside the events; flush_l2's `others` too). Synchronizes the stream.
Timing time_device(const std::function<void(cudaStream_t)>& fn, cudaStream_t stream, int warmup, int iters,
                   bool flush_l2_each, const std::vector<int>& flush_others = {});

// Board energy of repeated calls: fn(stream) (after an L2 flush when flush_l2_each, as
// the timed cases run) replayed back to back for at least `seconds`, NVML's energy
// counter read before and after. The card runs at its power cap (700 W on the H200) at
// prefill and drew about as much at 64 tokens, so the clock and with it the time follow
// the energy a layer spends (docs/performance.md); the counter is updated
// coarsely, hence a loop of seconds rather than the timed iterations. The figures
// include the flushes.
struct EnergyRun {
  double mJ_per_call = 0;  // millijoules a call
  double watts = 0;        // mean board power over the loop
  int calls = 0;
};
// Throws when NVML (libnvidia-ml.so.1, opened at run time) cannot read the current
// device's energy counter: the figure is asked for, so it is not silently left out.
EnergyRun measure_energy(const std::function<void(cudaStream_t)>& fn, cudaStream_t stream, double seconds,
                         double call_us_estimate, bool flush_l2_each);

// ---- the two timing regimes ----

// sustained: graph replays back to back (each after an L2 flush when flush_l2_each) for
//   ramp_seconds untimed, then for sustained_seconds timed, as a busy server runs: the
//   card settles at its power cap and the SM clock where the cap puts it.
// burst: burst_calls single calls, each after the stream drained and the host slept
//   burst_gap_ms (then the flush), as peers' benchmarks time: the card starts every
//   call rested, near its boost clock.
enum class Regime { kSustained, kBurst };
const char* regime_name(Regime r);  // "sustained" | "burst"

struct RegimeOptions {
  double sustained_seconds = 1.0;
  double ramp_seconds = 0.2;
  int burst_calls = 15;
  double burst_gap_ms = 50;
  bool flush_l2_each = true;
  bool sample_nvml = true;  // the SM clock and board power (throws when NVML cannot read them)
};

struct RegimeTiming {
  Timing t;  // over every timed call
  int calls = 0;
  // Medians of NVML samples (-1 when not sampled). sustained: a host thread samples
  // every 25 ms during the timed window. burst: one sample right after each call is
  // enqueued (the clock the call starts at; the driver averages power over about a
  // second on Hopper, so a burst's power is mostly the idle gaps').
  double sm_clock_mhz = -1, power_w = -1;
  int samples = 0;
};

// Times fn(stream) in regime r (3 untimed calls first, which also size the batches the
// sustained loop enqueues; the host stays at most two batches of ~20 ms ahead).
// Synchronizes the stream.
RegimeTiming time_regime(const std::function<void(cudaStream_t)>& fn, cudaStream_t stream, Regime r,
                         const RegimeOptions& opt);

// Throws std::runtime_error when NVML (libnvidia-ml.so.1, opened at run time) cannot
// read the current device's SM clock and power: call before a run that records them.
void check_nvml_clock_and_power();

// ---- one block-scaled FP8 GEMM through cuBLASLt ----

enum class GemmOut { kF32, kBF16 };

// D[rows][out] = X[rows][k] * W[out][k]^T with per-block scales, row-major:
//   w        E4M3, row stride ldw bytes (>= k)
//   w_scale  F32 [ceil(out/128)][roundup(ceil(k/128), 4)]   (see the file comment)
//   x        E4M3, row stride ldx bytes (>= k)
//   x_scale  F32 [ceil(k/128)][rows]                         (row index contiguous)
//   d        F32 or BF16, row stride ldd elements (>= out)
// rows % 4 == 0, k % 128 == 0, out % 128 == 0 (our use; throws otherwise).
struct BlockScaledGemmArgs {
  int out = 0, rows = 0, k = 0;
  const uint8_t* w = nullptr;
  int ldw = 0;
  const float* w_scale = nullptr;
  const uint8_t* x = nullptr;
  int ldx = 0;
  const float* x_scale = nullptr;
  void* d = nullptr;
  int ldd = 0;
  GemmOut d_type = GemmOut::kBF16;
};

// Owns a cuBLASLt handle, a workspace and a cache of (shape -> layouts +
// algorithm): the heuristic is queried once per distinct (out, rows, k, ld*,
// d_type). Not thread-safe. Throws std::runtime_error naming the failing call.
class CublasLtBlockScaledGemm {
 public:
  explicit CublasLtBlockScaledGemm(size_t workspace_bytes = size_t(32) << 20);
  ~CublasLtBlockScaledGemm();
  CublasLtBlockScaledGemm(const CublasLtBlockScaledGemm&) = delete;
  CublasLtBlockScaledGemm& operator=(const CublasLtBlockScaledGemm&) = delete;

  void run(const BlockScaledGemmArgs& a, cudaStream_t stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---- the in-run dense yardstick ----

// A dense block-scaled FP8 GEMM pair of a layer's shapes on fresh random E4M3 data
// (no NaN codes) and positive scales: GEMM1 D1[m][2I] = X[m][H] W13[2I][H]^T, then GEMM2
// D2[m][H] = A[m][I] W2[H][I]^T, both through CublasLtBlockScaledGemm (VEC128
// activation, BLK128x128 weight scales, BF16 out), so one call does the FLOPs of m
// token rows through one expert: flops() = 2 m (2 I H + I H). The card's own
// block-scaled FP8 rate at the layer's K and N, for the compute floor.
class DenseFp8GemmPair {
 public:
  // m % 4 == 0, hidden % 128 == 0, inter % 128 == 0 (throws std::invalid_argument).
  DenseFp8GemmPair(int m, int hidden, int inter, uint64_t seed = 0x5EED);
  ~DenseFp8GemmPair();
  DenseFp8GemmPair(const DenseFp8GemmPair&) = delete;
  DenseFp8GemmPair& operator=(const DenseFp8GemmPair&) = delete;

  void run(cudaStream_t stream);  // capturable in a CUDA graph after one eager call
  double flops() const;
  int m() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---- the whole-layer cuBLASLt baseline ----

// One batch of routed tokens, rows grouped per expert ("groups": the E routed
// experts, then the shared expert as group E when the shape has one).
// Group g owns rows [offset[g], offset[g] + padded(g)), padded(g) =
// roundup(count[g], 4); its first count[g] rows are real, the rest are zero
// padding that no output reads. offset[g] is a multiple of 4.
// Device arrays (owned by the CublasLtMoeBaseline that made the batch):
//   xq          E4M3 [rows][H]: row r = the quantized token of that row
//   xs          F32: group g's scales at xs + offset[g] * ceil(H/128), laid out
//               [ceil(H/128)][padded(g)] (row index contiguous; cuBLASLt VEC128)
//   row_token   int32 [rows]: source token, -1 for padding rows
//   row_weight  F32 [rows]: routing weight (1.0 for the shared expert, 0 for padding)
//   slot_row    int32 [T][slots]: the row holding token t's slot k (K routed
//               slots, then the shared slot), -1 for a padding id
// Host: count/offset per group (read on the host when the batch is planned; a forward of a
// planned batch can be captured in a CUDA graph, as the bench times it).
struct DeviceRoutedBatch {
  int tokens = 0;  // T
  int rows = 0;    // total rows incl. padding
  uint8_t* xq = nullptr;
  float* xs = nullptr;
  const int32_t* row_token = nullptr;
  const float* row_weight = nullptr;
  const int32_t* slot_row = nullptr;
  std::vector<int> count, offset;
};

// The baseline of the issue: "cuBLASLt block-scaled FP8 GEMMs
// (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F activations,
// CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F weights) expert by expert plus our
// own routing and quantization". Numerics (docs/numerics.md §4, §7; the same function as
// the fused kernel, not bit-identical to it):
//   x -> E4M3 per 1x128 with num::act_scale; GEMM1 (block-scaled, fp32 or bf16
//   out per gemm1_out); a = num::swiglu(g, u, swiglu_limit, w_k) in fp32; a ->
//   E4M3 per 1x128 along I (cuBLASLt's VEC128 granularity, as the fused kernel's
//   num::kInterGroup); GEMM2 -> bf16 per slot; y = bf16(sum of the slots' bf16 in
//   ascending slot order, fp32).
// Requires H % 128 == 0 and I % 128 == 0 (throws std::invalid_argument).
class CublasLtMoeBaseline {
 public:
  // `w` points to device memory in the MoeWeightLayout of `shape`.
  CublasLtMoeBaseline(const MoeShape& shape, const MoeWeightsView& w, int max_tokens,
                      GemmOut gemm1_out = GemmOut::kF32);
  ~CublasLtMoeBaseline();
  CublasLtMoeBaseline(const CublasLtMoeBaseline&) = delete;
  CublasLtMoeBaseline& operator=(const CublasLtMoeBaseline&) = delete;

  // Host routing ids/weights [T][K] (-1 = padding) -> the batch's row maps,
  // copied to the device (synchronous on `stream`; not part of the timed layer).
  // The returned batch refers to this object's buffers and stays valid until
  // the next plan().
  const DeviceRoutedBatch& plan(const int32_t* ids, const float* weights, int T, cudaStream_t stream);

  // x: device bf16 [T][H] -> the batch's xq/xs (the activation quantization).
  void quantize(const DeviceRoutedBatch& b, const num::bf16_t* x, cudaStream_t stream);

  // The expert GEMMs, SwiGLU + requantization and the combine: y device bf16 [T][H].
  void run(const DeviceRoutedBatch& b, num::bf16_t* y, cudaStream_t stream);

  // The whole layer as benchmarked: quantize + run.
  void forward(const DeviceRoutedBatch& b, const num::bf16_t* x, num::bf16_t* y, cudaStream_t stream) {
    quantize(b, x, stream);
    run(b, y, stream);
  }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace megamoe::bench
