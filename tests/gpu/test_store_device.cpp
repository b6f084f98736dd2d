// WeightStore fed from device memory (a trainer's tensors on the GPU): the bytes of a
// device store updated from device copies of a checkpoint's tensors equal those of a
// host store loaded from the files, for both kernel formats; the source may be
// overwritten as soon as update() returns; a corrupt block scale in device memory is
// refused like one on disk.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../cpu/store_support.h"
#include "gpu_test_util.h"
#include "megamoe/api/ep_layer.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/weights/checkpoint_layout.h"
#include "megamoe/weights/device_memory.h"
#include "megamoe/weights/store.h"

namespace megamoe {
namespace {

#define CK(call) ASSERT_EQ((call), cudaSuccess) << #call

std::vector<uint8_t> allocation(const WeightStore& st, int L) {
  std::vector<uint8_t> b(st.allocation_bytes(L));
  st.read_bytes(L, 0, b.size(), b.data());
  return b;
}

// One tensor in device memory, freed by the destructor.
struct DeviceCopy {
  void* p = nullptr;
  DeviceCopy(const void* host, size_t bytes) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(bytes, 1)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceCopy() { cudaFree(p); }
};

class StoreDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testutil::have_device()) GTEST_SKIP() << "no sm_90 device";
  }
};

TEST_F(StoreDevice, UpdatesFromDeviceMemoryMatchTheHostLoad) {
  test::TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 2, 21);
  const io::Checkpoint ck(dir.path());
  for (const KernelFormat f : {KernelFormat::kBlockFp8Hopper, KernelFormat::kMxfp8Blackwell}) {
    SCOPED_TRACE(std::string(to_string(f)));
    WeightStoreOptions ho;
    ho.kernel_format = f;
    WeightStore host = WeightStore::for_checkpoint(ck, d, ho);
    host.load(ck);
    WeightStoreOptions dopt = ho;
    dopt.memory = StoreMemory::kDevice;
    WeightStore dev = WeightStore::for_checkpoint(ck, d, dopt);
    std::vector<const void*> bases;
    for (int L : dev.layers()) bases.push_back(dev.base(L));
    // Every tensor from the GPU but one in eight from host memory (both kinds in one
    // session), in a shuffled order; each source is poisoned right after its update.
    std::vector<std::string> names;
    for (int L : d.moe_layers)
      for (const auto& n : ck.names_with_prefix(d.layer_prefix(L))) names.push_back(n);
    std::mt19937_64 rng(7);
    std::shuffle(names.begin(), names.end(), rng);
    dev.begin(ReloadMode::kLayerwise);
    for (size_t i = 0; i < names.size(); ++i) {
      const io::TensorView v = ck.lookup(names[i]);
      if (i % 8 == 3) {
        EXPECT_TRUE(dev.update(v));
        continue;
      }
      DeviceCopy src(v.data, v.bytes);
      ASSERT_TRUE(dev::is_device_pointer(src.p));
      EXPECT_TRUE(dev.update(v.name, v.dtype, v.shape, src.p, v.bytes));
      CK(cudaMemset(src.p, 0xFF, v.bytes));
      CK(cudaDeviceSynchronize());
    }
    dev.finish();
    for (size_t i = 0; i < dev.layers().size(); ++i) {
      const int L = dev.layers()[i];
      EXPECT_TRUE(dev.ready(L));
      EXPECT_EQ(dev.base(L), bases[i]) << "the buffers never move";
      EXPECT_EQ(allocation(dev, L), allocation(host, L)) << "layer " << L;
    }
  }
}

TEST_F(StoreDevice, CorruptScaleInDeviceMemoryIsRefused) {
  test::TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 1, 22);
  const io::Checkpoint ck(dir.path());
  WeightStoreOptions o;
  o.memory = StoreMemory::kDevice;
  WeightStore st = WeightStore::for_checkpoint(ck, d, o);
  st.load(ck);
  const int L = d.moe_layers[0];
  const auto before = allocation(st, L);
  const std::string name = d.layer_prefix(L) + "experts.5.down_proj.weight_scale_inv";
  const io::TensorView v = ck.lookup(name);
  std::vector<float> bad(v.bytes / 4);
  std::memcpy(bad.data(), v.data, v.bytes);
  bad[bad.size() - 1] = NAN;
  DeviceCopy src(bad.data(), v.bytes);
  st.begin(ReloadMode::kDirect);
  try {
    st.update(v.name, v.dtype, v.shape, src.p, v.bytes);
    ADD_FAILURE() << "a NaN block scale in device memory was accepted";
  } catch (const io::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor '" + name + "' holds nan"), std::string::npos) << e.what();
  }
  st.finish();
  EXPECT_EQ(allocation(st, L), before) << "a refused update writes nothing";
}

// CudaMoeLayer on a store's layer: the bytes of a layer object that uploaded the same
// weights, and through a reload; a store not yet loaded is refused.
TEST_F(StoreDevice, LayerObjectBorrowsTheStore) {
  test::TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 1, 23);
  const io::Checkpoint ck(dir.path());
  const int L = d.moe_layers[0];
  WeightStoreOptions o;
  o.memory = StoreMemory::kDevice;
  WeightStore st = WeightStore::for_checkpoint(ck, d, o);
  try {
    api::CudaMoeLayer early(st, L, {});
    ADD_FAILURE() << "a layer object on a store not yet loaded";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("is not loaded"), std::string::npos) << e.what();
  }
  st.load(ck);
  api::MoeLayerOptions lo;
  lo.max_tokens = 32;
  api::CudaMoeLayer borrowed(st, L, lo);
  EXPECT_EQ(borrowed.device_weights(), st.base(L));
  api::CudaMoeLayer uploaded(load_moe_layer(ck, d, L), lo);
  const int T = 19;
  const auto x = testutil::random_x(size_t(T) * d.shape.hidden, 24);
  const size_t n = x.size();
  num::bf16_t *dx = nullptr, *dy = nullptr;
  CK(cudaMalloc(&dx, n * 2));
  CK(cudaMalloc(&dy, n * 2));
  CK(cudaMemcpy(dx, x.data(), n * 2, cudaMemcpyHostToDevice));
  auto run = [&](api::CudaMoeLayer& m) {
    std::vector<num::bf16_t> y(n);
    EXPECT_EQ(cudaMemset(dy, 0xFF, n * 2), cudaSuccess);
    m.forward(dx, dy, T, nullptr, nullptr);
    EXPECT_EQ(cudaMemcpy(y.data(), dy, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    return y;
  };
  const auto want = run(uploaded);
  EXPECT_EQ(run(borrowed), want);
  LoadOptions reload;
  reload.mode = ReloadMode::kDirect;
  st.load(ck, reload);
  EXPECT_EQ(run(borrowed), want) << "after a reload in place";
  cudaFree(dx);
  cudaFree(dy);
}

// Expert parallelism from rank stores: R = 4 virtual ranks, each reading its own device
// store (its two experts of 8, WeightStoreOptions::experts) in place. The output bytes
// equal the single-device layer's; a store zeroed in place changes them, a reload in
// place brings them back; a whole-layer store is copied from instead of borrowed.
TEST_F(StoreDevice, EpLayerBorrowsRankStores) {
  test::TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 1, 29);
  const io::Checkpoint ck(dir.path());
  const int L = d.moe_layers[0], R = 4, E = d.shape.experts;
  std::vector<WeightStore> stores;
  std::vector<const WeightStore*> ptrs;
  for (int r = 0; r < R; ++r) {
    WeightStoreOptions o;
    o.memory = StoreMemory::kDevice;
    o.layers = {L};
    o.experts = {r * (E / R), E / R};
    stores.push_back(WeightStore::for_checkpoint(ck, d, o));
  }
  for (WeightStore& st : stores) ptrs.push_back(&st);
  api::EpLayerOptions eo;
  eo.ranks = R;
  eo.max_tokens = 24;
  try {
    api::CudaEpMoeLayer early(ptrs, L, eo);
    ADD_FAILURE() << "an expert-parallel layer on stores not yet loaded";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("is not loaded"), std::string::npos) << e.what();
  }
  for (WeightStore& st : stores) st.load(ck);
  // One rank's store for every rank: rank 0's experts only, so rank 1 cannot run.
  try {
    api::CudaEpMoeLayer wrong(stores[0], L, eo);
    ADD_FAILURE() << "rank 1 ran on rank 0's experts";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 owns experts [2, 4)"), std::string::npos) << e.what();
  }
  api::CudaEpMoeLayer ep(ptrs, L, eo);
  for (int r = 0; r < R; ++r) EXPECT_TRUE(ep.borrows_weights(r)) << "rank " << r;
  WeightStoreOptions whole_opt;
  whole_opt.memory = StoreMemory::kDevice;
  WeightStore whole = WeightStore::for_checkpoint(ck, d, whole_opt);
  whole.load(ck);
  api::CudaEpMoeLayer copied(whole, L, eo);
  for (int r = 0; r < R; ++r) EXPECT_FALSE(copied.borrows_weights(r)) << "rank " << r;
  // A rank's part of a whole layer is no layer of its own.
  try {
    api::CudaMoeLayer part(stores[1], L, {});
    ADD_FAILURE() << "a single-device layer on a rank's experts";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("holds experts [2, 4) of 8"), std::string::npos) << e.what();
  }

  const std::vector<int> tokens = {7, 24, 0, 13};
  std::vector<std::vector<num::bf16_t>> xs;
  std::vector<const num::bf16_t*> dx;
  std::vector<num::bf16_t*> dy;
  for (int r = 0; r < R; ++r) {
    xs.push_back(testutil::random_x(size_t(std::max(tokens[r], 1)) * d.shape.hidden, 300 + r));
    void *px = nullptr, *py = nullptr;
    CK(cudaMalloc(&px, xs[r].size() * 2));
    CK(cudaMalloc(&py, xs[r].size() * 2));
    CK(cudaMemcpy(px, xs[r].data(), xs[r].size() * 2, cudaMemcpyHostToDevice));
    dx.push_back(static_cast<const num::bf16_t*>(px));
    dy.push_back(static_cast<num::bf16_t*>(py));
  }
  auto run = [&](api::CudaEpMoeLayer& m) {
    std::vector<std::vector<num::bf16_t>> y(R);
    for (int r = 0; r < R; ++r) EXPECT_EQ(cudaMemset(dy[r], 0xFF, xs[r].size() * 2), cudaSuccess);
    m.forward(dx, dy, tokens, nullptr);
    EXPECT_NO_THROW(m.check());
    for (int r = 0; r < R; ++r) {
      y[r].resize(size_t(tokens[r]) * d.shape.hidden);
      EXPECT_EQ(cudaMemcpy(y[r].data(), dy[r], y[r].size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return y;
  };
  // The single-device bytes, rank by rank.
  std::vector<std::vector<num::bf16_t>> want(R);
  {
    api::MoeLayerOptions lo;
    lo.max_tokens = 24;
    api::CudaMoeLayer one(whole, L, lo);
    for (int r = 0; r < R; ++r) {
      one.forward(dx[r], dy[r], tokens[r], nullptr, nullptr);
      want[r].resize(size_t(tokens[r]) * d.shape.hidden);
      CK(cudaMemcpy(want[r].data(), dy[r], want[r].size() * 2, cudaMemcpyDeviceToHost));
    }
  }
  EXPECT_EQ(run(ep), want);
  EXPECT_EQ(run(copied), want);
  stores[1].zero_experts(L);  // rank 1's experts (and its shared expert copy) to zero, in place
  EXPECT_NE(run(ep), want) << "the borrowed store's change did not reach the forward";
  EXPECT_EQ(run(copied), want);
  LoadOptions reload;
  reload.mode = ReloadMode::kDirect;
  stores[1].load(ck, reload);
  EXPECT_EQ(run(ep), want) << "after a reload in place";
  for (int r = 0; r < R; ++r) {
    cudaFree(const_cast<num::bf16_t*>(dx[r]));
    cudaFree(dy[r]);
  }
}

}  // namespace
}  // namespace megamoe
