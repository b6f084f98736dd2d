// GPU tests of the expert-parallel dispatch on virtual ranks: every owner's receive
// ring holds exactly the rows its experts were sent (data, scales, weight, source),
// source-major inside each local expert's padded segment, for uneven batches, ranks
// without tokens, all tokens on one rank's experts, and a second forward (epoch).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "../../src/kernels/cuda_check.h"
#include "megamoe/kernels/ep_dispatch.h"
#include "megamoe/transport/transport.h"

namespace megamoe::kernels {
namespace {

bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

MoeShape small_shape() {
  MoeShape s;
  s.hidden = 512, s.inter = 256, s.experts = 32, s.topk = 4, s.shared_experts = 1;
  return s;
}

struct RankInput {
  int T = 0;
  std::vector<uint8_t> x;      // [T][H]
  std::vector<float> scale;    // [T][H/128]
  std::vector<int32_t> ids;    // [T][K]
  std::vector<float> weights;  // [T][K]
};

// Random distinct top-K experts per token; `only_rank0` puts every slot on rank 0's experts.
RankInput make_input(const EpLayout& l, int T, bool only_rank0, std::mt19937& rng) {
  RankInput in;
  in.T = T;
  const int H = l.hidden, K = l.topk, E = l.ranks * l.local_experts;
  in.x.resize(size_t(T) * H);
  in.scale.resize(size_t(T) * (H / 128));
  in.ids.resize(size_t(T) * K);
  in.weights.resize(size_t(T) * K);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> uf(0.01f, 2.0f);
  for (auto& v : in.x) v = uint8_t(byte(rng));
  for (auto& v : in.scale) v = uf(rng);
  for (auto& v : in.weights) v = uf(rng);
  std::vector<int> e(E);
  for (int t = 0; t < T; ++t) {
    std::iota(e.begin(), e.end(), 0);
    std::shuffle(e.begin(), e.begin() + (only_rank0 ? l.local_experts : E), rng);
    for (int k = 0; k < K; ++k) in.ids[size_t(t) * K + k] = e[k];
  }
  return in;
}

void check_owner(const EpLayout& l, int q, uint8_t* base, const std::vector<RankInput>& in) {
  const int R = l.ranks, El = l.local_experts, H = l.hidden, hb = H / 128, K = l.topk;
  std::vector<int32_t> counts(size_t(R) * (El + 1));
  MEGAMOE_CUDA_CHECK(
      cudaMemcpy(counts.data(), base + l.counts.offset, counts.size() * 4, cudaMemcpyDeviceToHost));
  const size_t rc = l.recv_rows_cap;
  std::vector<uint8_t> rx(rc * H);
  std::vector<float> rs(size_t(hb) * rc), rw(rc);
  std::vector<int32_t> rsrc(rc);
  MEGAMOE_CUDA_CHECK(cudaMemcpy(rx.data(), base + l.recv_x.offset, rx.size(), cudaMemcpyDeviceToHost));
  MEGAMOE_CUDA_CHECK(
      cudaMemcpy(rs.data(), base + l.recv_scale.offset, rs.size() * 4, cudaMemcpyDeviceToHost));
  MEGAMOE_CUDA_CHECK(
      cudaMemcpy(rw.data(), base + l.recv_weight.offset, rw.size() * 4, cudaMemcpyDeviceToHost));
  MEGAMOE_CUDA_CHECK(
      cudaMemcpy(rsrc.data(), base + l.recv_src.offset, rsrc.size() * 4, cudaMemcpyDeviceToHost));
  int expect_start = 0;
  for (int el = 0; el < El; ++el) {
    const int e = q * El + el;
    ASSERT_EQ(ep_segment_start(l, counts.data(), el), expect_start) << "owner " << q << " expert " << el;
    int row = expect_start;
    for (int src = 0; src < R; ++src) {
      std::vector<std::pair<int, int>> want;  // (token, slot) sent by src to e
      for (int t = 0; t < in[src].T; ++t)
        for (int k = 0; k < K; ++k)
          if (in[src].ids[size_t(t) * K + k] == e) want.push_back({t, k});
      ASSERT_EQ(counts[size_t(src) * (El + 1) + el], int(want.size())) << "owner " << q << " src " << src;
      std::vector<std::pair<int, int>> got;
      for (size_t i = 0; i < want.size(); ++i, ++row) {
        const int32_t v = rsrc[row];
        ASSERT_EQ(EpLayout::src_rank(v), src) << "row " << row;
        const int t = EpLayout::src_token(v), k = EpLayout::src_slot(v);
        ASSERT_LT(t, in[src].T);
        got.push_back({t, k});
        EXPECT_EQ(0, std::memcmp(&rx[size_t(row) * H], &in[src].x[size_t(t) * H], H)) << "row " << row;
        for (int g = 0; g < hb; ++g) EXPECT_EQ(rs[size_t(g) * rc + row], in[src].scale[size_t(t) * hb + g]);
        EXPECT_EQ(rw[row], in[src].weights[size_t(t) * K + k]);
      }
      std::sort(got.begin(), got.end());
      EXPECT_EQ(got, want) << "owner " << q << " expert " << el << " source " << src;
    }
    const int n = row - expect_start;
    expect_start += (n + EpLayout::kRowAlign - 1) / EpLayout::kRowAlign * EpLayout::kRowAlign;
  }
  EXPECT_LE(expect_start, l.recv_rows_cap);
}

void upload(const EpLayout& l, uint8_t* base, const RankInput& in) {
  if (in.T == 0) return;
  MEGAMOE_CUDA_CHECK(cudaMemcpy(base + l.x_q.offset, in.x.data(), in.x.size(), cudaMemcpyHostToDevice));
  MEGAMOE_CUDA_CHECK(
      cudaMemcpy(base + l.x_scale.offset, in.scale.data(), in.scale.size() * 4, cudaMemcpyHostToDevice));
  MEGAMOE_CUDA_CHECK(
      cudaMemcpy(base + l.topk_ids.offset, in.ids.data(), in.ids.size() * 4, cudaMemcpyHostToDevice));
  MEGAMOE_CUDA_CHECK(cudaMemcpy(base + l.topk_weights.offset, in.weights.data(), in.weights.size() * 4,
                                cudaMemcpyHostToDevice));
}

TEST(EpDispatch, OwnersReceiveExactlyTheirRows) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(11);
  const int Tmax = 64;
  for (int R : {1, 2, 4, 8}) {
    const EpLayout l = EpLayout::compute(small_shape(), R, Tmax);
    auto tr = transport::make_virtual_ranks(l);
    std::vector<transport::PeerTable> tables;
    for (int r = 0; r < R; ++r) tables.push_back(tr->peers(r));
    int* d_T = nullptr;
    MEGAMOE_CUDA_CHECK(cudaMalloc(&d_T, R * sizeof(int)));
    // epoch 1: uneven batches, rank 1 (if any) empty; epoch 2: every slot on rank 0's experts, T at Tmax
    for (uint64_t epoch : {1u, 2u}) {
      std::vector<RankInput> in;
      std::vector<int> Ts;
      for (int r = 0; r < R; ++r) {
        const int T = epoch == 2 ? Tmax : (r == 1 ? 0 : int(rng() % Tmax) + 1);
        in.push_back(make_input(l, T, epoch == 2, rng));
        Ts.push_back(T);
        upload(l, tables[0].base[r], in.back());
      }
      MEGAMOE_CUDA_CHECK(cudaMemcpy(d_T, Ts.data(), R * sizeof(int), cudaMemcpyHostToDevice));
      ep_dispatch(l, tables.data(), R, d_T, epoch, nullptr);
      MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
      for (int q = 0; q < R; ++q) {
        SCOPED_TRACE("R=" + std::to_string(R) + " epoch " + std::to_string(epoch) + " owner " +
                     std::to_string(q));
        check_owner(l, q, tables[0].base[q], in);
      }
    }
    cudaFree(d_T);
  }
}

}  // namespace
}  // namespace megamoe::kernels
