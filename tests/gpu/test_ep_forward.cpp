// Expert parallelism (issue 5): every rank's output bytes equal the single-device
// layer's on the same tokens (R = 1) and agree with the CPU expert-parallel reference;
// capacity and missing peers are clear errors; graph replays with changing token counts.
// The ranks are virtual ranks on one GPU, or with MEGAMOE_TEST_EP_TRANSPORT=nccl real
// ranks in NCCL symmetric windows, rank r on GPU r, all driven by this process (issue
// 6; a case needing more ranks than there are GPUs is skipped, and says so).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "megamoe/api/ep_layer.h"
#include "megamoe/api/forward.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/kernels/overrides.h"
#include "megamoe/reference/moe.h"
#include "megamoe/transport/transport.h"
#include "megamoe/weights/host_weights.h"

namespace megamoe {
namespace {

using testutil::random_x;
using testutil::reduced_shape;

#define CK(call) ASSERT_EQ((call), cudaSuccess) << #call

// The transport the EP layers of these tests run on (MEGAMOE_TEST_EP_TRANSPORT).
api::EpTransport test_transport() {
  const char* env = std::getenv("MEGAMOE_TEST_EP_TRANSPORT");
  return env && *env ? api::parse_ep_transport(env) : api::EpTransport::kVirtual;
}

// Options for R ranks of at most max_tokens each on the test transport.
api::EpLayerOptions ep_options(int R, int max_tokens) {
  api::EpLayerOptions opt;
  opt.ranks = R;
  opt.max_tokens = max_tokens;
  opt.transport = test_transport();
  return opt;
}

// Whether R ranks fit the test transport: any R on virtual ranks; one GPU a rank on NCCL.
bool ranks_fit(int R) {
  if (test_transport() == api::EpTransport::kVirtual) return true;
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && R <= n;
}
#define REQUIRE_RANKS(R) \
  if (!ranks_fit(R)) GTEST_SKIP() << (R) << " ranks need " << (R) << " GPUs on the nccl transport"

// Skips a test that needs the NCCL transport where no NCCL can serve it, in one line: the
// candidates refused and how to name a library. A library named by MEGAMOE_NCCL_LIB is an
// explicit choice: not skipped, its error fails the test.
#define REQUIRE_NCCL()                                                                        \
  if (const transport::NcclLibrary& nccl_ = transport::find_nccl(); !nccl_.usable() && !nccl_.explicit_choice) \
  GTEST_SKIP() << nccl_.why_none()

// Sets one switch of the kernels (kernels::Overrides; the plan's are read when a layer is
// made) over the ones in force, for the scope.
struct ScopedSwitch {
  template <typename T>
  ScopedSwitch(std::optional<T> kernels::Overrides::*field, T value) : scope(with(field, value)) {}
  template <typename T>
  static kernels::Overrides with(std::optional<T> kernels::Overrides::*field, T value) {
    kernels::Overrides o = kernels::overrides();
    o.*field = value;
    return o;
  }
  kernels::ScopedOverrides scope;
};

// Sets device d for the scope (when d >= 0), restoring the caller's.
struct OnDevice {
  int saved = 0;
  explicit OnDevice(int d) {
    cudaGetDevice(&saved);
    if (d >= 0) cudaSetDevice(d);
  }
  ~OnDevice() { cudaSetDevice(saved); }
};

// Device buffers of every rank's x and y (y poisoned: bf16 NaN), rank r's on devices[r]
// (empty: all on the current device).
struct RankBuffers {
  std::vector<const num::bf16_t*> x;
  std::vector<num::bf16_t*> y;
  std::vector<size_t> bytes;
  std::vector<int> dev;
  RankBuffers(const std::vector<std::vector<num::bf16_t>>& xs, const std::vector<int>& devices = {}) {
    for (size_t r = 0; r < xs.size(); ++r) {
      dev.push_back(devices.empty() ? -1 : devices[r]);
      OnDevice on(dev.back());
      void *dx = nullptr, *dy = nullptr;
      const size_t b = std::max<size_t>(16, xs[r].size() * 2);
      EXPECT_EQ(cudaMalloc(&dx, b), cudaSuccess);
      EXPECT_EQ(cudaMalloc(&dy, b), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(dx, xs[r].data(), xs[r].size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      x.push_back(static_cast<const num::bf16_t*>(dx));
      y.push_back(static_cast<num::bf16_t*>(dy));
      bytes.push_back(b);
    }
    poison();
  }
  // The buffers of a layer's local ranks, each on its rank's device.
  RankBuffers(const std::vector<std::vector<num::bf16_t>>& xs, const api::CudaEpMoeLayer& layer)
      : RankBuffers(xs, layer_devices(layer)) {}
  static std::vector<int> layer_devices(const api::CudaEpMoeLayer& layer) {
    std::vector<int> d;
    for (size_t i = 0; i < layer.local_ranks().size(); ++i) d.push_back(layer.device(int(i)));
    return d;
  }
  void poison() {
    for (size_t r = 0; r < y.size(); ++r) {
      OnDevice on(dev[r]);
      EXPECT_EQ(cudaMemset(y[r], 0xFF, bytes[r]), cudaSuccess);
    }
  }
  std::vector<std::vector<num::bf16_t>> read(const std::vector<int>& tokens, int H) const {
    std::vector<std::vector<num::bf16_t>> out;
    for (size_t r = 0; r < y.size(); ++r) {
      OnDevice on(dev[r]);
      out.emplace_back(size_t(tokens[r]) * H);
      EXPECT_EQ(cudaMemcpy(out.back().data(), y[r], out.back().size() * 2, cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    return out;
  }
  ~RankBuffers() {
    for (size_t r = 0; r < y.size(); ++r) {
      OnDevice on(dev[r]);
      cudaFree(const_cast<num::bf16_t*>(x[r]));
      cudaFree(y[r]);
    }
  }
};

// One forward of every rank captured at `full` tokens a rank, with the counts in device
// memory (rank r's on its device), replayed with other counts.
class CountedGraph {
 public:
  CountedGraph(api::CudaEpMoeLayer& layer, RankBuffers& b, const std::vector<int>& full)
      : layer_(layer), b_(b) {
    for (size_t r = 0; r < full.size(); ++r) {
      OnDevice on(layer.device(int(r)));
      int* p = nullptr;
      EXPECT_EQ(cudaMalloc(&p, sizeof(int)), cudaSuccess);
      counts_.push_back(p);
    }
    EXPECT_EQ(cudaStreamCreateWithFlags(&st_, cudaStreamNonBlocking), cudaSuccess);
    cudaGraph_t graph = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(st_, cudaStreamCaptureModeGlobal), cudaSuccess);
    layer.forward(b.x, b.y, full, st_, std::vector<const int*>(counts_.begin(), counts_.end()));
    EXPECT_EQ(cudaStreamEndCapture(st_, &graph), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&exec_, graph, 0), cudaSuccess);
    cudaGraphDestroy(graph);
  }
  ~CountedGraph() {
    cudaGraphExecDestroy(exec_);
    cudaStreamDestroy(st_);
    for (size_t r = 0; r < counts_.size(); ++r) {
      OnDevice on(layer_.device(int(r)));
      cudaFree(counts_[r]);
    }
  }
  // Poisons the outputs, sets the counts and replays once (synchronized).
  void replay(const std::vector<int>& tokens) {
    for (size_t r = 0; r < counts_.size(); ++r)
      EXPECT_EQ(cudaMemcpy(counts_[r], &tokens[r], sizeof(int), cudaMemcpyHostToDevice), cudaSuccess);
    b_.poison();
    EXPECT_EQ(cudaGraphLaunch(exec_, st_), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(st_), cudaSuccess);
  }

 private:
  api::CudaEpMoeLayer& layer_;
  RankBuffers& b_;
  std::vector<int*> counts_;
  cudaStream_t st_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// The first tokens[r] rows of each rank's input.
std::vector<std::vector<num::bf16_t>> first_rows(const std::vector<std::vector<num::bf16_t>>& xs,
                                                 const std::vector<int>& tokens, int H) {
  std::vector<std::vector<num::bf16_t>> out;
  for (size_t r = 0; r < xs.size(); ++r)
    out.emplace_back(xs[r].begin(), xs[r].begin() + size_t(tokens[r]) * H);
  return out;
}

// Every rank's tokens through the single-device layer (the R = 1 bytes).
std::vector<std::vector<num::bf16_t>> single_device(const HostMoeWeights& w,
                                                    const std::vector<std::vector<num::bf16_t>>& xs,
                                                    const std::vector<int>& tokens);

// Replays `graph` with each case's counts: each rank's bytes against one device's on its
// first tokens.
void expect_replays_match(api::CudaEpMoeLayer& layer, CountedGraph& graph, const RankBuffers& b,
                          const HostMoeWeights& w, const std::vector<std::vector<num::bf16_t>>& xs,
                          const std::vector<std::vector<int>>& cases) {
  for (const auto& tokens : cases) {
    graph.replay(tokens);
    ASSERT_NO_THROW(layer.check());
    const auto got = b.read(tokens, w.shape.hidden);
    const auto want = single_device(w, first_rows(xs, tokens, w.shape.hidden), tokens);
    std::string counts;
    for (int t : tokens) {
      if (!counts.empty()) counts += ',';
      counts += std::to_string(t);
    }
    for (size_t r = 0; r < tokens.size(); ++r)
      EXPECT_EQ(0, std::memcmp(got[r].data(), want[r].data(), got[r].size() * 2))
          << "replay " << counts << " rank " << r;
  }
}

// Every rank's tokens through the single-device layer (the R = 1 bytes).
std::vector<std::vector<num::bf16_t>> single_device(const HostMoeWeights& w,
                                                    const std::vector<std::vector<num::bf16_t>>& xs,
                                                    const std::vector<int>& tokens) {
  api::MoeLayerOptions opt;
  opt.max_tokens = std::max(1, *std::max_element(tokens.begin(), tokens.end()));
  api::CudaMoeLayer layer(w, opt);
  RankBuffers b(xs);
  for (size_t r = 0; r < xs.size(); ++r) layer.forward(b.x[r], b.y[r], tokens[r], nullptr, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return b.read(tokens, w.shape.hidden);
}

// The CPU expert-parallel reference, rank by rank (float holding bf16 values).
std::vector<std::vector<float>> cpu_ep(const HostMoeWeights& w, int R,
                                       const std::vector<std::vector<num::bf16_t>>& xs,
                                       const std::vector<int>& tokens) {
  std::vector<ref::RankBatch> batches;
  std::vector<std::vector<float>> y(R);
  std::vector<float*> yp;
  for (int r = 0; r < R; ++r) {
    batches.push_back({xs[r].data(), tokens[r]});
    y[r].resize(size_t(tokens[r]) * w.shape.hidden);
    yp.push_back(y[r].data());
  }
  ref::moe_layer_ep(w.shape, w.view(), R, batches, yp);
  return y;
}

// Relative L2 and the elements outside atol + rtol * |ref| (atol scaled to the RMS).
void expect_close(const std::vector<num::bf16_t>& got, const std::vector<float>& ref,
                  const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  if (ref.empty()) return;
  double sq = 0, num = 0;
  for (float r : ref) sq += double(r) * r;
  const double atol = 0.05 * std::sqrt(sq / ref.size());
  int64_t bad = 0, nonfinite = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double a = num::bf16_decode(got[i]), r = ref[i];
    if (!std::isfinite(a)) {
      ++nonfinite;
      continue;
    }
    num += (a - r) * (a - r);
    if (std::fabs(a - r) > atol + 0.05 * std::fabs(r)) ++bad;
  }
  EXPECT_EQ(nonfinite, 0) << what;
  EXPECT_EQ(bad, 0) << what;
  EXPECT_LE(std::sqrt(num / std::max(sq, 1e-30)), 5e-3) << what;
}

std::vector<std::vector<num::bf16_t>> rank_inputs(const MoeShape& s, const std::vector<int>& tokens,
                                                  uint64_t seed) {
  std::vector<std::vector<num::bf16_t>> xs;
  for (size_t r = 0; r < tokens.size(); ++r) xs.push_back(random_x(size_t(tokens[r]) * s.hidden, seed + r));
  return xs;
}

class EpForward : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!api::cuda_available()) GTEST_SKIP() << "no sm_90 device";
    if (test_transport() == api::EpTransport::kNccl) REQUIRE_NCCL();
  }
};

// Uneven batches, a rank with zero tokens, one at Tmax; R = 1, 2, 4, 8.
TEST_F(EpForward, BytesMatchSingleDeviceAndCpuReference) {
  const MoeShape s = reduced_shape();
  HostMoeWeights w = make_random_weights(s, 41);
  const int Tmax = 64;
  for (int R : {1, 2, 4, 8}) {
    if (!ranks_fit(R)) {
      std::printf("  R=%d skipped: %d ranks need %d GPUs on the nccl transport\n", R, R, R);
      continue;
    }
    std::vector<int> tokens(R);
    for (int r = 0; r < R; ++r) tokens[r] = (r == 1) ? 0 : (r == R - 1 ? Tmax : 1 + (r * 37) % Tmax);
    const auto xs = rank_inputs(s, tokens, 100 + R);
    const auto want = single_device(w, xs, tokens);
    const auto ref = cpu_ep(w, R, xs, tokens);
    api::CudaEpMoeLayer layer(w, ep_options(R, Tmax));
    // Each rank's device holds its own experts only (plus shared expert and router).
    for (int r = 0; r < R; ++r) {
      const ExpertRange own{r * (s.experts / R), s.experts / R};
      EXPECT_EQ(layer.weight_bytes(r), MoeWeightLayout::compute(s, own).total_bytes) << "rank " << r;
      if (R > 1) {
        EXPECT_LT(layer.weight_bytes(r), w.bytes()) << "rank " << r;
      }
    }
    RankBuffers b(xs, layer);
    for (int rep = 0; rep < 2; ++rep) {  // the second forward runs on the next epoch
      b.poison();
      layer.forward(b.x, b.y, tokens, nullptr);
      ASSERT_NO_THROW(layer.check());
      const auto got = b.read(tokens, s.hidden);
      for (int r = 0; r < R; ++r) {
        const std::string what = "R=" + std::to_string(R) + " rank " + std::to_string(r) +
                                 " T=" + std::to_string(tokens[r]) + " rep " + std::to_string(rep);
        EXPECT_EQ(0, std::memcmp(got[r].data(), want[r].data(), got[r].size() * 2))
            << what << ": bytes != R=1";
        expect_close(got[r], ref[r], what + " vs the CPU EP reference");
      }
    }
    std::printf("  R=%d tokens per rank up to %d: bytes equal R=1, config %s\n", R, Tmax,
                layer.config_for(Tmax).c_str());
  }
}

// Prefill-sized batches: the ranks run 128-token tiles (tokens in the wgmma M), plain
// (ep_wide_tiles off) and wide (the default, kEpWideTiles).
TEST_F(EpForward, PrefillTilesMatchSingleDevice) {
  const MoeShape s = reduced_shape();
  HostMoeWeights w = make_random_weights(s, 53);
  const int R = 2, Tmax = 600;
  REQUIRE_RANKS(R);
  const std::vector<int> tokens = {600, 411};
  const auto xs = rank_inputs(s, tokens, 900);
  const auto want = single_device(w, xs, tokens);
  for (const bool wide : {false, true}) {
    const ScopedSwitch sw(&kernels::Overrides::ep_wide_tiles, wide);
    api::CudaEpMoeLayer layer(w, ep_options(R, Tmax));
    const std::string cfg = layer.config_for(Tmax);
    ASSERT_NE(cfg.find("block_n=128"), std::string::npos) << cfg;
    ASSERT_EQ(cfg.find("wide_tiles") != std::string::npos, wide) << cfg;
    RankBuffers b(xs, layer);
    b.poison();
    layer.forward(b.x, b.y, tokens, nullptr);
    ASSERT_NO_THROW(layer.check());
    const auto got = b.read(tokens, s.hidden);
    for (int r = 0; r < R; ++r)
      EXPECT_EQ(0, std::memcmp(got[r].data(), want[r].data(), got[r].size() * 2))
          << "rank " << r << ", ep_wide_tiles " << wide;
  }
}

// Every token of every rank routed to rank 0's experts (the correction bias steers
// the choice), every rank at Tmax: the owner's ring at its bound.
TEST_F(EpForward, AllTokensToOneRank) {
  MoeShape s = reduced_shape();
  s.correction_bias = true;
  HostMoeWeights w = make_random_weights(s, 43);
  const int R = 8, El = s.experts / R, Tmax = 48;
  REQUIRE_RANKS(R);
  ASSERT_GE(El, s.topk);
  auto* bias = reinterpret_cast<float*>(w.data() + w.layout.bias.offset);
  for (int e = 0; e < s.experts; ++e) bias[e] = e < El ? 100.0f : 0.0f;
  std::vector<int> tokens(R, Tmax);
  const auto xs = rank_inputs(s, tokens, 300);
  const auto want = single_device(w, xs, tokens);
  api::CudaEpMoeLayer layer(w, ep_options(R, Tmax));
  RankBuffers b(xs, layer);
  layer.forward(b.x, b.y, tokens, nullptr);
  ASSERT_NO_THROW(layer.check());
  std::vector<int32_t> ids(size_t(Tmax) * s.topk);
  CK(cudaMemcpy(ids.data(), layer.topk_ids(3), ids.size() * 4, cudaMemcpyDeviceToHost));
  for (int32_t id : ids) ASSERT_LT(id, El) << "the bias did not steer every slot to rank 0";
  const auto got = b.read(tokens, s.hidden);
  for (int r = 0; r < R; ++r)
    EXPECT_EQ(0, std::memcmp(got[r].data(), want[r].data(), got[r].size() * 2)) << "rank " << r;
}

TEST_F(EpForward, OverCapacityIsAnError) {
  const MoeShape s = reduced_shape();
  HostMoeWeights w = make_random_weights(s, 45);
  REQUIRE_RANKS(2);
  api::EpLayerOptions opt = ep_options(2, 16);
  api::CudaEpMoeLayer layer(w, opt);
  const std::vector<int> tokens = {16, 17};
  const auto xs = rank_inputs(s, tokens, 500);
  RankBuffers b(xs, layer);
  try {
    layer.forward(b.x, b.y, tokens, nullptr);
    ADD_FAILURE() << "17 tokens over a capacity of 16 must throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1: 17 tokens exceed"), std::string::npos) << e.what();
  }
  opt.ranks = 3;  // 32 experts do not split over 3 ranks
  EXPECT_THROW(api::CudaEpMoeLayer(w, opt), std::invalid_argument);
}

// Rank 1 never launches: rank 0 gives up after the timeout with an error naming the
// rank, the phase and the peer; the layer is reset and the next forward is right.
TEST_F(EpForward, MissingRankTimesOutAndRecovers) {
  const MoeShape s = reduced_shape();
  HostMoeWeights w = make_random_weights(s, 47);
  REQUIRE_RANKS(2);
  api::EpLayerOptions opt = ep_options(2, 32);
  opt.timeout_s = 0.2;
  api::CudaEpMoeLayer layer(w, opt);
  const std::vector<int> tokens = {32, 20};
  const auto xs = rank_inputs(s, tokens, 600);
  RankBuffers b(xs, layer);
  layer.forward(b.x, b.y, tokens, nullptr, {}, /*launch_mask=*/1u);
  try {
    layer.check();
    ADD_FAILURE() << "a missing rank must time out";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 waited for the dispatch counts of rank 1"),
              std::string::npos)
        << e.what();
  }
  const auto want = single_device(w, xs, tokens);
  b.poison();
  layer.forward(b.x, b.y, tokens, nullptr);
  ASSERT_NO_THROW(layer.check());
  const auto got = b.read(tokens, s.hidden);
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(0, std::memcmp(got[r].data(), want[r].data(), got[r].size() * 2))
        << "after recovery, rank " << r;
}

// After a timeout the status word stays set until check(): the forwards enqueued before
// it may end early (their outputs are undefined) but must end, with the pull before or
// beside the tiles; check() then reports the first error and resets every rank, and the
// next forward is right. Here the ranks' CTAs give up at their grid barriers at different
// times: one that gave up after arriving had let the last CTA pass alone into the tiles'
// waits, which have no timeout (ep_grid_barrier now aborts the barrier for all of them).
TEST_F(EpForward, ForwardsAfterATimeoutEndUntilCheck) {
  const MoeShape s = reduced_shape();
  HostMoeWeights w = make_random_weights(s, 61);
  const int R = 4;
  REQUIRE_RANKS(R);
  const std::vector<int> tokens = {160, 7, 96, 130};
  const auto xs = rank_inputs(s, tokens, 1300);
  const auto want = single_device(w, xs, tokens);
  for (const bool overlap : {false, true}) {
    const ScopedSwitch sw(&kernels::Overrides::ep_overlap, overlap);
    api::EpLayerOptions opt = ep_options(R, 160);
    opt.timeout_s = 0.1;
    api::CudaEpMoeLayer layer(w, opt);
    RankBuffers b(xs, layer);
    layer.forward(b.x, b.y, tokens, nullptr, {}, /*launch_mask=*/0b1011u);  // rank 2 does not run
    for (int i = 0; i < 8; ++i) layer.forward(b.x, b.y, tokens, nullptr);
    try {
      layer.check();
      ADD_FAILURE() << "overlap " << overlap << ": the missing rank must time out";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 2"), std::string::npos) << e.what();
    }
    b.poison();
    layer.forward(b.x, b.y, tokens, nullptr);
    ASSERT_NO_THROW(layer.check()) << "overlap " << overlap;
    const auto got = b.read(tokens, s.hidden);
    for (int r = 0; r < R; ++r)
      EXPECT_EQ(0, std::memcmp(got[r].data(), want[r].data(), got[r].size() * 2))
          << "overlap " << overlap << ", after recovery, rank " << r;
  }
}

// One captured graph (device token counts), replayed with changing counts per rank.
TEST_F(EpForward, GraphReplaysWithChangingCounts) {
  const MoeShape s = reduced_shape();
  HostMoeWeights w = make_random_weights(s, 49);
  const int R = 4, Tmax = 96;
  REQUIRE_RANKS(R);
  api::CudaEpMoeLayer layer(w, ep_options(R, Tmax));
  const std::vector<int> full(R, Tmax);
  const auto xs = rank_inputs(s, full, 700);
  RankBuffers b(xs, layer);
  CountedGraph graph(layer, b, full);
  expect_replays_match(layer, graph, b, w, xs,
                       {{96, 0, 13, 50}, {1, 1, 1, 1}, {0, 96, 96, 7}, {40, 3, 0, 96}});
  // Counts outside [0, Tmax] (a caller's bug) run clamped to {96, 0, 13, 50}, and
  // check() names the ranks.
  {
    const std::vector<int> bad = {500, -3, 13, 50}, clamped = {96, 0, 13, 50};
    graph.replay(bad);
    try {
      layer.check();
      ADD_FAILURE() << "check() did not report the counts";
    } catch (const std::runtime_error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("rank 0: 1 forward read"), std::string::npos) << m;
      EXPECT_NE(m.find("rank 1: 1 forward read"), std::string::npos) << m;
      EXPECT_EQ(m.find("rank 2"), std::string::npos) << m;
    }
    ASSERT_NO_THROW(layer.check());
    const auto got = b.read(clamped, s.hidden);
    const auto want = single_device(w, first_rows(xs, clamped, s.hidden), clamped);
    for (int r = 0; r < R; ++r)
      EXPECT_EQ(0, std::memcmp(got[r].data(), want[r].data(), got[r].size() * 2)) << "clamped rank " << r;
  }
}

// api::forward (what `megamoe forward --ranks R --backend cuda` runs): the tokens split
// over R virtual ranks give the bytes, ids and weights of one device.
TEST_F(EpForward, HostForwardWithRanksMatchesOneDevice) {
  const MoeShape s = reduced_shape();
  HostMoeWeights w = make_random_weights(s, 51);
  const int T = 77;
  const auto x = random_x(size_t(T) * s.hidden, 800);
  const api::ForwardOutput one = api::forward(api::Backend::kCuda, w, x.data(), T, 1);
  for (int R : {2, 4}) {
    const api::ForwardOutput ep = api::forward(api::Backend::kCuda, w, x.data(), T, R);
    EXPECT_EQ(ep.y, one.y) << "R=" << R;
    EXPECT_EQ(ep.ids, one.ids) << "R=" << R;
    EXPECT_EQ(ep.weights, one.weights) << "R=" << R;
  }
}

// The NCCL transport with the one GPU there is: R = 1 in NCCL symmetric windows, the
// unique id made here and (dry run of one process per GPU) through a rendezvous file.
TEST_F(EpForward, NcclOneRankMatchesOneDevice) {
  REQUIRE_NCCL();
  const MoeShape s = reduced_shape();
  for (bool rendezvous : {false, true}) {
    api::EpLayerOptions opt;
    opt.ranks = 1;
    opt.max_tokens = 40;
    opt.transport = api::EpTransport::kNccl;
    if (rendezvous) opt.rendezvous = ::testing::TempDir() + "megamoe_nccl_rdv";
    const std::vector<api::EpCheckRank> res = api::ep_self_check(s, 40, opt);
    ASSERT_EQ(res.size(), 1u);
    EXPECT_TRUE(res[0].bytes_equal) << "rendezvous " << rendezvous;
    EXPECT_EQ(res[0].tokens, 40);
  }
}

// Virtual ranks through the same self-check the multi-process launcher runs.
TEST_F(EpForward, SelfCheckVirtualRanks) {
  api::EpLayerOptions opt;
  opt.ranks = 4;
  opt.max_tokens = 33;
  const auto res = api::ep_self_check(reduced_shape(), 33, opt);
  ASSERT_EQ(res.size(), 4u);
  for (const auto& r : res) {
    EXPECT_TRUE(r.bytes_equal) << "rank " << r.rank;
    EXPECT_EQ(r.tokens, 33 - r.rank % 3);
  }
}

// Every rank's fresh tokens (seed + R) through a layer on the test transport, twice (two
// epochs; the second on other tokens, so a slot the combine read before its rows landed
// would hold the first epoch's bytes), each rank's bytes against one device's; `config`
// names a part of the configuration every rank with tokens runs (each picks it from its
// own count; empty: any). Skipped where the ranks do not fit.
void expect_matches_one_device(const HostMoeWeights& w, const std::vector<int>& tokens, uint64_t seed,
                               const std::string& config, const std::string& what) {
  const int R = int(tokens.size()), Tmax = *std::max_element(tokens.begin(), tokens.end());
  if (!ranks_fit(R)) return;
  api::CudaEpMoeLayer layer(w, ep_options(R, Tmax));
  for (int r = 0; r < R; ++r) {
    if (tokens[r] > 0) {
      ASSERT_NE(layer.config_for(tokens[r]).find(config), std::string::npos)
          << what << ", rank " << r << ": " << layer.config_for(tokens[r]);
    }
  }
  for (int rep = 0; rep < 2; ++rep) {
    const auto xs = rank_inputs(w.shape, tokens, seed + R + 7919 * rep);
    const auto want = single_device(w, xs, tokens);
    RankBuffers b(xs, layer);
    b.poison();
    layer.forward(b.x, b.y, tokens, nullptr);
    ASSERT_NO_THROW(layer.check()) << what;
    const auto got = b.read(tokens, w.shape.hidden);
    for (int r = 0; r < R; ++r)
      EXPECT_EQ(0, std::memcmp(got[r].data(), want[r].data(), got[r].size() * 2))
          << what << ": R=" << R << " rank " << r << " T=" << tokens[r] << " rep " << rep << " ("
          << layer.config_for(tokens[r]) << ")";
  }
}

// The row pull beside the tiles (ep_overlap on; heuristics.h kEpOverlap): each
// unit's rows counted into its done1 counter as they land (the rank's second grid barrier
// stays, for a peer's timeout only). The bytes of one device at decode and prefill sizes
// (an empty rank, a full one), on two epochs, and in a graph replayed with other counts.
TEST_F(EpForward, OverlappedPullMatchesSingleDevice) {
  const ScopedSwitch overlap(&kernels::Overrides::ep_overlap, true);
  const MoeShape s = reduced_shape();
  HostMoeWeights w = make_random_weights(s, 57);
  const std::vector<std::vector<int>> cases = {
      {600, 411}, {13, 0, 48, 5}, {64, 1, 33, 0, 64, 17, 2, 40}, {300, 0, 129, 256}};
  for (const auto& tokens : cases)
    expect_matches_one_device(w, tokens, 1000, "ep_overlap", "overlapped pull");
  // A graph captured at Tmax on every rank, replayed with fewer and uneven counts.
  const int R = 4, Tmax = 160;
  if (!ranks_fit(R)) return;
  api::CudaEpMoeLayer layer(w, ep_options(R, Tmax));
  ASSERT_NE(layer.config_for(Tmax).find("ep_overlap"), std::string::npos) << layer.config_for(Tmax);
  const std::vector<int> full(R, Tmax);
  const auto xs = rank_inputs(s, full, 1100);
  RankBuffers b(xs, layer);
  CountedGraph graph(layer, b, full);
  expect_replays_match(layer, graph, b, w, xs, {{160, 7, 0, 99}, {1, 160, 160, 2}});
}

// Wide tiles on the ranks (heuristics.h kEpWideTiles; ep_wide_tiles on whatever it says): prefill-sized
// batches (over kHalfTileMaxAvgRows rows an expert), alone and with the pull beside the
// tiles; the bytes of one device.
TEST_F(EpForward, WideTilesMatchSingleDevice) {
  const ScopedSwitch wide(&kernels::Overrides::ep_wide_tiles, true);
  const MoeShape s = reduced_shape();
  HostMoeWeights w = make_random_weights(s, 59);
  for (const bool overlap : {false, true}) {
    const ScopedSwitch sw(&kernels::Overrides::ep_overlap, overlap);
    for (const std::vector<int>& tokens : {std::vector<int>{600, 517}, std::vector<int>{900, 0, 777, 900}})
      expect_matches_one_device(w, tokens, 1200, overlap ? "wide_tiles ep_overlap" : "wide_tiles",
                                std::string("wide tiles, overlap ") + (overlap ? "1" : "0"));
  }
  // Wide tiles with half tiles (forced: the rule takes half tiles instead), so a wide tile
  // of at most 64 rows gives each warpgroup one block (`split`): 65-75 rows an expert (a rank
  // picks its tiles from its count times R; 128-token tiles from 60 rows on 16 local experts,
  // 48 on a card reading at least 30 GB/s a SM: heuristics.h kTile128MinAvgRowsFewExperts*).
  const ScopedSwitch half_wide(&kernels::Overrides::wide_tiles, true);
  expect_matches_one_device(w, {300, 260}, 1250, "half_tiles wide_tiles", "split wide tiles");
}

// Two layers of a model on one group (EpLayerOptions::share): the second costs its
// weights only. Alternating eager forwards and one captured graph of both give each
// layer's single-device bytes (the shared epoch counts every forward); the group
// outlives the layer that made it; other options or shapes are refused. The second layer
// is made after the first has run, and the token counts change from forward to forward:
// had the second layer's plan reset the shared epoch, the next forward's waits would pass
// on the signals of the one before and read its counts.
TEST_F(EpForward, LayersShareOneGroup) {
  const MoeShape s = reduced_shape();
  const HostMoeWeights wa = make_random_weights(s, 71), wb = make_random_weights(s, 72);
  const int R = 4, Tmax = 48;
  REQUIRE_RANKS(R);
  const std::vector<int> full(R, Tmax), ta = {13, 0, 48, 5}, tb = {40, 9, 0, 31};
  const auto xs = rank_inputs(s, full, 800);
  auto single = [&](const HostMoeWeights& w, const std::vector<int>& t) {
    return single_device(w, first_rows(xs, t, s.hidden), t);
  };
  const auto want_a = single(wa, ta), want_a2 = single(wa, tb), want_b = single(wb, tb),
             want_b2 = single(wb, ta);
  ASSERT_NE(want_a, want_b2);
  const api::EpLayerOptions oa = ep_options(R, Tmax);
  auto a = std::make_unique<api::CudaEpMoeLayer>(wa, oa);
  RankBuffers buf(xs, *a);
  auto expect_bytes = [&](const std::vector<std::vector<num::bf16_t>>& want, const std::vector<int>& t,
                          const std::string& what) {
    const auto got = buf.read(t, s.hidden);
    for (int r = 0; r < R; ++r)
      EXPECT_EQ(0, std::memcmp(got[r].data(), want[r].data(), got[r].size() * 2)) << what << " rank " << r;
  };
  buf.poison();
  a->forward(buf.x, buf.y, ta, nullptr);
  ASSERT_NO_THROW(a->check());
  expect_bytes(want_a, ta, "layer a alone");
  api::EpLayerOptions ob = oa;
  ob.share = a.get();
  api::CudaEpMoeLayer b(wb, ob);
  {
    api::EpLayerOptions bad = ob;
    bad.max_tokens = Tmax + 16;
    EXPECT_THROW(api::CudaEpMoeLayer(wb, bad), std::invalid_argument);
    bad = ob;
    bad.ranks = 2;
    EXPECT_THROW(api::CudaEpMoeLayer(wb, bad), std::invalid_argument);
    bad = ob;
    bad.transport =
        bad.transport == api::EpTransport::kVirtual ? api::EpTransport::kNccl : api::EpTransport::kVirtual;
    EXPECT_THROW(api::CudaEpMoeLayer(wb, bad), std::invalid_argument);
    MoeShape s2 = s;
    s2.routed_scaling *= 2;
    EXPECT_THROW(api::CudaEpMoeLayer(make_random_weights(s2, 73), ob), std::invalid_argument);
  }
  for (int round = 0; round < 2; ++round) {
    const std::vector<int>& ka = round ? ta : tb;  // (a ran ta last)
    const std::vector<int>& kb = round ? tb : ta;
    buf.poison();
    a->forward(buf.x, buf.y, ka, nullptr);
    ASSERT_NO_THROW(a->check());
    expect_bytes(round ? want_a : want_a2, ka, "layer a, round " + std::to_string(round));
    buf.poison();
    b.forward(buf.x, buf.y, kb, nullptr);
    ASSERT_NO_THROW(b.check());
    expect_bytes(round ? want_b : want_b2, kb, "layer b, round " + std::to_string(round));
  }
  // One graph: layer a into y2, then layer b into y (a model's two layers in a row).
  RankBuffers buf2(xs, b);
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  a->forward(buf.x, buf2.y, ta, st);
  b.forward(buf.x, buf.y, tb, st);
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    buf.poison();
    buf2.poison();
    CK(cudaGraphLaunch(exec, st));
    CK(cudaStreamSynchronize(st));
    ASSERT_NO_THROW(b.check());
    expect_bytes(want_b, tb, "graph: layer b, replay " + std::to_string(rep));
    const auto got_a = buf2.read(ta, s.hidden);
    for (int r = 0; r < R; ++r)
      EXPECT_EQ(0, std::memcmp(got_a[r].data(), want_a[r].data(), got_a[r].size() * 2))
          << "graph: layer a, replay " << rep << " rank " << r;
  }
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(st));
  int before = -1, after = -1;
  CK(cudaGetDevice(&before));
  a.reset();  // the group stays with b
  CK(cudaGetDevice(&after));
  EXPECT_EQ(before, after) << "destroying a layer changed the current device";
  buf.poison();
  b.forward(buf.x, buf.y, ta, nullptr);
  ASSERT_NO_THROW(b.check());
  expect_bytes(want_b2, ta, "layer b after layer a is gone");
}

}  // namespace
}  // namespace megamoe
