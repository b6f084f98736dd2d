// GPU tests of the virtual-rank transport: every rank's kernel reaches every
// peer's symmetric buffer through its table (each writes an epoch-tagged signal
// into each peer's slot for it), the buffers are disjoint and start zeroed.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "../../src/kernels/cuda_check.h"
#include "gpu_test_util.h"
#include "megamoe/model/shape.h"
#include "megamoe/transport/transport.h"

namespace megamoe::transport {
namespace {

using testutil::have_device;

// Thread q of rank t.rank: signals[kCounts][t.rank] of peer q = epoch * 16 + rank.
__global__ void stamp_peers(PeerTable t, size_t signals_offset, uint64_t epoch) {
  const int q = threadIdx.x;
  if (q >= t.ranks) return;
  auto* sig = reinterpret_cast<uint64_t*>(t.base[q] + signals_offset);
  sig[kernels::EpLayout::kCounts * t.ranks + t.rank] = epoch * 16 + uint64_t(t.rank);
}

TEST(VirtualRanks, EveryRankReachesEveryPeer) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const MoeShape& s = find_preset("glm-5.3-flash").shape;
  for (int R : {1, 2, 4, 8}) {
    const kernels::EpLayout l = kernels::EpLayout::compute(s, R, 64);
    auto tr = make_virtual_ranks(l);
    ASSERT_EQ(tr->ranks(), R);
    // Buffers: distinct, non-overlapping, and every rank sees the same table.
    std::vector<uint8_t*> bases;
    for (int q = 0; q < R; ++q) bases.push_back(tr->peers(0).base[q]);
    std::vector<uint8_t*> sorted = bases;
    std::sort(sorted.begin(), sorted.end());
    for (int q = 0; q + 1 < R; ++q) EXPECT_GE(size_t(sorted[q + 1] - sorted[q]), l.total_bytes);
    for (int r = 0; r < R; ++r) {
      const PeerTable t = tr->peers(r);
      EXPECT_EQ(t.rank, r);
      for (int q = 0; q < R; ++q) EXPECT_EQ(t.base[q], bases[q]);
    }
    // Zeroed at creation, then two epochs of signals from every rank to every peer.
    for (uint64_t epoch : {1u, 2u}) {
      for (int r = 0; r < R; ++r) {
        stamp_peers<<<1, 32>>>(tr->peers(r), l.signals.offset, epoch);
        MEGAMOE_CUDA_CHECK(cudaGetLastError());
      }
      MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
      for (int q = 0; q < R; ++q) {
        std::vector<uint64_t> sig(size_t(kernels::EpLayout::kSignalKinds) * R, ~0ull);
        MEGAMOE_CUDA_CHECK(
            cudaMemcpy(sig.data(), bases[q] + l.signals.offset, sig.size() * 8, cudaMemcpyDeviceToHost));
        for (int src = 0; src < R; ++src) {
          EXPECT_EQ(sig[kernels::EpLayout::kCounts * R + src], epoch * 16 + src)
              << "R=" << R << " peer " << q;
          EXPECT_EQ(sig[kernels::EpLayout::kCombine * R + src], 0u) << "R=" << R << " peer " << q;
        }
      }
    }
  }
}

TEST(VirtualRanks, BadRankIsAnError) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const kernels::EpLayout l = kernels::EpLayout::compute(find_preset("glm-5.3-flash").shape, 2, 8);
  auto tr = make_virtual_ranks(l);
  EXPECT_THROW(tr->peers(2), std::runtime_error);
  EXPECT_THROW(tr->peers(-1), std::runtime_error);
}

}  // namespace
}  // namespace megamoe::transport
