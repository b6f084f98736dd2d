// GPU tests of CudaMoeLayer::forward on the caller's routing (RoutingInput: route_external
// in place of the router) and of the layer over caller-owned weight regions (a
// MoeWeightsView of separate device allocations). Skipped without an sm_90 device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/kernels/overrides.h"
#include "megamoe/reference/moe.h"
#include "megamoe/weights/host_weights.h"

namespace megamoe {
namespace {

using testutil::have_device;
using testutil::random_x;
using testutil::reduced_shape;

#define CK(call) ASSERT_EQ((call), cudaSuccess) << #call

// A device allocation freed on scope exit.
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t n) : bytes(std::max<size_t>(n, 16)) {
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
  }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
  void upload(const void* src, size_t n) {
    EXPECT_EQ(cudaMemcpy(p, src, n, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void poison() { EXPECT_EQ(cudaMemset(p, 0xFF, bytes), cudaSuccess); }  // bf16 NaN, id -1
};

// A second shape unlike the reduced one: no shared expert (shared_* and their rows absent),
// no correction bias, a BF16 router, softmax scores, odd K-block counts (H 1152, I 384).
MoeShape plain_shape() {
  MoeShape s = testutil::odd_blocks_shape();
  s.shared_experts = 0, s.correction_bias = false, s.router_dtype = RouterDtype::kBF16;
  s.score = ScoreFunc::kSoftmax, s.routed_scaling = 1.0f;
  return s;
}

// Routing on the host: ids [T][K] and weights [T][K].
struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> w;
  std::vector<int64_t> ids64() const { return {ids.begin(), ids.end()}; }
};

// Distinct ids per token from [lo, E), weights uniform in [0.05, 1.5); skew >= 0: that expert
// takes a random slot of about 90% of the tokens.
Routing random_routing(const MoeShape& s, int T, uint64_t seed, int skew = -1, int lo = 0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> wd(0.05f, 1.5f);
  Routing r;
  r.ids.resize(size_t(T) * s.topk);
  r.w.resize(r.ids.size());
  std::vector<int32_t> pool(s.experts - lo);
  for (int t = 0; t < T; ++t) {
    std::iota(pool.begin(), pool.end(), lo);
    std::shuffle(pool.begin(), pool.end(), rng);
    if (skew >= 0 && rng() % 10 != 0) {
      const auto at = std::find(pool.begin(), pool.end(), skew);
      std::swap(*at, pool[rng() % s.topk]);
    }
    for (int k = 0; k < s.topk; ++k) {
      r.ids[size_t(t) * s.topk + k] = pool[k];
      r.w[size_t(t) * s.topk + k] = wd(rng);
    }
  }
  return r;
}

// The caller's routing in device memory, int32 and int64 ids.
struct DevRouting {
  DevBuf ids32, ids64, w;
  explicit DevRouting(const Routing& r)
      : ids32(r.ids.size() * 4), ids64(r.ids.size() * 8), w(r.w.size() * 4) {
    ids32.upload(r.ids.data(), r.ids.size() * 4);
    const std::vector<int64_t> l = r.ids64();
    ids64.upload(l.data(), l.size() * 8);
    w.upload(r.w.data(), r.w.size() * 4);
  }
  api::RoutingInput input(int id_bytes) const {
    api::RoutingInput in;
    in.ids = id_bytes == 8 ? ids64.p : ids32.p;
    in.id_bytes = id_bytes;
    in.weights = w.as<float>();
    return in;
  }
};

std::vector<num::bf16_t> download_y(const DevBuf& y, size_t n) {
  std::vector<num::bf16_t> h(n);
  if (n) {
    EXPECT_EQ(cudaMemcpy(h.data(), y.p, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return h;
}

// The layer's own forward at T (y poisoned first): y and its routing.
struct OwnRun {
  std::vector<num::bf16_t> y;
  Routing r;
};
OwnRun own_forward(api::CudaMoeLayer& layer, const DevBuf& x, DevBuf& y, int T) {
  const MoeShape& s = layer.shape();
  y.poison();
  layer.forward(x.as<num::bf16_t>(), y.as<num::bf16_t>(), T, nullptr, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  OwnRun o;
  o.y = download_y(y, size_t(T) * s.hidden);
  o.r.ids.resize(size_t(T) * s.topk);
  o.r.w.resize(o.r.ids.size());
  if (T > 0) {
    EXPECT_EQ(cudaMemcpy(o.r.ids.data(), layer.topk_ids(), o.r.ids.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpy(o.r.w.data(), layer.topk_weights(), o.r.w.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  return o;
}

std::vector<num::bf16_t> external_forward(api::CudaMoeLayer& layer, const DevBuf& x, DevBuf& y, int T,
                                          const api::RoutingInput& in, const int* count = nullptr) {
  y.poison();
  layer.forward(x.as<num::bf16_t>(), y.as<num::bf16_t>(), T, count, nullptr, in);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return download_y(y, size_t(T) * layer.shape().hidden);
}

// Outputs whose value is not the reference's (NaN never equal), and the first one.
struct Diff {
  int64_t differ = 0;
  std::string first;
};
Diff diff(const std::vector<num::bf16_t>& y, const std::vector<float>& ref, int H) {
  Diff d;
  for (size_t i = 0; i < ref.size(); ++i) {
    const float a = num::bf16_decode(y[i]);
    if (!(a == ref[i]) && d.differ++ == 0)
      d.first = "token " + std::to_string(i / H) + " col " + std::to_string(i % H) + ": got " +
                std::to_string(a) + " want " + std::to_string(ref[i]);
  }
  return d;
}

std::vector<float> reference(const MoeShape& s, const HostMoeWeights& w, const std::vector<num::bf16_t>& x,
                             int T, const Routing& r) {
  std::vector<float> y(size_t(T) * s.hidden);
  ref::moe_layer(s, w.view(), x.data(), T, r.ids.data(), r.w.data(), ref::Mode::kKernelFaithful, y.data());
  return y;
}

class ExternalRouting : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_device()) GTEST_SKIP() << "no sm_90 device";
  }
};

// (a) The layer's own ids and weights handed back as the caller's give the layer's bytes,
// int32 and int64 ids, eager at several T and from a graph captured at a larger hint and
// replayed with smaller device counts (route_external as the fused kernel's programmatic
// predecessor and not).
TEST_F(ExternalRouting, OwnRoutingGivesTheSameBytes) {
  const int Tmax = 1000;
  for (const MoeShape& s : {reduced_shape(), plain_shape()}) {
    SCOPED_TRACE(s.describe());
    const HostMoeWeights w = make_random_weights(s, 11);
    const auto x = random_x(size_t(Tmax) * s.hidden, 12);
    api::MoeLayerOptions opt;
    opt.max_tokens = Tmax;
    api::CudaMoeLayer layer(w, opt);
    DevBuf dx(x.size() * 2), dy(x.size() * 2);
    dx.upload(x.data(), x.size() * 2);
    for (int T : {1, 7, 64, 300, 1000}) {
      const OwnRun own = own_forward(layer, dx, dy, T);
      const DevRouting dr(own.r);
      for (int id_bytes : {4, 8}) {
        SCOPED_TRACE("T=" + std::to_string(T) + " id_bytes=" + std::to_string(id_bytes));
        const auto y = external_forward(layer, dx, dy, T, dr.input(id_bytes));
        EXPECT_EQ(0, std::memcmp(y.data(), own.y.data(), y.size() * 2)) << "y differs from the own forward's";
      }
    }
    ASSERT_NO_THROW(layer.check());

    // The graph: captured at Tmax on the routing of Tmax tokens; a replay at T reads its
    // first T rows, which are the routing of the first T tokens.
    const OwnRun full = own_forward(layer, dx, dy, Tmax);
    const DevRouting dr(full.r);
    DevBuf dT(sizeof(int));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));  // (blocking: ordered after the legacy stream's poison and copies)
    for (const char* pdl : {"1", "0"}) {
      for (int id_bytes : {4, 8}) {
        std::optional<kernels::ScopedOverrides> launch;  // the capture's programmatic_launch
        {
          kernels::Overrides o = kernels::overrides();
          o.programmatic_launch = pdl[0] == '1';
          launch.emplace(o);
        }
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        layer.forward(dx.as<num::bf16_t>(), dy.as<num::bf16_t>(), Tmax, dT.as<int>(), st, dr.input(id_bytes));
        CK(cudaStreamEndCapture(st, &graph));
        CK(cudaGraphInstantiate(&exec, graph, 0));
        launch.reset();
        for (int T : {300, 7, 1000, 0, 1, 64}) {
          SCOPED_TRACE("graph at " + std::to_string(Tmax) + ", replay T=" + std::to_string(T) +
                       " programmatic_launch=" + pdl + " id_bytes=" + std::to_string(id_bytes));
          const OwnRun own = own_forward(layer, dx, dy, T);
          CK(cudaMemcpy(dT.p, &T, sizeof(int), cudaMemcpyHostToDevice));
          dy.poison();
          CK(cudaGraphLaunch(exec, st));
          CK(cudaStreamSynchronize(st));
          const auto y = download_y(dy, size_t(Tmax) * s.hidden);
          EXPECT_EQ(0, std::memcmp(y.data(), own.y.data(), own.y.size() * 2)) << "rows below T";
          size_t written = 0;
          for (size_t i = own.y.size(); i < y.size(); ++i) written += y[i] != 0xFFFF;
          EXPECT_EQ(written, 0u) << "outputs written past the device count";
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      }
    }
    cudaStreamDestroy(st);
    ASSERT_NO_THROW(layer.check());
  }
}

// (b) Routing no router would give (random distinct ids, random positive weights, one
// expert taking most rows) against the kernel-faithful reference on the same routing: the
// reference's bits.
TEST_F(ExternalRouting, RandomRoutingMatchesTheReference) {
  const int Tmax = 1000;
  for (const MoeShape& s : {reduced_shape(), plain_shape()}) {
    const HostMoeWeights w = make_random_weights(s, 21);
    const auto x = random_x(size_t(Tmax) * s.hidden, 22);
    api::MoeLayerOptions opt;
    opt.max_tokens = Tmax;
    api::CudaMoeLayer layer(w, opt);
    DevBuf dx(x.size() * 2), dy(x.size() * 2);
    dx.upload(x.data(), x.size() * 2);
    struct Case {
      int T, skew, id_bytes;
    };
    for (const Case c : {Case{1, -1, 4}, Case{7, -1, 8}, Case{64, 5, 4}, Case{300, -1, 8}, Case{1000, 3, 8},
                         Case{1000, -1, 4}}) {
      SCOPED_TRACE(s.describe() + " T=" + std::to_string(c.T) + " skew=" + std::to_string(c.skew) +
                   " id_bytes=" + std::to_string(c.id_bytes));
      const Routing r = random_routing(s, c.T, 1000 + c.T + c.skew, c.skew);
      const DevRouting dr(r);
      const auto y = external_forward(layer, dx, dy, c.T, dr.input(c.id_bytes));
      const std::vector<num::bf16_t> xt(x.begin(), x.begin() + size_t(c.T) * s.hidden);
      const Diff d = diff(y, reference(s, w, xt, c.T, r), s.hidden);
      std::printf("  %s T=%d skew=%d: differ %lld / %zu, config %s\n", s.describe().c_str(), c.T, c.skew,
                  (long long)d.differ, y.size(), layer.config_for(c.T).c_str());
      EXPECT_EQ(d.differ, 0) << d.first;
      // The routing outputs are the caller's (a routing the layer's router never made).
      std::vector<int32_t> ids(r.ids.size());
      std::vector<float> wts(r.w.size());
      CK(cudaMemcpy(ids.data(), layer.topk_ids(), ids.size() * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(wts.data(), layer.topk_weights(), wts.size() * 4, cudaMemcpyDeviceToHost));
      EXPECT_EQ(ids, r.ids) << "topk_ids() after the external forward";
      EXPECT_EQ(0, std::memcmp(wts.data(), r.w.data(), wts.size() * 4)) << "topk_weights()";
    }
    ASSERT_NO_THROW(layer.check());
  }
}

// (c) An id outside [0, E) is computed as expert 0 at weight 0 (the other slots and tokens
// as usual), and check() reports it once; ids of tokens past the device count are not read.
TEST_F(ExternalRouting, BadIdsAreReportedAndAddNothing) {
  const MoeShape s = reduced_shape();  // E = 32, K = 4
  const int T = 64;
  const HostMoeWeights w = make_random_weights(s, 31);
  const auto x = random_x(size_t(T) * s.hidden, 32);
  api::MoeLayerOptions opt;
  opt.max_tokens = T;
  api::CudaMoeLayer layer(w, opt);
  DevBuf dx(x.size() * 2), dy(x.size() * 2), dT(sizeof(int));
  dx.upload(x.data(), x.size() * 2);
  // Ids from 1 on, so a bad slot's expert 0 is no other slot's expert.
  const Routing good = random_routing(s, T, 33, -1, 1);
  for (int id_bytes : {4, 8}) {
    SCOPED_TRACE("id_bytes=" + std::to_string(id_bytes));
    Routing bad = good;
    std::vector<int64_t> ids64 = good.ids64();
    const int64_t first = id_bytes == 8 ? int64_t(1) << 40 : 300;
    auto set = [&](int t, int k, int64_t v) {
      ids64[size_t(t) * s.topk + k] = v;
      bad.ids[size_t(t) * s.topk + k] = int32_t(v);
    };
    set(5, 2, first);
    set(9, 0, -7);
    set(40, 3, s.experts);
    DevRouting dr(bad);
    dr.ids64.upload(ids64.data(), ids64.size() * 8);
    const auto y = external_forward(layer, dx, dy, T, dr.input(id_bytes));
    // The reference on the routing the kernel computes: each bad slot expert 0 at weight 0.
    Routing as_run = bad;
    for (size_t i = 0; i < ids64.size(); ++i)
      if (ids64[i] < 0 || ids64[i] >= s.experts) as_run.ids[i] = 0, as_run.w[i] = 0.0f;
    const Diff d = diff(y, reference(s, w, x, T, as_run), s.hidden);
    EXPECT_EQ(d.differ, 0) << d.first;
    // The tokens without a bad slot are the good routing's.
    const std::vector<float> want = reference(s, w, x, T, good);
    for (int t = 0; t < T; ++t) {
      if (t == 5 || t == 9 || t == 40) continue;
      for (int h = 0; h < s.hidden; ++h) {
        const size_t i = size_t(t) * s.hidden + h;
        ASSERT_EQ(num::bf16_decode(y[i]), want[i]) << "token " << t << " col " << h;
      }
    }
    std::vector<int32_t> ids(bad.ids.size());
    CK(cudaMemcpy(ids.data(), layer.topk_ids(), ids.size() * 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(ids, as_run.ids) << "topk_ids(): a bad id as expert 0";
    try {
      layer.check();
      ADD_FAILURE() << "check() did not report the bad ids";
    } catch (const std::runtime_error& e) {
      const std::string m = e.what();
      const std::string want_msg =
          "topk_ids: 3 ids outside [0, 32) (the first: token 5 slot 2 = " + std::to_string(first) + ")";
      EXPECT_NE(m.find(want_msg), std::string::npos) << m;
    }
    EXPECT_NO_THROW(layer.check()) << "reported once, then cleared";

    // A device count of 20 tokens: the bad ids at tokens 40 (and none else past it) are not
    // read; tokens 5 and 9 are, across two forwards (the record keeps the first).
    const int count = 20;
    CK(cudaMemcpy(dT.p, &count, sizeof(int), cudaMemcpyHostToDevice));
    external_forward(layer, dx, dy, T, dr.input(id_bytes), dT.as<int>());
    external_forward(layer, dx, dy, T, dr.input(id_bytes), dT.as<int>());
    try {
      layer.check();
      ADD_FAILURE() << "check() did not report the bad ids";
    } catch (const std::runtime_error& e) {
      const std::string m = e.what();
      EXPECT_NE(
          m.find("topk_ids: 4 ids outside [0, 32) (the first: token 5 slot 2 = " + std::to_string(first)),
          std::string::npos)
          << m;
    }
    EXPECT_NO_THROW(layer.check());
  }
}

TEST_F(ExternalRouting, BadHostArgumentsThrow) {
  const MoeShape s = reduced_shape();
  constexpr int T = 8;
  const HostMoeWeights w = make_random_weights(s, 41);
  const auto x = random_x(size_t(T) * s.hidden, 42);
  api::MoeLayerOptions opt;
  opt.max_tokens = T;
  api::CudaMoeLayer layer(w, opt);
  DevBuf dx(x.size() * 2), dy(x.size() * 2);
  dx.upload(x.data(), x.size() * 2);
  const Routing r = random_routing(s, T, 43);
  const DevRouting dr(r);
  auto fwd = [&](const api::RoutingInput& in, int hint) {
    layer.forward(dx.as<num::bf16_t>(), dy.as<num::bf16_t>(), hint, nullptr, nullptr, in);
  };
  auto expect_invalid = [&](const api::RoutingInput& in, const char* needle) {
    try {
      fwd(in, T);
      ADD_FAILURE() << "no exception (" << needle << ")";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  api::RoutingInput in = dr.input(4);
  in.ids = nullptr;
  expect_invalid(in, "routing.ids");
  in = dr.input(4);
  in.weights = nullptr;
  expect_invalid(in, "routing.weights");
  for (int bytes : {0, 2, 16}) {
    in = dr.input(4);
    in.id_bytes = bytes;
    expect_invalid(in, "id_bytes");
  }
  in = dr.input(4);
  in.ids = r.ids.data();  // host memory
  expect_invalid(in, "routing.ids");
  in = dr.input(4);
  in.weights = r.w.data();
  expect_invalid(in, "routing.weights");
  in = dr.input(8);
  in.ids = dr.ids64.as<uint8_t>() + 4;  // int64 ids 4 bytes off
  expect_invalid(in, "routing.ids");
  // Zero tokens read no routing: null pointers are fine there.
  api::RoutingInput none;
  EXPECT_NO_THROW(fwd(none, 0));
  CK(cudaDeviceSynchronize());
  EXPECT_NO_THROW(layer.check());
  // Nothing launched by the refused calls: the layer still computes.
  const auto y = external_forward(layer, dx, dy, T, dr.input(4));
  const Diff d = diff(y, reference(s, w, x, T, r), s.hidden);
  EXPECT_EQ(d.differ, 0) << d.first;
}

// (d) The layer over separate device regions (as an engine holds the checkpoint's tensors).
struct RegionBufs {
  std::vector<std::unique_ptr<DevBuf>> bufs;
  MoeWeightsView view;
};
RegionBufs upload_regions(const HostMoeWeights& w) {
  RegionBufs rb;
  const MoeWeightLayout& l = w.layout;
  auto put = [&](const Region& r) -> const uint8_t* {
    if (!r.bytes) return nullptr;
    rb.bufs.push_back(std::make_unique<DevBuf>(r.bytes));
    rb.bufs.back()->upload(w.data() + r.offset, r.bytes);
    return rb.bufs.back()->as<uint8_t>();
  };
  MoeWeightsView& v = rb.view;
  v.w13 = put(l.w13);
  v.w13_scale = reinterpret_cast<const float*>(put(l.w13_scale));
  v.w2 = put(l.w2);
  v.w2_scale = reinterpret_cast<const float*>(put(l.w2_scale));
  v.shared_w13 = put(l.shared_w13);
  v.shared_w13_scale = reinterpret_cast<const float*>(put(l.shared_w13_scale));
  v.shared_w2 = put(l.shared_w2);
  v.shared_w2_scale = reinterpret_cast<const float*>(put(l.shared_w2_scale));
  v.router = put(l.router);
  v.bias = reinterpret_cast<const float*>(put(l.bias));
  return rb;
}

TEST_F(ExternalRouting, LayerOverSeparateRegions) {
  const int Tmax = 300;
  for (const MoeShape& s : {reduced_shape(), plain_shape()}) {
    SCOPED_TRACE(s.describe());
    const HostMoeWeights w = make_random_weights(s, 51);
    const auto x = random_x(size_t(Tmax) * s.hidden, 52);
    api::MoeLayerOptions opt;
    opt.max_tokens = Tmax;
    api::CudaMoeLayer owner(w, opt);
    const RegionBufs rb = upload_regions(w);
    api::CudaMoeLayer borrower(s, rb.view, opt);
    EXPECT_EQ(borrower.device_weights(), static_cast<const void*>(rb.view.w13));
    DevBuf dx(x.size() * 2), dy(x.size() * 2);
    dx.upload(x.data(), x.size() * 2);
    for (int T : {1, 64, 300}) {
      SCOPED_TRACE("T=" + std::to_string(T));
      const OwnRun a = own_forward(owner, dx, dy, T);
      const OwnRun b = own_forward(borrower, dx, dy, T);
      EXPECT_EQ(0, std::memcmp(a.y.data(), b.y.data(), a.y.size() * 2)) << "y";
      EXPECT_EQ(a.r.ids, b.r.ids) << "routing ids";
      // The same on external routing.
      const DevRouting dr(a.r);
      const auto ye = external_forward(borrower, dx, dy, T, dr.input(8));
      EXPECT_EQ(0, std::memcmp(a.y.data(), ye.data(), a.y.size() * 2)) << "y on external routing";
    }
    {
      // Scales and bias read as floats: 4-byte aligned ones are taken (a slice of a larger tensor).
      const MoeWeightLayout& l = w.layout;
      DevBuf w13s(l.w13_scale.bytes + 16), w2s(l.w2_scale.bytes + 16);
      MoeWeightsView v = rb.view;
      CK(cudaMemcpy(w13s.as<uint8_t>() + 4, w.data() + l.w13_scale.offset, l.w13_scale.bytes,
                    cudaMemcpyHostToDevice));
      CK(cudaMemcpy(w2s.as<uint8_t>() + 12, w.data() + l.w2_scale.offset, l.w2_scale.bytes,
                    cudaMemcpyHostToDevice));
      v.w13_scale = reinterpret_cast<const float*>(w13s.as<uint8_t>() + 4);
      v.w2_scale = reinterpret_cast<const float*>(w2s.as<uint8_t>() + 12);
      api::CudaMoeLayer sliced(s, v, opt);
      const OwnRun a = own_forward(owner, dx, dy, 64);
      const OwnRun b = own_forward(sliced, dx, dy, 64);
      EXPECT_EQ(0, std::memcmp(a.y.data(), b.y.data(), a.y.size() * 2)) << "y with 4-byte aligned scales";
    }
    // Rewritten in place between forwards: the layer reads the new weights.
    const HostMoeWeights w2 = make_random_weights(s, 53);
    const RegionBufs rb2 = upload_regions(w2);
    for (size_t i = 0; i < rb.bufs.size(); ++i)
      CK(cudaMemcpy(rb.bufs[i]->p, rb2.bufs[i]->p, rb.bufs[i]->bytes, cudaMemcpyDeviceToDevice));
    api::CudaMoeLayer owner2(w2, opt);
    const OwnRun a = own_forward(owner2, dx, dy, 64);
    const OwnRun b = own_forward(borrower, dx, dy, 64);
    EXPECT_EQ(0, std::memcmp(a.y.data(), b.y.data(), a.y.size() * 2)) << "y after the rewrite";
    ASSERT_NO_THROW(borrower.check());

    // Bad views: each names its region.
    auto expect_invalid = [&](const MoeWeightsView& v, const char* needle) {
      try {
        api::CudaMoeLayer bad(s, v, opt);
        ADD_FAILURE() << "no exception (" << needle << ")";
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    MoeWeightsView v = rb.view;
    v.w13 = nullptr;
    expect_invalid(v, "w13");
    v = rb.view;
    v.w2_scale = nullptr;
    expect_invalid(v, "w2_scale");
    v = rb.view;
    v.w2 = rb.view.w2 + 8;  // 8-byte aligned only
    expect_invalid(v, "w2");
    v = rb.view;
    v.w13_scale = reinterpret_cast<const float*>(rb.view.w13 + 2);  // not float-aligned
    expect_invalid(v, "w13_scale");
    v = rb.view;
    v.router = w.view().router;  // host memory
    expect_invalid(v, "router");
    v = rb.view;
    if (s.has_shared()) {
      v.shared_w2 = nullptr;
      expect_invalid(v, "shared_w2");
    } else {
      v.shared_w13 = rb.view.w13;  // a region the shape does not have
      expect_invalid(v, "shared_w13");
    }
    v = rb.view;
    if (s.correction_bias) {
      v.bias = nullptr;
      expect_invalid(v, "bias");
    } else {
      v.bias = rb.view.w2_scale;
      expect_invalid(v, "bias");
    }
  }
}

}  // namespace
}  // namespace megamoe
