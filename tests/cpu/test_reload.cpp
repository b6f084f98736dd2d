// In-place reload (docs/numerics.md §9): both modes byte-identical with stable addresses,
// layerwise readiness, and a reload of other weights changing the outputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "megamoe/api/forward.h"
#include "megamoe/reference/moe.h"
#include "megamoe/weights/checkpoint_layout.h"
#include "megamoe/weights/store.h"
#include "store_support.h"
#include "support.h"

namespace megamoe {
namespace {

using test::TempDir;

std::vector<uint8_t> alloc_bytes(const WeightStore& st, int L) {
  std::vector<uint8_t> b(st.allocation_bytes(L));
  st.read_bytes(L, 0, b.size(), b.data());
  return b;
}

// The CPU backend's forward (kernel-faithful reference) on the store's live buffer.
std::vector<float> forward_live(const WeightStore& st, int L, const std::vector<num::bf16_t>& x, int T) {
  const MoeShape& s = st.shape(L);
  std::vector<int32_t> ids(size_t(T) * s.topk);
  std::vector<float> w(ids.size()), y(size_t(T) * s.hidden);
  ref::route(s, st.host_view(L), x.data(), T, ids.data(), w.data());
  ref::moe_layer(s, st.host_view(L), x.data(), T, ids.data(), w.data(), ref::Mode::kKernelFaithful, y.data());
  return y;
}

class Reload : public ::testing::TestWithParam<std::tuple<ReloadMode, KernelFormat>> {};

TEST_P(Reload, ByteIdenticalWithStableAddresses) {
  const auto [mode, format] = GetParam();
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 2, 31);
  const io::Checkpoint ck(dir.path());
  WeightStoreOptions o;
  o.kernel_format = format;
  WeightStore st = WeightStore::for_checkpoint(ck, d, o);
  testing::internal::CaptureStderr();  // the one non-pow2 warning of the MXFP8 case
  st.load(ck);
  const int T = 8;
  const auto x = test::random_bf16(size_t(T) * d.shape.hidden, 4);
  std::vector<const void*> base, mx;
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<std::vector<float>> y;
  for (int L : st.layers()) {
    base.push_back(st.base(L)), mx.push_back(st.mxfp8_base(L));
    bytes.push_back(alloc_bytes(st, L));
    y.push_back(forward_live(st, L, x, T));
  }
  for (int L : st.layers()) {
    st.zero_experts(L);
    EXPECT_FALSE(st.ready(L));
  }
  EXPECT_NE(alloc_bytes(st, st.layers()[0]), bytes[0]);

  LoadOptions lo;
  lo.mode = mode, lo.shuffle = true, lo.seed = 9;
  st.load(ck, lo);
  testing::internal::GetCapturedStderr();
  for (size_t i = 0; i < st.layers().size(); ++i) {
    const int L = st.layers()[i];
    EXPECT_TRUE(st.ready(L));
    EXPECT_EQ(st.base(L), base[i]) << "layer " << L << " moved";
    EXPECT_EQ(st.mxfp8_base(L), mx[i]);
    EXPECT_TRUE(alloc_bytes(st, L) == bytes[i]) << "layer " << L << " not byte-identical";
    EXPECT_TRUE(test::same_bytes(forward_live(st, L, x, T), y[i], d.shape.hidden));
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, Reload,
                         ::testing::Combine(::testing::Values(ReloadMode::kLayerwise, ReloadMode::kDirect),
                                            ::testing::Values(KernelFormat::kBlockFp8Hopper,
                                                              KernelFormat::kMxfp8Blackwell)),
                         [](const auto& info) {
                           return std::string(to_string(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) == KernelFormat::kMxfp8Blackwell ? "_mxfp8"
                                                                                            : "_hopper");
                         });

// Layerwise: a layer stops being ready at its first update and is processed
// the moment its last checkpoint tensor lands (the MXFP8 copy, derived, is
// not waited for); direct mode never withdraws readiness.
TEST(ReloadModes, ReadinessFollowsTheMode) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 2, 32, true);
  const io::Checkpoint ck(dir.path());
  WeightStoreOptions o;
  o.kernel_format = KernelFormat::kMxfp8Blackwell;
  WeightStore st = WeightStore::for_checkpoint(ck, d, o);
  st.load(ck);
  const int L0 = d.moe_layers[0], L1 = d.moe_layers[1];
  const auto l0 = ck.names_with_prefix(d.layer_prefix(L0));

  st.begin(ReloadMode::kLayerwise);
  st.update(ck.lookup(l0[0]));
  EXPECT_FALSE(st.ready(L0));
  EXPECT_TRUE(st.ready(L1));  // untouched layers stay servable
  for (size_t i = 1; i + 1 < l0.size(); ++i) st.update(ck.lookup(l0[i]));
  EXPECT_FALSE(st.ready(L0));
  st.update(ck.lookup(l0.back()));
  EXPECT_TRUE(st.ready(L0));  // before finish(): processed on arrival
  const FinishReport r = st.finish();
  EXPECT_EQ(r.layers_processed, 1);
  EXPECT_EQ(st.mxfp8_report(L0).rel_l2, 0.0);

  st.begin(ReloadMode::kDirect);
  st.update(ck.lookup(l0[0]));
  EXPECT_TRUE(st.ready(L0));
  ASSERT_EQ(l0[1], l0[0] + "_scale_inv");  // sorted names: a weight, then its scale
  st.update(ck.lookup(l0[1]));
  EXPECT_TRUE(st.ready(L0));
  st.finish();
}

TEST(ReloadModes, LayerwiseIncompleteLayerFailsNamingTheMissingTensors) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 1, 33);
  const io::Checkpoint ck(dir.path());
  WeightStore st = WeightStore::for_checkpoint(ck, d);
  st.load(ck);
  const int L = d.moe_layers[0];
  const std::string p = d.layer_prefix(L);
  // A complete pair of expert 2 only: fine in direct mode (a partial push)...
  st.begin(ReloadMode::kDirect);
  st.update(ck.lookup(p + "experts.2.down_proj.weight"));
  st.update(ck.lookup(p + "experts.2.down_proj.weight_scale_inv"));
  EXPECT_NO_THROW(st.finish());
  EXPECT_TRUE(st.ready(L));
  // ...but layerwise requires the whole layer.
  st.begin(ReloadMode::kLayerwise);
  st.update(ck.lookup(p + "experts.2.down_proj.weight"));
  st.update(ck.lookup(p + "experts.2.down_proj.weight_scale_inv"));
  try {
    st.finish();
    FAIL() << "layerwise finish accepted an incomplete layer";
  } catch (const io::NotFoundError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("layer incomplete"), std::string::npos) << m;
    EXPECT_NE(m.find(p + "experts.0.gate_proj.weight"), std::string::npos) << m;
  }
  EXPECT_FALSE(st.ready(L));
}

TEST(ReloadModes, DifferentWeightsChangeOutputsAccordingly) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path() / "a", 1, 41);
  test::write_test_checkpoint(dir.path() / "b", 1, 977);
  const io::Checkpoint a(dir.path() / "a"), b(dir.path() / "b");
  const int L = d.moe_layers[0], T = 6;
  const auto x = test::random_bf16(size_t(T) * d.shape.hidden, 8);

  // What each checkpoint gives through the public CPU forward.
  const auto y_of = [&](const HostMoeWeights& w) {
    const api::ForwardOutput out = api::forward(api::Backend::kCpu, w, x.data(), T);
    std::vector<float> y(out.y.size());
    for (size_t i = 0; i < y.size(); ++i) y[i] = num::bf16_decode(out.y[i]);
    return y;
  };
  const auto ya = y_of(load_moe_layer(a, d, L)), yb = y_of(load_moe_layer(b, d, L));
  ASSERT_GT(test::rel_l2(ya, yb), 0.1);

  for (auto mode : {ReloadMode::kLayerwise, ReloadMode::kDirect}) {
    WeightStore st = WeightStore::for_checkpoint(a, d);
    st.load(a);
    const void* base = st.base(L);
    EXPECT_TRUE(test::same_bytes(y_of(st.to_host(L)), ya, d.shape.hidden));
    LoadOptions lo;
    lo.mode = mode, lo.shuffle = true;
    st.load(b, lo);
    EXPECT_EQ(st.base(L), base);
    EXPECT_TRUE(test::same_bytes(y_of(st.to_host(L)), yb, d.shape.hidden)) << to_string(mode);
    st.load(a);
    EXPECT_TRUE(test::same_bytes(y_of(st.to_host(L)), ya, d.shape.hidden)) << to_string(mode);
  }
}

}  // namespace
}  // namespace megamoe
