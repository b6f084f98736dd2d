// GPU tests of the bench baselines: the read-bandwidth ceiling is plausible,
// one cuBLASLt block-scaled GEMM and the whole cuBLASLt MoE layer match a
// float CPU computation on dequantized operands. Skipped without a device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "../../src/kernels/cuda_check.h"
#include "gpu_test_util.h"
#include "megamoe/numerics/act_quant.h"
#include "megamoe/numerics/fp8.h"
#include "megamoe/weights/layout.h"
#include "megamoe_bench/baselines.h"

namespace megamoe::bench {
namespace {

using testutil::have_device;

#define REQUIRE_DEVICE() \
  if (!have_device()) GTEST_SKIP() << "no CUDA device"

template <typename T>
struct Dev {
  T* p = nullptr;
  explicit Dev(const std::vector<T>& h) {
    MEGAMOE_CUDA_CHECK(cudaMalloc(&p, h.size() * sizeof(T)));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  explicit Dev(size_t n) { MEGAMOE_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T))); }
  ~Dev() { cudaFree(p); }
  std::vector<T> get(size_t n) const {
    std::vector<T> h(n);
    MEGAMOE_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

double rel_l2(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// A [rows][cols] block-FP8 matrix the way a checkpoint stores it: E4M3 values
// and one float scale_inv per 128x128 block ([ceil(rows/128)][ceil(cols/128)]).
struct BlockFp8 {
  std::vector<uint8_t> q;
  std::vector<float> scale;
  int rows = 0, cols = 0;
  float at(int r, int c) const {
    return num::e4m3_decode(q[size_t(r) * cols + c]) * scale[size_t(r / 128) * ceil_div(cols, 128) + c / 128];
  }
};

BlockFp8 random_block_fp8(int rows, int cols, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, stddev);
  std::vector<float> v(size_t(rows) * cols);
  for (auto& x : v) x = nd(rng);
  BlockFp8 m;
  m.rows = rows, m.cols = cols;
  const int rb = ceil_div(rows, 128), cb = ceil_div(cols, 128);
  m.q.resize(v.size());
  m.scale.resize(size_t(rb) * cb);
  for (int bi = 0; bi < rb; ++bi)
    for (int bj = 0; bj < cb; ++bj) {
      float amax = 0;
      for (int r = bi * 128; r < std::min(rows, bi * 128 + 128); ++r)
        for (int c = bj * 128; c < std::min(cols, bj * 128 + 128); ++c)
          amax = std::max(amax, std::fabs(v[size_t(r) * cols + c]));
      const float s = std::max(amax, 1e-12f) / num::kE4M3Max;
      m.scale[size_t(bi) * cb + bj] = s;
      for (int r = bi * 128; r < std::min(rows, bi * 128 + 128); ++r)
        for (int c = bj * 128; c < std::min(cols, bj * 128 + 128); ++c)
          m.q[size_t(r) * cols + c] = num::e4m3_encode(v[size_t(r) * cols + c] / s);
    }
  return m;
}

// Per-row 1x128 quantization (docs/numerics.md §4) of a float row, dequantized back.
std::vector<float> quant_dequant_row(const float* x, int n, std::vector<uint8_t>* q = nullptr,
                                     std::vector<float>* scales = nullptr) {
  std::vector<float> out(n);
  for (int g = 0; g < n / 128; ++g) {
    float amax = 0;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(x[g * 128 + i]));
    const float s = num::act_scale(amax), inv = 1.0f / s;
    if (scales) scales->push_back(s);
    for (int i = 0; i < 128; ++i) {
      const uint8_t b = num::act_quant(x[g * 128 + i], inv);
      if (q) q->push_back(b);
      out[g * 128 + i] = num::e4m3_decode(b) * s;
    }
  }
  return out;
}

TEST(BenchBaselines, ReadBandwidthIsPlausible) {
  REQUIRE_DEVICE();
  const double bw = measure_read_bandwidth(size_t(2) << 30, 10, nullptr);
  std::printf("streaming read: %.2f TB/s\n", bw * 1e-12);
  EXPECT_GT(bw, 3e12);
  EXPECT_LT(bw, 6e12);  // above the HBM datasheet would mean the loads were skipped
}

TEST(BenchBaselines, TimeDeviceReportsOrderedStats) {
  REQUIRE_DEVICE();
  Dev<uint8_t> buf(size_t(256) << 20);
  const Timing t = time_device(
      [&](cudaStream_t s) { MEGAMOE_CUDA_CHECK(cudaMemsetAsync(buf.p, 1, size_t(256) << 20, s)); }, nullptr,
      2, 9, true);
  EXPECT_GT(t.min_us, 0.0);
  EXPECT_LE(t.min_us, t.p10_us);
  EXPECT_LE(t.p10_us, t.median_us);
  EXPECT_LE(t.median_us, t.p90_us);
  EXPECT_LE(t.p90_us, t.max_us);
}

// One GEMM with K blocks not a multiple of 4 (the padded BLK128x128 pitch)
// and rows spanning several 128-row blocks of the weight.
void check_single_gemm(GemmOut d_type) {
  std::mt19937 rng(7);
  const int out = 256, rows = 12, k = 384, kb = k / 128, kb4 = 4;
  BlockFp8 w = random_block_fp8(out, k, 0.05f, rng);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(size_t(rows) * k);
  for (auto& v : x) v = nd(rng);
  std::vector<uint8_t> xq;
  std::vector<float> xs_rowmajor;
  std::vector<float> xd(x.size());
  for (int r = 0; r < rows; ++r) {
    const auto d = quant_dequant_row(&x[size_t(r) * k], k, &xq, &xs_rowmajor);
    std::copy(d.begin(), d.end(), xd.begin() + size_t(r) * k);
  }
  // VEC128 scales: [k/128][rows], row index contiguous.
  std::vector<float> xs(size_t(kb) * rows);
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < kb; ++b) xs[size_t(b) * rows + r] = xs_rowmajor[size_t(r) * kb + b];
  // BLK128x128 scales with a row pitch of roundup(kb, 4).
  std::vector<float> ws(size_t(out / 128) * kb4, 0.0f);
  for (int i = 0; i < out / 128; ++i)
    for (int b = 0; b < kb; ++b) ws[size_t(i) * kb4 + b] = w.scale[size_t(i) * kb + b];

  std::vector<float> ref(size_t(rows) * out);
  for (int r = 0; r < rows; ++r)
    for (int n = 0; n < out; ++n) {
      double acc = 0;
      for (int c = 0; c < k; ++c) acc += double(xd[size_t(r) * k + c]) * w.at(n, c);
      ref[size_t(r) * out + n] = float(acc);
    }

  Dev<uint8_t> dw(w.q), dx(xq);
  Dev<float> dws(ws), dxs(xs);
  Dev<uint8_t> dd(size_t(rows) * out * 4);
  CublasLtBlockScaledGemm gemm;
  BlockScaledGemmArgs a;
  a.out = out, a.rows = rows, a.k = k;
  a.w = dw.p, a.ldw = k, a.w_scale = dws.p;
  a.x = dx.p, a.ldx = k, a.x_scale = dxs.p;
  a.d = dd.p, a.ldd = out, a.d_type = d_type;
  gemm.run(a, nullptr);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> got(size_t(rows) * out);
  if (d_type == GemmOut::kF32) {
    const auto raw = dd.get(got.size() * 4);
    std::memcpy(got.data(), raw.data(), raw.size());
  } else {
    const auto raw = dd.get(got.size() * 2);
    for (size_t i = 0; i < got.size(); ++i) {
      num::bf16_t h;
      std::memcpy(&h, raw.data() + 2 * i, 2);
      got[i] = num::bf16_decode(h);
    }
  }
  const double e = rel_l2(got, ref);
  std::printf("single GEMM (%s out): rel L2 %.3e, got[0..2] %g %g %g ref %g %g %g\n",
              d_type == GemmOut::kF32 ? "f32" : "bf16", e, got[0], got[1], got[2], ref[0], ref[1], ref[2]);
  EXPECT_LT(e, 2e-2);
}

TEST(BenchBaselines, BlockScaledGemmF32MatchesCpu) {
  REQUIRE_DEVICE();
  check_single_gemm(GemmOut::kF32);
}

TEST(BenchBaselines, BlockScaledGemmBf16MatchesCpu) {
  REQUIRE_DEVICE();
  check_single_gemm(GemmOut::kBF16);
}

// Speed of the library GEMM on two GLM-5 shapes (cuBLASLt's block-scaled FP8 measured
// 268 / 1018 TFLOP/s on an H200 for 256x4096x6144 / 4096x4096x6144): a sanity floor only.
TEST(BenchBaselines, BlockScaledGemmSpeed) {
  REQUIRE_DEVICE();
  const int out = 4096, k = 6144;
  Dev<uint8_t> dw(size_t(out) * k), dx(size_t(4096) * k);
  Dev<float> dws(size_t(out / 128) * (k / 128)), dxs(size_t(k / 128) * 4096);
  Dev<num::bf16_t> dd(size_t(4096) * out);
  MEGAMOE_CUDA_CHECK(cudaMemset(dw.p, 0x30, size_t(out) * k));  // 0.5 in E4M3
  MEGAMOE_CUDA_CHECK(cudaMemset(dx.p, 0x30, size_t(4096) * k));
  MEGAMOE_CUDA_CHECK(cudaMemset(dws.p, 0, size_t(out / 128) * (k / 128) * 4));
  MEGAMOE_CUDA_CHECK(cudaMemset(dxs.p, 0, size_t(k / 128) * 4096 * 4));
  CublasLtBlockScaledGemm gemm;
  for (const int rows : {256, 4096}) {
    BlockScaledGemmArgs a;
    a.out = out, a.rows = rows, a.k = k;
    a.w = dw.p, a.ldw = k, a.w_scale = dws.p;
    a.x = dx.p, a.ldx = k, a.x_scale = dxs.p;
    a.d = dd.p, a.ldd = out, a.d_type = GemmOut::kBF16;
    const Timing t = time_device([&](cudaStream_t s) { gemm.run(a, s); }, nullptr, 3, 20, true);
    const double tflops = 2.0 * rows * out * k / (t.median_us * 1e-6) * 1e-12;
    std::printf("cuBLASLt block-scaled %dx%dx%d: %.1f us (p10 %.1f, p90 %.1f), %.0f TFLOP/s\n", rows, out, k,
                t.median_us, t.p10_us, t.p90_us, tflops);
    if (rows == 4096) EXPECT_GT(tflops, 300.0);
  }
}

// The whole layer on a small random case (H = 384: K blocks not a multiple of 4).
void check_layer(GemmOut gemm1_out) {
  MoeShape s;
  s.hidden = 384, s.inter = 256, s.experts = 6, s.topk = 3, s.shared_experts = 1;
  s.swiglu_limit = 10.0f;
  s.correction_bias = false;
  const int T = 21, H = s.hidden, I = s.inter, E = s.experts, K = s.topk, Is = s.shared_inter();
  std::mt19937 rng(11);

  const MoeWeightLayout L = MoeWeightLayout::compute(s);
  std::vector<uint8_t> host(L.total_bytes, 0);
  std::vector<BlockFp8> w13(E), w2(E);
  auto put = [&](const Region& r, size_t off, const void* src, size_t bytes) {
    std::memcpy(host.data() + r.offset + off, src, bytes);
  };
  for (int e = 0; e < E; ++e) {
    w13[e] = random_block_fp8(2 * I, H, 0.05f, rng);
    w2[e] = random_block_fp8(H, I, 0.05f, rng);
    put(L.w13, size_t(e) * w13[e].q.size(), w13[e].q.data(), w13[e].q.size());
    put(L.w13_scale, size_t(e) * w13[e].scale.size() * 4, w13[e].scale.data(), w13[e].scale.size() * 4);
    put(L.w2, size_t(e) * w2[e].q.size(), w2[e].q.data(), w2[e].q.size());
    put(L.w2_scale, size_t(e) * w2[e].scale.size() * 4, w2[e].scale.data(), w2[e].scale.size() * 4);
  }
  const BlockFp8 sw13 = random_block_fp8(2 * Is, H, 0.05f, rng), sw2 = random_block_fp8(H, Is, 0.05f, rng);
  put(L.shared_w13, 0, sw13.q.data(), sw13.q.size());
  put(L.shared_w13_scale, 0, sw13.scale.data(), sw13.scale.size() * 4);
  put(L.shared_w2, 0, sw2.q.data(), sw2.q.size());
  put(L.shared_w2_scale, 0, sw2.scale.data(), sw2.scale.size() * 4);

  // Inputs and routing: distinct experts per token, one padding slot, uneven counts.
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.1f, 1.0f);
  std::vector<num::bf16_t> x(size_t(T) * H);
  for (auto& v : x) v = num::bf16_encode(nd(rng));
  std::vector<int32_t> ids(size_t(T) * K);
  std::vector<float> wts(size_t(T) * K);
  for (int t = 0; t < T; ++t) {
    std::vector<int> perm(E);
    for (int e = 0; e < E; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int k = 0; k < K; ++k) {
      // Tokens from 10 on use experts 0..3 only (uneven counts); token 5 has a padding slot.
      int e = t < 10 ? perm[k] : (t + k) % 4;
      if (t == 5 && k == K - 1) e = -1;
      ids[size_t(t) * K + k] = e;
      wts[size_t(t) * K + k] = e < 0 ? 0.0f : ud(rng);
    }
  }

  // CPU: the same function in float on dequantized operands.
  std::vector<float> y_ref(size_t(T) * H);
  auto expert_mlp = [&](const std::vector<float>& xd, const BlockFp8& a13, const BlockFp8& a2, int inter,
                        float weight, std::vector<float>& o) {
    std::vector<float> act(inter);
    for (int j = 0; j < inter; ++j) {
      double g = 0, u = 0;
      for (int c = 0; c < H; ++c) {
        g += double(xd[c]) * a13.at(j, c);
        u += double(xd[c]) * a13.at(inter + j, c);
      }
      float gf = float(g), uf = float(u);
      if (gemm1_out == GemmOut::kBF16) {  // the baseline rounds GEMM1's output to bf16 in this mode
        gf = num::bf16_decode(num::bf16_encode(gf));
        uf = num::bf16_decode(num::bf16_encode(uf));
      }
      act[j] = num::swiglu(gf, uf, s.swiglu_limit, weight);
    }
    const auto ad = quant_dequant_row(act.data(), inter);
    for (int h = 0; h < H; ++h) {
      double acc = 0;
      for (int j = 0; j < inter; ++j) acc += double(ad[j]) * a2.at(h, j);
      o[h] = num::bf16_decode(num::bf16_encode(float(acc)));
    }
  };
  for (int t = 0; t < T; ++t) {
    std::vector<float> xf(H);
    for (int c = 0; c < H; ++c) xf[c] = num::bf16_decode(x[size_t(t) * H + c]);
    const auto xd = quant_dequant_row(xf.data(), H);
    std::vector<float> acc(H, 0.0f), o(H);
    for (int k = 0; k < K; ++k) {
      const int e = ids[size_t(t) * K + k];
      if (e < 0) continue;
      expert_mlp(xd, w13[e], w2[e], I, wts[size_t(t) * K + k], o);
      for (int h = 0; h < H; ++h) acc[h] += o[h];
    }
    expert_mlp(xd, sw13, sw2, Is, 1.0f, o);
    for (int h = 0; h < H; ++h) y_ref[size_t(t) * H + h] = num::bf16_decode(num::bf16_encode(acc[h] + o[h]));
  }

  Dev<uint8_t> dweights(host);
  const MoeWeightsView view = MoeWeightsView::at(dweights.p, L, s);
  Dev<num::bf16_t> dx(x), dy(size_t(T) * H);
  CublasLtMoeBaseline base(s, view, 64, gemm1_out);
  const DeviceRoutedBatch& b = base.plan(ids.data(), wts.data(), T, nullptr);
  base.forward(b, dx.p, dy.p, nullptr);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  const auto yb = dy.get(size_t(T) * H);
  std::vector<float> y(yb.size());
  for (size_t i = 0; i < y.size(); ++i) y[i] = num::bf16_decode(yb[i]);
  const double e = rel_l2(y, y_ref);
  std::printf("cuBLASLt MoE layer (GEMM1 %s): rel L2 %.3e over %d tokens, rows %d\n",
              gemm1_out == GemmOut::kF32 ? "f32" : "bf16", e, T, b.rows);
  EXPECT_LT(e, 2e-2);

  // A second forward of the same batch gives the same bytes (no state leaks between runs).
  base.forward(b, dx.p, dy.p, nullptr);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(dy.get(size_t(T) * H), yb);

  // Captured in a CUDA graph (as `megamoe bench` times it) and replayed twice: the same
  // bytes, into a poisoned output.
  cudaStream_t st;
  MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MEGAMOE_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  base.forward(b, dx.p, dy.p, st);
  MEGAMOE_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
  MEGAMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2; ++rep) {
    MEGAMOE_CUDA_CHECK(cudaMemset(dy.p, 0xFF, size_t(T) * H * 2));
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    MEGAMOE_CUDA_CHECK(cudaGraphLaunch(exec, st));
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(st));
    EXPECT_EQ(dy.get(size_t(T) * H), yb) << "graph replay " << rep;
  }
  MEGAMOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MEGAMOE_CUDA_CHECK(cudaGraphDestroy(graph));
  MEGAMOE_CUDA_CHECK(cudaStreamDestroy(st));
}

TEST(BenchBaselines, CublasLtMoeLayerF32MatchesCpu) {
  REQUIRE_DEVICE();
  check_layer(GemmOut::kF32);
}

TEST(BenchBaselines, CublasLtMoeLayerBf16MatchesCpu) {
  REQUIRE_DEVICE();
  check_layer(GemmOut::kBF16);
}

// Whole-layer timing at the GLM-5 shape (docs/numerics.md §1) with constant weights
// (every byte set, so the GEMMs see real scales): prints µs per T for the lead
// and checks the output is finite. Not a correctness test.
TEST(BenchBaselines, CublasLtMoeLayerSpeedGlm5) {
  REQUIRE_DEVICE();
  MoeShape s;
  s.hidden = 6144, s.inter = 2048, s.experts = 256, s.topk = 8, s.shared_experts = 1;
  s.correction_bias = false;
  const MoeWeightLayout L = MoeWeightLayout::compute(s);
  Dev<uint8_t> dweights(L.total_bytes);
  MEGAMOE_CUDA_CHECK(cudaMemset(dweights.p, 0x30, L.total_bytes));  // E4M3 0.5
  for (const Region* r : {&L.w13_scale, &L.w2_scale, &L.shared_w13_scale, &L.shared_w2_scale})
    MEGAMOE_CUDA_CHECK(cudaMemset(dweights.p + r->offset, 0x3A, r->bytes));  // float 7.1e-4
  const MoeWeightsView view = MoeWeightsView::at(dweights.p, L, s);
  const int max_t = 4096;
  std::vector<num::bf16_t> x(size_t(max_t) * s.hidden, num::bf16_encode(0.75f));
  Dev<num::bf16_t> dx(x), dy(size_t(max_t) * s.hidden);
  CublasLtMoeBaseline base(s, view, max_t);
  std::mt19937 rng(3);
  for (const int T : {1, 8, 64, 256, 1024, 4096}) {
    std::vector<int32_t> ids(size_t(T) * s.topk);
    std::vector<float> wts(ids.size(), 0.25f);
    std::vector<int> perm(s.experts);
    for (int e = 0; e < s.experts; ++e) perm[e] = e;
    for (int t = 0; t < T; ++t) {
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int k = 0; k < s.topk; ++k) ids[size_t(t) * s.topk + k] = perm[k];
    }
    const DeviceRoutedBatch& b = base.plan(ids.data(), wts.data(), T, nullptr);
    const Timing tm =
        time_device([&](cudaStream_t st) { base.forward(b, dx.p, dy.p, st); }, nullptr, 2, 10, true);
    std::printf("cuBLASLt MoE layer GLM-5 T=%d: %.1f us (p10 %.1f, p90 %.1f)\n", T, tm.median_us, tm.p10_us,
                tm.p90_us);
    const auto y = dy.get(size_t(T) * s.hidden);
    for (size_t i = 0; i < y.size(); i += 997) ASSERT_TRUE(std::isfinite(num::bf16_decode(y[i]))) << i;
  }
}

}  // namespace
}  // namespace megamoe::bench
