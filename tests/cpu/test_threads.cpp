// What may run concurrently (docs/cpp.md, "Threads"), exercised from several threads: the
// suite ThreadSanitizer runs in CI (scripts/sanitize.sh thread). Separate CPU layers run at once; one
// CPU layer's forwards from several threads run one at a time; a host store's reloads and the
// forwards over it on other threads each see the other whole; two threads feed one load
// session. And what may not: overlapping calls of one CUDA layer (or of the layers sharing a
// workspace) are refused by their CallGate, shown here on the gate itself.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "../../src/api/call_gate.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/io/safetensors.h"
#include "megamoe/reference/moe.h"
#include "megamoe/weights/store.h"
#include "store_support.h"
#include "support.h"

namespace megamoe {
namespace {

constexpr int kThreads = 4;

api::MoeLayerOptions opts(int max_tokens) {
  api::MoeLayerOptions o;
  o.max_tokens = max_tokens;
  return o;
}

std::vector<num::bf16_t> forward(api::CpuMoeLayer& l, const std::vector<num::bf16_t>& x, int T) {
  std::vector<num::bf16_t> y(x.size(), num::bf16_encode(NAN));  // poisoned
  l.forward(x.data(), y.data(), T);
  return y;
}

bool same(const std::vector<num::bf16_t>& a, const std::vector<num::bf16_t>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(num::bf16_t)) == 0;
}

// Each thread's layer and inputs, and the bytes the layer gave for them on one thread.
TEST(Threads, SeparateCpuLayersRunAtOnce) {
  const MoeShape s = test::small_glm_shape();
  const int T = 7;
  std::vector<std::unique_ptr<api::CpuMoeLayer>> layers;
  std::vector<std::vector<num::bf16_t>> xs, want;
  for (int t = 0; t < kThreads; ++t) {
    layers.push_back(std::make_unique<api::CpuMoeLayer>(make_random_weights(s, 70 + t), opts(16)));
    xs.push_back(test::random_bf16(size_t(T) * s.hidden, 80 + t));
    want.push_back(forward(*layers.back(), xs.back(), T));
  }
  std::atomic<int> wrong{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&, t] {
      for (int i = 0; i < 5; ++i)
        if (!same(forward(*layers[t], xs[t], T), want[t])) ++wrong;
    });
  for (std::thread& th : ts) th.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST(Threads, OneCpuLayerFromSeveralThreads) {
  const MoeShape s = test::small_glm_shape();
  const int T = 5;
  api::CpuMoeLayer layer(make_random_weights(s, 90), opts(16));
  std::vector<std::vector<num::bf16_t>> xs, want;
  for (int t = 0; t < kThreads; ++t) {
    xs.push_back(test::random_bf16(size_t(T) * s.hidden, 91 + t));
    want.push_back(forward(layer, xs[t], T));
  }
  std::atomic<int> wrong{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&, t] {
      for (int i = 0; i < 5; ++i)
        if (!same(forward(layer, xs[t], T), want[t])) ++wrong;
    });
  for (std::thread& th : ts) th.join();
  EXPECT_EQ(wrong.load(), 0);
}

// Reloads on one thread (whole layers: layerwise sessions, and direct sessions of one
// update() call carrying every tensor) while two threads run forwards over the store: each
// forward gives the bytes of one complete set of weights, or refuses while a layerwise
// session has the layer incomplete; never a mixture.
TEST(Threads, StoreReloadsBesideForwards) {
  test::TempDir dir;  // (one per test: the two checkpoints in folders of it)
  const ModelDesc d = test::write_test_checkpoint(dir.path() / "a", 1, 101);
  test::write_test_checkpoint(dir.path() / "b", 1, 102);
  const io::Checkpoint ck_a(dir.path() / "a"), ck_b(dir.path() / "b");
  const int L = d.moe_layers[0];
  const int T = 6;
  const auto x = test::random_bf16(size_t(T) * d.shape.hidden, 103);
  std::vector<num::bf16_t> want_a, want_b;
  for (const io::Checkpoint* ck : {&ck_a, &ck_b}) {
    WeightStore one = WeightStore::for_checkpoint(*ck, d);
    one.load(*ck);
    api::CpuMoeLayer l(one, L, opts(16));
    (ck == &ck_a ? want_a : want_b) = forward(l, x, T);
  }
  ASSERT_FALSE(same(want_a, want_b));

  WeightStore st = WeightStore::for_checkpoint(ck_a, d);
  st.load(ck_a);
  api::CpuMoeLayer layer(st, L, opts(16));
  std::atomic<bool> done{false};
  std::atomic<int> as{0}, bs{0}, refused{0}, wrong{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 2; ++r)
    readers.emplace_back([&] {
      while (!done.load()) {
        try {
          const auto y = forward(layer, x, T);
          if (same(y, want_a))
            ++as;
          else if (same(y, want_b))
            ++bs;
          else
            ++wrong;
        } catch (const std::runtime_error& e) {
          if (std::string(e.what()).find("incomplete") != std::string::npos)
            ++refused;
          else
            ++wrong;
        }
      }
    });
  const std::string prefix = d.layer_prefix(L);
  // Each reload starts only once a reader finished a forward since the last one (no session is
  // open meanwhile, so it completes): the reloads run beside forwards however the threads are
  // scheduled (a loaded 2-core machine under ASan ran all twelve before any forward ended).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  auto wait_for_a_forward = [&] {
    const int seen = as + bs;
    while (as + bs == seen && wrong == 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::yield();
  };
  for (int i = 0; i < 12; ++i) {
    wait_for_a_forward();
    const io::Checkpoint& ck = i % 2 ? ck_b : ck_a;
    if (i % 4 < 2) {
      LoadOptions o;
      o.mode = ReloadMode::kLayerwise;
      st.load(ck, o);
    } else {
      std::vector<io::TensorView> all;
      for (const std::string& n : ck.names_with_prefix(prefix)) all.push_back(ck.lookup(n));
      st.begin(ReloadMode::kDirect);
      ASSERT_TRUE(st.update(std::span<const io::TensorView>(all)));
      st.finish();
    }
    std::this_thread::yield();
  }
  done = true;
  for (std::thread& th : readers) th.join();
  EXPECT_EQ(wrong.load(), 0) << as << " A, " << bs << " B, " << refused << " refused";
  EXPECT_GE(as + bs, 12);  // (a forward before each reload)
  EXPECT_TRUE(same(forward(layer, x, T), want_b));  // the last reload's weights
}

// Two threads feed one session (update() calls serialize in the store).
TEST(Threads, TwoThreadsFeedOneSession) {
  test::TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 1, 110);
  const io::Checkpoint ck(dir.path());
  const int L = d.moe_layers[0];
  WeightStore want = WeightStore::for_checkpoint(ck, d), st = WeightStore::for_checkpoint(ck, d);
  want.load(ck);
  const std::vector<std::string> names = ck.names_with_prefix(d.layer_prefix(L));
  st.begin(ReloadMode::kLayerwise);
  std::vector<std::thread> ts;
  for (int t = 0; t < 2; ++t)
    ts.emplace_back([&, t] {
      for (size_t i = size_t(t); i < names.size(); i += 2) st.update(ck.lookup(names[i]));
    });
  for (std::thread& th : ts) th.join();
  st.finish();
  ASSERT_TRUE(st.ready(L));
  std::vector<uint8_t> a(want.layout(L).total_bytes), b(a.size());
  want.read_bytes(L, 0, a.size(), a.data());
  st.read_bytes(L, 0, b.size(), b.data());
  EXPECT_EQ(a, b);
}

// The CUDA layers' guard against overlapping calls: a second call while one is inside
// throws, naming both; once the first returns, the next call enters.
TEST(Threads, CallGateRefusesOverlap) {
  auto gate = api::detail::gate_for_workspace(nullptr);
  std::promise<void> inside, tried;
  std::thread holder([&] {
    const auto entry = gate->enter("CudaMoeLayer", "forward");
    inside.set_value();
    tried.get_future().wait();
  });
  inside.get_future().wait();
  try {
    (void)gate->enter("CudaMoeLayer", "check");
    ADD_FAILURE() << "an overlapping call entered";
  } catch (const std::logic_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("CudaMoeLayer::check"), std::string::npos) << m;
    EXPECT_NE(m.find("inside forward"), std::string::npos) << m;
  }
  tried.set_value();
  holder.join();
  EXPECT_NO_THROW((void)gate->enter("CudaMoeLayer", "forward"));
}

// Layers of one workspace share a gate; a layer with a workspace of its own has its own.
TEST(Threads, OneGatePerWorkspace) {
  alignas(256) static char ws_a[256], ws_b[256];
  const auto a1 = api::detail::gate_for_workspace(ws_a), a2 = api::detail::gate_for_workspace(ws_a);
  const auto b = api::detail::gate_for_workspace(ws_b);
  EXPECT_EQ(a1, a2);
  EXPECT_NE(a1, b);
  EXPECT_NE(api::detail::gate_for_workspace(nullptr), api::detail::gate_for_workspace(nullptr));
  {
    const auto entry = a1->enter("CudaMoeLayer", "forward");
    EXPECT_THROW((void)a2->enter("CudaMoeLayer", "forward"), std::logic_error);
    EXPECT_NO_THROW((void)b->enter("CudaMoeLayer", "forward"));
  }
}

}  // namespace
}  // namespace megamoe
