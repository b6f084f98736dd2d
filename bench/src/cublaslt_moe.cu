// The cuBLASLt whole-layer MoE baseline (bench/include/megamoe_bench/baselines.h):
// block-scaled FP8 GEMMs expert by expert through cuBLASLt, with our own
// activation quantization, SwiGLU + requantization and combine kernels.
// The layout conclusions about cuBLASLt's scale tensors are in the header.
#include <cublasLt.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "../../src/kernels/cuda_check.h"
#include "megamoe/numerics/act_quant.h"
#include "megamoe/numerics/fp8.h"
#include "megamoe_bench/baselines.h"

namespace megamoe::bench {

namespace {

// A failed cuBLASLt call throws std::runtime_error naming the call, the status and the place.
[[noreturn]] void throw_cublas(const char* call, cublasStatus_t s, const char* file, int line) {
  throw std::runtime_error(std::string(call) + " failed: cublasStatus " + std::to_string(int(s)) + " (" +
                           cublasLtGetStatusName(s) + ": " + cublasLtGetStatusString(s) + ") at " + file +
                           ":" + std::to_string(line));
}

#define MEGAMOE_CUBLAS_CHECK(call)                                                                  \
  do {                                                                                              \
    const cublasStatus_t megamoe_st_ = (call);                                                      \
    if (megamoe_st_ != CUBLAS_STATUS_SUCCESS) throw_cublas(#call, megamoe_st_, __FILE__, __LINE__); \
  } while (0)

constexpr int kBlk = 128;  // cuBLASLt VEC128 / BLK128x128 granularity

int round_up(int a, int b) { return (a + b - 1) / b * b; }

// Largest power of two (<= 256) dividing the address: what the heuristic may assume.
uint32_t pointer_alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && (a % al) != 0) al >>= 1;
  return al;
}

std::string gemm_text(const BlockScaledGemmArgs& a) {
  return "block-scaled FP8 GEMM out=" + std::to_string(a.out) + " rows=" + std::to_string(a.rows) +
         " k=" + std::to_string(a.k) + " ldw=" + std::to_string(a.ldw) + " ldx=" + std::to_string(a.ldx) +
         " ldd=" + std::to_string(a.ldd) + (a.d_type == GemmOut::kF32 ? " D=f32" : " D=bf16") +
         " (A: BLK128x128_32F weights, B: VEC128_32F activations)";
}

}  // namespace

// ---------------------------------------------------------------------------
// One block-scaled GEMM
// ---------------------------------------------------------------------------

struct CublasLtBlockScaledGemm::Impl {
  using Key = std::tuple<int, int, int, int, int, int, int, uint32_t, uint32_t, uint32_t>;
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };

  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  std::map<Key, Plan> plans;

  ~Impl() {
    for (auto& [k, p] : plans) destroy(p);
    if (workspace) cudaFree(workspace);
    if (handle) cublasLtDestroy(handle);
  }

  static void destroy(Plan& p) {
    if (p.d) cublasLtMatrixLayoutDestroy(p.d);
    if (p.b) cublasLtMatrixLayoutDestroy(p.b);
    if (p.a) cublasLtMatrixLayoutDestroy(p.a);
    if (p.desc) cublasLtMatmulDescDestroy(p.desc);
  }

  Plan& plan_for(const BlockScaledGemmArgs& g, uint32_t al_w, uint32_t al_x, uint32_t al_d) {
    const Key key{g.out, g.rows, g.k, g.ldw, g.ldx, g.ldd, int(g.d_type), al_w, al_x, al_d};
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;

    Plan p;
    cublasLtMatmulPreference_t pref = nullptr;
    try {
      // Column-major view (see the header): D[out x rows] = op(A)[out x k] * B[k x rows],
      // A = W stored k x out (transposed: FP8 on Hopper is TN only), B = X stored k x rows.
      MEGAMOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      MEGAMOE_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
      MEGAMOE_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
      const int32_t mode_a = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
      const int32_t mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      MEGAMOE_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
      MEGAMOE_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
      set_scales(p, g);

      const cudaDataType_t dt = g.d_type == GemmOut::kF32 ? CUDA_R_32F : CUDA_R_16BF;
      MEGAMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_8F_E4M3, g.k, g.out, g.ldw));
      MEGAMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_8F_E4M3, g.k, g.rows, g.ldx));
      MEGAMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, dt, g.out, g.rows, g.ldd));

      MEGAMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
      MEGAMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes)));
      // Tell the heuristic the alignments we actually have, so any algorithm it returns is valid.
      MEGAMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_w, sizeof(al_w)));
      MEGAMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_x, sizeof(al_x)));
      MEGAMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof(al_d)));
      MEGAMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d)));
      cublasLtMatmulHeuristicResult_t res{};
      int found = 0;
      const cublasStatus_t st =
          cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.d, p.d, pref, 1, &res, &found);
      if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
        throw std::runtime_error("cublasLtMatmulAlgoGetHeuristic: no algorithm for " + gemm_text(g) +
                                 " (status " + std::to_string(int(st)) + " " + cublasLtGetStatusName(st) +
                                 ")");
      }
      p.algo = res.algo;
      MEGAMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
      pref = nullptr;
    } catch (...) {
      if (pref) cublasLtMatmulPreferenceDestroy(pref);
      destroy(p);
      throw;
    }
    return plans.emplace(key, p).first->second;
  }

  static void set_scales(Plan& p, const BlockScaledGemmArgs& g) {
    const void* sa = g.w_scale;
    const void* sb = g.x_scale;
    MEGAMOE_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
    MEGAMOE_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  }
};

CublasLtBlockScaledGemm::CublasLtBlockScaledGemm(size_t workspace_bytes) : impl_(std::make_unique<Impl>()) {
  MEGAMOE_CUBLAS_CHECK(cublasLtCreate(&impl_->handle));
  impl_->workspace_bytes = workspace_bytes;
  if (workspace_bytes) MEGAMOE_CUDA_CHECK(cudaMalloc(&impl_->workspace, workspace_bytes));
}

CublasLtBlockScaledGemm::~CublasLtBlockScaledGemm() = default;

void CublasLtBlockScaledGemm::run(const BlockScaledGemmArgs& g, cudaStream_t stream) {
  if (g.rows <= 0 || g.rows % 4 != 0 || g.k <= 0 || g.k % kBlk != 0 || g.out <= 0 || g.out % kBlk != 0 ||
      g.ldw < g.k || g.ldx < g.k || g.ldd < g.out) {
    throw std::invalid_argument("CublasLtBlockScaledGemm: unsupported " + gemm_text(g) +
                                " (need rows % 4 == 0, k % 128 == 0, out % 128 == 0, ld >= extent)");
  }
  if (!g.w || !g.x || !g.d || !g.w_scale || !g.x_scale) {
    throw std::invalid_argument("CublasLtBlockScaledGemm: null pointer in " + gemm_text(g));
  }
  // NOTE: 16-byte scale tensors (the VEC128 columns are 4 floats of 16 bytes).
  if (pointer_alignment(g.w_scale) < 16 || pointer_alignment(g.x_scale) < 16) {
    throw std::invalid_argument("CublasLtBlockScaledGemm: scale pointers must be 16-byte aligned in " +
                                gemm_text(g));
  }
  const uint32_t al_w = pointer_alignment(g.w), al_x = pointer_alignment(g.x), al_d = pointer_alignment(g.d);
  Impl::Plan& p = impl_->plan_for(g, al_w, al_x, al_d);
  Impl::set_scales(p, g);
  const float alpha = 1.0f, beta = 0.0f;
  MEGAMOE_CUBLAS_CHECK(cublasLtMatmul(impl_->handle, p.desc, &alpha, g.w, p.a, g.x, p.b, &beta, g.d, p.d, g.d,
                                      p.d, &p.algo, impl_->workspace, impl_->workspace_bytes, stream));
}

// ---------------------------------------------------------------------------
// Kernels of the layer
// ---------------------------------------------------------------------------

namespace {

constexpr int kRowThreads = 256;  // 8 warps per row; a warp quantizes one 128-wide group at a time

struct GroupInfo {
  int offset;  // first row of the group
  int padded;  // rows, a multiple of 4
};

// x (bf16 [T][H]) -> the batch's E4M3 rows and VEC128 scales, one block per
// row. Lane l of a warp holds columns 4l..4l+3 of a 128-wide group, so the
// group's amax is one warp reduction and stores are 4-byte packed.
__global__ void __launch_bounds__(kRowThreads)
    baseline_quantize_rows(const num::bf16_t* __restrict__ x, int H, const int32_t* __restrict__ row_token,
                           const int32_t* __restrict__ row_group, const GroupInfo* __restrict__ groups,
                           uint8_t* __restrict__ xq, float* __restrict__ xs) {
  const int r = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = row_token[r];
  const GroupInfo gi = groups[row_group[r]];
  const int kb_count = H / kBlk;
  float* scale_base = xs + size_t(gi.offset) * kb_count + (r - gi.offset);
  for (int kb = warp; kb < kb_count; kb += kRowThreads / 32) {
    const int c = kb * kBlk + lane * 4;
    float v[4] = {0, 0, 0, 0};
    if (t >= 0) {
      const uint2 raw = *reinterpret_cast<const uint2*>(x + size_t(t) * H + c);
      v[0] = num::bf16_decode(num::bf16_t(raw.x & 0xFFFFu));
      v[1] = num::bf16_decode(num::bf16_t(raw.x >> 16));
      v[2] = num::bf16_decode(num::bf16_t(raw.y & 0xFFFFu));
      v[3] = num::bf16_decode(num::bf16_t(raw.y >> 16));
    }
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    // Padding rows get zero data and a zero scale: their products are exact zeros.
    const float s = t >= 0 ? num::act_scale(amax) : 0.0f;
    const float inv = t >= 0 ? 1.0f / s : 0.0f;
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) packed |= uint32_t(num::act_quant(v[i], inv)) << (8 * i);
    *reinterpret_cast<uint32_t*>(xq + size_t(r) * H + c) = packed;
    if (lane == 0) scale_base[size_t(kb) * gi.padded] = s;
  }
}

template <typename T>
__device__ __forceinline__ float load_acc(const T* p);
template <>
__device__ __forceinline__ float load_acc<float>(const float* p) {
  return *p;
}
template <>
__device__ __forceinline__ float load_acc<num::bf16_t>(const num::bf16_t* p) {
  return num::bf16_decode(*p);
}

// GEMM1 output [rows][ld1] (gate cols [0, I_g), up cols [I_g, 2 I_g)) ->
// a = swiglu(g, u) * w_row -> E4M3 [rows][ld_a] + VEC128 scales per group
// chunk [I_g/128][padded]. I_g = inter for routed groups, shared_inter for the
// shared group (index `shared_group`).
template <typename Acc>
__global__ void __launch_bounds__(kRowThreads)
    baseline_swiglu_quant(const Acc* __restrict__ h1, int ld1, int inter, int shared_inter, int shared_group,
                          float limit, const float* __restrict__ row_weight,
                          const int32_t* __restrict__ row_group, const GroupInfo* __restrict__ groups,
                          int ld_a, int ib_stride, uint8_t* __restrict__ aq, float* __restrict__ as) {
  const int r = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = row_group[r];
  const GroupInfo gi = groups[g];
  const int I = g == shared_group ? shared_inter : inter;
  const float w = row_weight[r];
  const Acc* row = h1 + size_t(r) * ld1;
  float* scale_base = as + size_t(gi.offset) * ib_stride + (r - gi.offset);
  for (int kb = warp; kb < I / kBlk; kb += kRowThreads / 32) {
    const int c = kb * kBlk + lane * 4;
    float a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      a[i] = num::swiglu(load_acc(row + c + i), load_acc(row + I + c + i), limit, w);
    float amax = fmaxf(fmaxf(fabsf(a[0]), fabsf(a[1])), fmaxf(fabsf(a[2]), fabsf(a[3])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float s = num::act_scale(amax);
    const float inv = 1.0f / s;
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) packed |= uint32_t(num::act_quant(a[i], inv)) << (8 * i);
    *reinterpret_cast<uint32_t*>(aq + size_t(r) * ld_a + c) = packed;
    if (lane == 0) scale_base[size_t(kb) * gi.padded] = s;
  }
}

// y[t] = bf16(sum over slots, ascending, in fp32 of the slots' bf16 outputs).
// One thread per 8 columns of one token.
__global__ void baseline_combine(const num::bf16_t* __restrict__ out, const int32_t* __restrict__ slot_row,
                                 int T, int H, int slots, num::bf16_t* __restrict__ y) {
  const int chunks = H / 8;
  const size_t idx = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= size_t(T) * chunks) return;
  const int t = int(idx / chunks), c = int(idx % chunks) * 8;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k = 0; k < slots; ++k) {
    const int r = slot_row[size_t(t) * slots + k];
    if (r < 0) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(out + size_t(r) * H + c);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[2 * i] += num::bf16_decode(num::bf16_t(w[i] & 0xFFFFu));
      acc[2 * i + 1] += num::bf16_decode(num::bf16_t(w[i] >> 16));
    }
  }
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    o[i] = uint32_t(num::bf16_encode(acc[2 * i])) | (uint32_t(num::bf16_encode(acc[2 * i + 1])) << 16);
  *reinterpret_cast<uint4*>(y + size_t(t) * H + c) = make_uint4(o[0], o[1], o[2], o[3]);
}

// A device allocation that frees itself.
template <typename T>
struct DeviceArray {
  T* p = nullptr;
  size_t n = 0;
  DeviceArray() = default;
  explicit DeviceArray(size_t count) : n(count) {
    if (count) MEGAMOE_CUDA_CHECK(cudaMalloc(&p, count * sizeof(T)));
  }
  ~DeviceArray() {
    if (p) cudaFree(p);
  }
  DeviceArray(DeviceArray&& o) noexcept : p(o.p), n(o.n) { o.p = nullptr, o.n = 0; }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(p, o.p);
    std::swap(n, o.n);
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

// A [rows][cols] float grid copied to rows of roundup(cols, 4) floats, zero padded
// (cuBLASLt's BLK128x128 row pitch), or nullptr-empty when no padding is needed.
DeviceArray<float> pad_scale_grid(const float* src, size_t rows, int cols) {
  const int padded = round_up(cols, 4);
  if (padded == cols) return {};
  DeviceArray<float> d(rows * padded);
  MEGAMOE_CUDA_CHECK(cudaMemset(d.p, 0, rows * padded * sizeof(float)));
  MEGAMOE_CUDA_CHECK(cudaMemcpy2D(d.p, padded * sizeof(float), src, cols * sizeof(float),
                                  cols * sizeof(float), rows, cudaMemcpyDeviceToDevice));
  return d;
}

}  // namespace

// ---------------------------------------------------------------------------
// The layer
// ---------------------------------------------------------------------------

struct CublasLtMoeBaseline::Impl {
  MoeShape s;
  MoeWeightsView w;
  int max_tokens = 0;
  GemmOut gemm1_out = GemmOut::kF32;
  CublasLtBlockScaledGemm gemm;

  int H = 0, I = 0, Is = 0, E = 0, K = 0, slots = 0, groups = 0;
  int kb_h = 0;    // H / 128
  int i_max = 0;   // max(I, Is): row pitch of the requantized intermediate
  int ib_max = 0;  // i_max / 128
  int ld1 = 0;     // 2 * i_max: row pitch of GEMM1's output
  size_t rows_cap = 0;

  // Weight scales with cuBLASLt's row pitch, when the checkpoint's is not a multiple of 4.
  DeviceArray<float> w13s_pad, w2s_pad, sw13s_pad, sw2s_pad;
  const float *w13s = nullptr, *w2s = nullptr, *sw13s = nullptr, *sw2s = nullptr;

  DeviceArray<uint8_t> xq, aq;
  DeviceArray<float> xs, as;
  DeviceArray<uint8_t> h1;  // f32 or bf16 [rows][ld1]
  DeviceArray<num::bf16_t> out;
  DeviceArray<int32_t> row_token, row_group, slot_row;
  DeviceArray<float> row_weight;
  DeviceArray<GroupInfo> group_info;

  std::vector<int32_t> h_row_token, h_row_group, h_slot_row;
  std::vector<float> h_row_weight;
  std::vector<GroupInfo> h_groups;
  DeviceRoutedBatch batch;

  Impl(const MoeShape& shape, const MoeWeightsView& view, int max_t, GemmOut g1)
      : s(shape), w(view), max_tokens(max_t), gemm1_out(g1) {
    s.validate();
    H = s.hidden, I = s.inter, Is = s.shared_inter(), E = s.experts, K = s.topk, slots = s.slots();
    if (H % kBlk != 0 || I % kBlk != 0) {
      throw std::invalid_argument("CublasLtMoeBaseline: needs hidden % 128 == 0 and inter % 128 == 0, got " +
                                  s.describe());
    }
    if (max_tokens < 1) throw std::invalid_argument("CublasLtMoeBaseline: max_tokens >= 1");
    if (!w.w13 || !w.w13_scale || !w.w2 || !w.w2_scale ||
        (s.has_shared() && (!w.shared_w13 || !w.shared_w2))) {
      throw std::invalid_argument("CublasLtMoeBaseline: missing weight pointers");
    }
    groups = E + (s.has_shared() ? 1 : 0);
    kb_h = H / kBlk;
    i_max = std::max(I, Is);
    ib_max = i_max / kBlk;
    ld1 = 2 * i_max;
    // Every group pads to a multiple of 4 rows: at most 3 extra rows per group.
    rows_cap = size_t(max_tokens) * K + (s.has_shared() ? size_t(max_tokens) : 0) + 3 * size_t(groups) + 4;

    const int kb_i = I / kBlk, kb_is = Is / kBlk;
    w13s_pad = pad_scale_grid(w.w13_scale, size_t(E) * (2 * I / kBlk), kb_h);
    w2s_pad = pad_scale_grid(w.w2_scale, size_t(E) * kb_h, kb_i);
    w13s = w13s_pad.p ? w13s_pad.p : w.w13_scale;
    w2s = w2s_pad.p ? w2s_pad.p : w.w2_scale;
    if (s.has_shared()) {
      sw13s_pad = pad_scale_grid(w.shared_w13_scale, size_t(2 * Is / kBlk), kb_h);
      sw2s_pad = pad_scale_grid(w.shared_w2_scale, size_t(kb_h), kb_is);
      sw13s = sw13s_pad.p ? sw13s_pad.p : w.shared_w13_scale;
      sw2s = sw2s_pad.p ? sw2s_pad.p : w.shared_w2_scale;
    }

    xq = DeviceArray<uint8_t>(rows_cap * H);
    xs = DeviceArray<float>(rows_cap * kb_h);
    const size_t acc_bytes = gemm1_out == GemmOut::kF32 ? sizeof(float) : sizeof(num::bf16_t);
    h1 = DeviceArray<uint8_t>(rows_cap * ld1 * acc_bytes);
    aq = DeviceArray<uint8_t>(rows_cap * i_max);
    as = DeviceArray<float>(rows_cap * ib_max);
    out = DeviceArray<num::bf16_t>(rows_cap * H);
    row_token = DeviceArray<int32_t>(rows_cap);
    row_group = DeviceArray<int32_t>(rows_cap);
    row_weight = DeviceArray<float>(rows_cap);
    slot_row = DeviceArray<int32_t>(size_t(max_tokens) * slots);
    group_info = DeviceArray<GroupInfo>(groups);
    // Rows past a batch's end are never read; zero them once so nothing reads garbage by accident.
    MEGAMOE_CUDA_CHECK(cudaMemset(xq.p, 0, xq.n));
    MEGAMOE_CUDA_CHECK(cudaMemset(xs.p, 0, xs.n * sizeof(float)));
  }

  const DeviceRoutedBatch& plan(const int32_t* ids, const float* weights, int T, cudaStream_t stream) {
    if (T < 0 || T > max_tokens) {
      throw std::invalid_argument("CublasLtMoeBaseline::plan: T = " + std::to_string(T) + " outside [0, " +
                                  std::to_string(max_tokens) + "]");
    }
    std::vector<int> count(groups, 0), offset(groups, 0);
    for (int i = 0; i < T * K; ++i) {
      const int e = ids[i];
      if (e < -1 || e >= E) {
        throw std::invalid_argument("CublasLtMoeBaseline::plan: expert id " + std::to_string(e) + " at [" +
                                    std::to_string(i / K) + "][" + std::to_string(i % K) + "] out of range");
      }
      if (e >= 0) ++count[e];
    }
    if (s.has_shared()) count[E] = T;
    int rows = 0;
    h_groups.assign(groups, GroupInfo{0, 0});
    for (int g = 0; g < groups; ++g) {
      offset[g] = rows;
      h_groups[g] = GroupInfo{rows, round_up(count[g], 4)};
      rows += h_groups[g].padded;
    }
    h_row_token.assign(rows, -1);
    h_row_weight.assign(rows, 0.0f);
    h_row_group.assign(rows, 0);
    h_slot_row.assign(size_t(T) * slots, -1);
    for (int g = 0; g < groups; ++g)
      for (int r = 0; r < h_groups[g].padded; ++r) h_row_group[h_groups[g].offset + r] = g;
    // Rows of one expert in token order (stable), so the layout is deterministic.
    std::vector<int> fill(groups, 0);
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {
        const int e = ids[size_t(t) * K + k];
        if (e < 0) continue;
        const int r = offset[e] + fill[e]++;
        h_row_token[r] = t;
        h_row_weight[r] = weights[size_t(t) * K + k];
        h_slot_row[size_t(t) * slots + k] = r;
      }
      if (s.has_shared()) {
        const int r = offset[E] + t;
        h_row_token[r] = t;
        h_row_weight[r] = 1.0f;
        h_slot_row[size_t(t) * slots + K] = r;
      }
    }
    if (size_t(rows) > rows_cap) throw std::logic_error("CublasLtMoeBaseline::plan: row capacity exceeded");
    if (rows) {
      MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(row_token.p, h_row_token.data(), rows * sizeof(int32_t),
                                         cudaMemcpyHostToDevice, stream));
      MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(row_weight.p, h_row_weight.data(), rows * sizeof(float),
                                         cudaMemcpyHostToDevice, stream));
      MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(row_group.p, h_row_group.data(), rows * sizeof(int32_t),
                                         cudaMemcpyHostToDevice, stream));
    }
    if (T) {
      MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(slot_row.p, h_slot_row.data(), h_slot_row.size() * sizeof(int32_t),
                                         cudaMemcpyHostToDevice, stream));
    }
    MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(group_info.p, h_groups.data(), groups * sizeof(GroupInfo),
                                       cudaMemcpyHostToDevice, stream));
    // The host vectors are reused by the next plan(): finish the copies now.
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));

    batch.tokens = T;
    batch.rows = rows;
    batch.xq = xq.p;
    batch.xs = xs.p;
    batch.row_token = row_token.p;
    batch.row_weight = row_weight.p;
    batch.slot_row = slot_row.p;
    batch.count = std::move(count);
    batch.offset = std::move(offset);
    return batch;
  }

  void check_batch(const DeviceRoutedBatch& b) const {
    if (b.xq != xq.p || b.row_token != row_token.p || int(b.count.size()) != groups) {
      throw std::invalid_argument("CublasLtMoeBaseline: batch was not planned by this baseline");
    }
  }

  void quantize(const DeviceRoutedBatch& b, const num::bf16_t* x, cudaStream_t stream) {
    check_batch(b);
    if (b.rows == 0) return;
    baseline_quantize_rows<<<b.rows, kRowThreads, 0, stream>>>(x, H, row_token.p, row_group.p, group_info.p,
                                                               xq.p, xs.p);
    MEGAMOE_CUDA_CHECK_LAUNCH();
  }

  void run(const DeviceRoutedBatch& b, num::bf16_t* y, cudaStream_t stream) {
    check_batch(b);
    if (b.tokens == 0) return;
    const size_t acc_bytes = gemm1_out == GemmOut::kF32 ? sizeof(float) : sizeof(num::bf16_t);
    auto group_weights = [&](int g, const uint8_t*& w13, const float*& s13, const uint8_t*& w2_,
                             const float*& s2, int& ig) {
      if (g < E) {
        w13 = w.w13 + size_t(g) * 2 * I * H;
        s13 = w13s + size_t(g) * (2 * I / kBlk) * round_up(kb_h, 4);
        w2_ = w.w2 + size_t(g) * H * I;
        s2 = w2s + size_t(g) * kb_h * round_up(I / kBlk, 4);
        ig = I;
      } else {
        w13 = w.shared_w13, s13 = sw13s, w2_ = w.shared_w2, s2 = sw2s, ig = Is;
      }
    };

    // GEMM1 per group: h1[rows][2 I_g] = xq[rows][H] * w13[2 I_g][H]^T.
    for (int g = 0; g < groups; ++g) {
      if (b.count[g] == 0) continue;
      const uint8_t *w13, *w2_;
      const float *s13, *s2;
      int ig;
      group_weights(g, w13, s13, w2_, s2, ig);
      const GroupInfo gi = h_groups[g];
      BlockScaledGemmArgs a;
      a.out = 2 * ig, a.rows = gi.padded, a.k = H;
      a.w = w13, a.ldw = H, a.w_scale = s13;
      a.x = xq.p + size_t(gi.offset) * H, a.ldx = H, a.x_scale = xs.p + size_t(gi.offset) * kb_h;
      a.d = h1.p + size_t(gi.offset) * ld1 * acc_bytes, a.ldd = ld1, a.d_type = gemm1_out;
      gemm.run(a, stream);
    }

    // SwiGLU x routing weight, requantized per 1x128 for GEMM2.
    const int shared_group = s.has_shared() ? E : -1;
    if (gemm1_out == GemmOut::kF32) {
      baseline_swiglu_quant<float><<<b.rows, kRowThreads, 0, stream>>>(
          reinterpret_cast<const float*>(h1.p), ld1, I, Is, shared_group, s.swiglu_limit, row_weight.p,
          row_group.p, group_info.p, i_max, ib_max, aq.p, as.p);
    } else {
      baseline_swiglu_quant<num::bf16_t><<<b.rows, kRowThreads, 0, stream>>>(
          reinterpret_cast<const num::bf16_t*>(h1.p), ld1, I, Is, shared_group, s.swiglu_limit, row_weight.p,
          row_group.p, group_info.p, i_max, ib_max, aq.p, as.p);
    }
    MEGAMOE_CUDA_CHECK_LAUNCH();

    // GEMM2 per group: out[rows][H] = aq[rows][I_g] * w2[H][I_g]^T -> bf16.
    for (int g = 0; g < groups; ++g) {
      if (b.count[g] == 0) continue;
      const uint8_t *w13, *w2_;
      const float *s13, *s2;
      int ig;
      group_weights(g, w13, s13, w2_, s2, ig);
      const GroupInfo gi = h_groups[g];
      BlockScaledGemmArgs a;
      a.out = H, a.rows = gi.padded, a.k = ig;
      a.w = w2_, a.ldw = ig, a.w_scale = s2;
      a.x = aq.p + size_t(gi.offset) * i_max, a.ldx = i_max, a.x_scale = as.p + size_t(gi.offset) * ib_max;
      a.d = out.p + size_t(gi.offset) * H, a.ldd = H, a.d_type = GemmOut::kBF16;
      gemm.run(a, stream);
    }

    const size_t threads = size_t(b.tokens) * (H / 8);
    baseline_combine<<<unsigned((threads + 255) / 256), 256, 0, stream>>>(out.p, slot_row.p, b.tokens, H,
                                                                          slots, y);
    MEGAMOE_CUDA_CHECK_LAUNCH();
  }
};

CublasLtMoeBaseline::CublasLtMoeBaseline(const MoeShape& shape, const MoeWeightsView& w, int max_tokens,
                                         GemmOut gemm1_out)
    : impl_(std::make_unique<Impl>(shape, w, max_tokens, gemm1_out)) {}

CublasLtMoeBaseline::~CublasLtMoeBaseline() = default;

const DeviceRoutedBatch& CublasLtMoeBaseline::plan(const int32_t* ids, const float* weights, int T,
                                                   cudaStream_t stream) {
  return impl_->plan(ids, weights, T, stream);
}

void CublasLtMoeBaseline::quantize(const DeviceRoutedBatch& b, const num::bf16_t* x, cudaStream_t stream) {
  impl_->quantize(b, x, stream);
}

void CublasLtMoeBaseline::run(const DeviceRoutedBatch& b, num::bf16_t* y, cudaStream_t stream) {
  impl_->run(b, y, stream);
}

// ---------------------------------------------------------------------------
// The dense yardstick
// ---------------------------------------------------------------------------

namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Random E4M3 bytes, every code but the two NaNs (0x7F, 0xFF): random signs and the
// full exponent range, as random weights and quantized activations toggle the bits.
__global__ void fill_e4m3_random(uint8_t* __restrict__ p, size_t n, uint64_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint8_t b = uint8_t(mix64(seed + 0x9E3779B97F4A7C15ull * (i + 1)));
    if ((b & 0x7F) == 0x7F) b ^= 0x01;
    p[i] = b;
  }
}

// Positive scales in [0.5, 1.5) / 448 (a block amax near 448 maps to the E4M3 range).
__global__ void fill_scale_random(float* __restrict__ p, size_t n, uint64_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] =
        (0.5f + float(mix64(seed ^ (0xD1B54A32D192ED03ull * (i + 1))) >> 40) * (1.0f / 16777216.0f)) / 448.0f;
}

}  // namespace

struct DenseFp8GemmPair::Impl {
  int m = 0, H = 0, I = 0;
  CublasLtBlockScaledGemm gemm;
  DeviceArray<uint8_t> x, w13, a, w2;
  DeviceArray<float> xs, w13s, as, w2s;
  DeviceArray<num::bf16_t> d1, d2;
};

DenseFp8GemmPair::DenseFp8GemmPair(int m, int hidden, int inter, uint64_t seed)
    : impl_(std::make_unique<Impl>()) {
  if (m < 4 || m % 4 != 0 || hidden < kBlk || hidden % kBlk != 0 || inter < kBlk || inter % kBlk != 0)
    throw std::invalid_argument(
        "DenseFp8GemmPair: need m % 4 == 0 (>= 4), hidden and inter multiples of 128, got m=" +
        std::to_string(m) + " hidden=" + std::to_string(hidden) + " inter=" + std::to_string(inter));
  Impl& d = *impl_;
  d.m = m, d.H = hidden, d.I = inter;
  const size_t M = size_t(m), H = size_t(hidden), I = size_t(inter);
  d.x = DeviceArray<uint8_t>(M * H);
  d.w13 = DeviceArray<uint8_t>(2 * I * H);
  d.a = DeviceArray<uint8_t>(M * I);
  d.w2 = DeviceArray<uint8_t>(H * I);
  d.xs = DeviceArray<float>(H / kBlk * M);
  d.w13s = DeviceArray<float>(2 * I / kBlk * size_t(round_up(hidden / kBlk, 4)));
  d.as = DeviceArray<float>(I / kBlk * M);
  d.w2s = DeviceArray<float>(H / kBlk * size_t(round_up(inter / kBlk, 4)));
  d.d1 = DeviceArray<num::bf16_t>(M * 2 * I);
  d.d2 = DeviceArray<num::bf16_t>(M * H);
  uint64_t k = seed;
  for (auto* arr : {&d.x, &d.w13, &d.a, &d.w2}) {
    fill_e4m3_random<<<1024, 256>>>(arr->p, arr->n, ++k);
    MEGAMOE_CUDA_CHECK_LAUNCH();
  }
  for (auto* arr : {&d.xs, &d.w13s, &d.as, &d.w2s}) {
    fill_scale_random<<<256, 256>>>(arr->p, arr->n, ++k);
    MEGAMOE_CUDA_CHECK_LAUNCH();
  }
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
}

DenseFp8GemmPair::~DenseFp8GemmPair() = default;

void DenseFp8GemmPair::run(cudaStream_t stream) {
  Impl& d = *impl_;
  BlockScaledGemmArgs g1;
  g1.out = 2 * d.I, g1.rows = d.m, g1.k = d.H;
  g1.w = d.w13.p, g1.ldw = d.H, g1.w_scale = d.w13s.p;
  g1.x = d.x.p, g1.ldx = d.H, g1.x_scale = d.xs.p;
  g1.d = d.d1.p, g1.ldd = 2 * d.I, g1.d_type = GemmOut::kBF16;
  d.gemm.run(g1, stream);
  BlockScaledGemmArgs g2;
  g2.out = d.H, g2.rows = d.m, g2.k = d.I;
  g2.w = d.w2.p, g2.ldw = d.I, g2.w_scale = d.w2s.p;
  g2.x = d.a.p, g2.ldx = d.I, g2.x_scale = d.as.p;
  g2.d = d.d2.p, g2.ldd = d.H, g2.d_type = GemmOut::kBF16;
  d.gemm.run(g2, stream);
}

double DenseFp8GemmPair::flops() const {
  const Impl& d = *impl_;
  return 2.0 * d.m * (2.0 * d.I * d.H + double(d.I) * d.H);
}

int DenseFp8GemmPair::m() const { return impl_->m; }

}  // namespace megamoe::bench
