// api::CpuMoeLayer: the CPU backend's layer object against the reference it wraps (bytes),
// its rules (token bound, external routing, empty batch, non-finite tokens), a store's layer
// followed across reloads; and WeightStore's update of several tensors as one step (a
// refused call writes nothing).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "megamoe/api/moe_layer.h"
#include "megamoe/io/safetensors.h"
#include "megamoe/reference/moe.h"
#include "megamoe/weights/store.h"
#include "store_support.h"
#include "support.h"

namespace megamoe {
namespace {

std::vector<num::bf16_t> reference_y(const MoeShape& s, const MoeWeightsView& w,
                                     const std::vector<num::bf16_t>& x, int T,
                                     std::vector<int32_t>* ids_out = nullptr) {
  std::vector<int32_t> ids(size_t(T) * s.topk);
  std::vector<float> wts(ids.size()), y(size_t(T) * s.hidden);
  ref::route(s, w, x.data(), T, ids.data(), wts.data());
  ref::moe_layer(s, w, x.data(), T, ids.data(), wts.data(), ref::Mode::kKernelFaithful, y.data());
  std::vector<num::bf16_t> yb(y.size());
  for (size_t i = 0; i < y.size(); ++i) yb[i] = num::bf16_encode(y[i]);
  if (ids_out) *ids_out = ids;
  return yb;
}

api::MoeLayerOptions opts(int max_tokens) {
  api::MoeLayerOptions o;
  o.max_tokens = max_tokens;
  return o;
}

TEST(CpuLayer, ForwardIsTheReferenceBytes) {
  const MoeShape s = test::small_glm_shape();
  const HostMoeWeights w = make_random_weights(s, 41);
  const int T = 19;
  const auto x = test::random_bf16(size_t(T) * s.hidden, 42);
  std::vector<int32_t> ids;
  const auto want = reference_y(s, w.view(), x, T, &ids);
  api::CpuMoeLayer owned(w, opts(32)), borrowed(s, w.view(), opts(32)), at_base(s, w.data(), opts(32));
  for (api::CpuMoeLayer* l : {&owned, &borrowed, &at_base}) {
    std::vector<num::bf16_t> y(want.size(), num::bf16_encode(NAN));  // poisoned
    l->forward(x.data(), y.data(), T);
    EXPECT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * 2));
    ASSERT_EQ(l->last_tokens(), T);
    EXPECT_EQ(0, std::memcmp(l->topk_ids(), ids.data(), ids.size() * 4));
  }
  // External routing: the layer's own ids and weights give its own bytes, int32 and int64.
  std::vector<float> wts(owned.topk_weights(), owned.topk_weights() + ids.size());
  std::vector<int64_t> ids64(ids.begin(), ids.end());
  for (int bytes : {4, 8}) {
    api::RoutingInput r;
    r.ids = bytes == 4 ? static_cast<const void*>(ids.data()) : ids64.data();
    r.id_bytes = bytes;
    r.weights = wts.data();
    std::vector<num::bf16_t> y(want.size(), num::bf16_encode(NAN));
    owned.forward(x.data(), y.data(), T, r);
    EXPECT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * 2)) << "id_bytes " << bytes;
  }
}

TEST(CpuLayer, RulesAndMessages) {
  const MoeShape s = test::small_glm_shape();
  const HostMoeWeights w = make_random_weights(s, 43);
  api::CpuMoeLayer l(w, opts(8));
  const auto x = test::random_bf16(size_t(9) * s.hidden, 44);
  std::vector<num::bf16_t> y(x.size());
  try {
    l.forward(x.data(), y.data(), 9);
    FAIL() << "9 tokens past max_tokens 8";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("9 tokens, more than the layer's max_tokens = 8"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(l.forward(x.data(), y.data(), -1), std::invalid_argument);
  std::vector<int32_t> ids(size_t(2) * s.topk, 0);
  std::vector<float> wts(ids.size(), 0.5f);
  ids[s.topk + 1] = s.experts;
  api::RoutingInput r{ids.data(), 4, wts.data()};
  try {
    l.forward(x.data(), y.data(), 2, r);
    FAIL() << "an id of E";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(
                  fmt::format("expected expert ids in [0, {}), found {} at [1, 1]", s.experts, s.experts)),
              std::string::npos)
        << e.what();
  }
  ids[s.topk + 1] = 0;
  wts[3] = NAN;
  EXPECT_THROW(l.forward(x.data(), y.data(), 2, r), std::invalid_argument);
  r.id_bytes = 2;
  EXPECT_THROW(l.forward(x.data(), y.data(), 2, r), std::invalid_argument);
  api::MoeLayerOptions zero;
  zero.max_tokens = 0;
  EXPECT_THROW(api::CpuMoeLayer(w, zero), std::invalid_argument);
  MoeWeightsView v = w.view();
  v.w2_scale = nullptr;
  EXPECT_THROW(api::CpuMoeLayer(s, v, opts(8)), std::invalid_argument);
  l.check();  // (nothing recorded on the CPU)
}

TEST(CpuLayer, EmptyBatchReadsAndWritesNothing) {
  const MoeShape s = test::small_glm_shape();
  const HostMoeWeights w = make_random_weights(s, 45);
  api::CpuMoeLayer l(w, opts(8));
  l.forward(nullptr, static_cast<num::bf16_t*>(nullptr), 0);
  EXPECT_EQ(l.last_tokens(), 0);
  api::RoutingInput r;
  l.forward(nullptr, static_cast<num::bf16_t*>(nullptr), 0, r);
  EXPECT_EQ(l.last_tokens(), 0);
}

// Non-finite activations are not an error: such a token changes only its own row.
TEST(CpuLayer, NonFiniteTokenChangesOnlyItsRow) {
  for (const MoeShape& s : {test::small_glm_shape(), test::small_deepseek_shape()}) {
    const HostMoeWeights w = make_random_weights(s, 46);
    const int T = 11;
    auto x = test::random_bf16(size_t(T) * s.hidden, 47);
    api::CpuMoeLayer l(w, opts(T));
    std::vector<num::bf16_t> clean(x.size()), dirty(x.size());
    l.forward(x.data(), clean.data(), T);
    x[size_t(3) * s.hidden + 7] = num::bf16_encode(NAN);
    x[size_t(5) * s.hidden] = num::bf16_encode(INFINITY);
    x[size_t(8) * s.hidden + 2] = num::bf16_encode(-INFINITY);
    l.forward(x.data(), dirty.data(), T);
    const size_t row = size_t(s.hidden) * 2;
    for (int t = 0; t < T; ++t) {
      const bool same =
          std::memcmp(clean.data() + size_t(t) * s.hidden, dirty.data() + size_t(t) * s.hidden, row) == 0;
      if (t == 3 || t == 5 || t == 8)
        EXPECT_FALSE(same) << s.describe() << " token " << t;
      else
        EXPECT_TRUE(same) << s.describe() << " token " << t << " changed by another token's non-finite input";
    }
    for (int i = 0; i < T * s.topk; ++i) {
      EXPECT_GE(l.topk_ids()[i], -1);
      EXPECT_LT(l.topk_ids()[i], s.experts);
    }
  }
}

// A layer over a host store follows its reloads, refuses while the layer is not ready, and
// runs again once the missing halves arrive.
TEST(CpuLayer, FollowsTheStoreAcrossReloads) {
  test::TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 1, 48);
  const io::Checkpoint ck(dir.path());
  const int L = d.moe_layers[0];
  WeightStore st = WeightStore::for_checkpoint(ck, d);
  api::CpuMoeLayer l(st, L, opts(16));
  const int T = 6;
  const auto x = test::random_bf16(size_t(T) * d.shape.hidden, 49);
  std::vector<num::bf16_t> y(x.size());
  EXPECT_THROW(l.forward(x.data(), y.data(), T), std::runtime_error) << "never loaded";
  st.load(ck);
  l.forward(x.data(), y.data(), T);
  const auto want = reference_y(st.shape(L), st.host_view(L), x, T);
  EXPECT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * 2));
  // A session that ends with a weight without its scale: refused until the scale comes.
  const std::string wn = d.layer_prefix(L) + "experts.1.up_proj.weight", sn = wn + "_scale_inv";
  const io::TensorView wv = ck.lookup(wn), sv = ck.lookup(sn);
  st.begin(ReloadMode::kDirect);
  ASSERT_TRUE(st.update(wv));
  EXPECT_THROW(st.finish(), io::NotFoundError);
  try {
    l.forward(x.data(), y.data(), T);
    FAIL() << "half a pair";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("incomplete"), std::string::npos) << e.what();
  }
  // The recovery: the pair again whole (its scale alone does not complete it).
  st.begin(ReloadMode::kDirect);
  ASSERT_TRUE(st.update(sv));
  EXPECT_THROW(st.finish(), io::NotFoundError);
  EXPECT_THROW(l.forward(x.data(), y.data(), T), std::runtime_error);
  st.begin(ReloadMode::kDirect);
  ASSERT_TRUE(st.update(wv));
  ASSERT_TRUE(st.update(sv));
  st.finish();
  l.forward(x.data(), y.data(), T);
  EXPECT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * 2));
  // A layer the store does not hold: refused, naming the held ones.
  EXPECT_THROW(api::CpuMoeLayer(st, L + 1, opts(16)), std::invalid_argument);
}

// WeightStore::update of several tensors validates all of them first: a weight beside a
// refused scale is not written, and the layer keeps its bytes and its readiness.
TEST(CpuLayer, RefusedReloadCallWritesNothing) {
  test::TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 1, 50);
  const io::Checkpoint ck(dir.path());
  const int L = d.moe_layers[0];
  WeightStore st = WeightStore::for_checkpoint(ck, d);
  st.load(ck);
  std::vector<uint8_t> before(st.layout(L).total_bytes), after(before.size());
  st.read_bytes(L, 0, before.size(), before.data());
  const std::string wn = d.layer_prefix(L) + "experts.2.gate_proj.weight", sn = wn + "_scale_inv";
  const io::TensorView wv = ck.lookup(wn), sv = ck.lookup(sn);
  std::vector<uint8_t> new_w(wv.data, wv.data + wv.bytes);
  for (uint8_t& b : new_w) b = uint8_t(b ^ 0x01);
  std::vector<float> bad_sc(sv.bytes / 4);
  std::memcpy(bad_sc.data(), sv.data, sv.bytes);
  bad_sc[1] = NAN;
  io::TensorView nw = wv, ns = sv;
  nw.data = new_w.data();
  ns.data = reinterpret_cast<const uint8_t*>(bad_sc.data());
  for (ReloadMode mode : {ReloadMode::kDirect, ReloadMode::kLayerwise}) {
    st.begin(mode);
    const io::TensorView both[2] = {nw, ns};
    EXPECT_THROW(st.update(std::span<const io::TensorView>(both)), io::FormatError);
    st.finish();  // nothing arrived: nothing to complain about
    EXPECT_TRUE(st.ready(L));
    st.read_bytes(L, 0, after.size(), after.data());
    EXPECT_EQ(before, after) << to_string(mode);
  }
  // A name given twice in one call is refused (which one was meant?), nothing written.
  {
    st.begin(ReloadMode::kDirect);
    const io::TensorView twice[3] = {nw, sv, wv};
    try {
      st.update(std::span<const io::TensorView>(twice));
      ADD_FAILURE() << "a name twice in one call";
    } catch (const io::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("given twice"), std::string::npos) << e.what();
    }
    st.finish();
    st.read_bytes(L, 0, after.size(), after.data());
    EXPECT_EQ(before, after);
  }
  // validate() alone writes nothing, and names what it does not hold.
  st.begin(ReloadMode::kDirect);
  EXPECT_TRUE(st.validate(wn, nw.dtype, nw.shape, nw.data, nw.bytes));
  EXPECT_FALSE(st.validate("model.norm.weight", nw.dtype, nw.shape, nw.data, nw.bytes));
  st.finish();
  st.read_bytes(L, 0, after.size(), after.data());
  EXPECT_EQ(before, after);
}

}  // namespace
}  // namespace megamoe
