// WeightStore: cold loads (streaming, split and shuffled), finish() errors,
// hostile updates, the MXFP8 derived copy.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <vector>

#include "megamoe/api/ep_layer.h"
#include "megamoe/api/forward.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/numerics/quant.h"
#include "megamoe/weights/checkpoint_layout.h"
#include "megamoe/weights/device_memory.h"
#include "megamoe/weights/store.h"
#include "store_support.h"

namespace megamoe {
namespace {

using test::TempDir;

std::vector<uint8_t> layer_bytes(const WeightStore& st, int L) {
  std::vector<uint8_t> b(st.layout(L).total_bytes);
  st.read_bytes(L, 0, b.size(), b.data());
  return b;
}

std::vector<uint8_t> host_bytes(const HostMoeWeights& w) { return {w.data(), w.data() + w.bytes()}; }

// Every held tensor of the checkpoint as a view, in checkpoint (name) order.
std::vector<io::TensorView> moe_views(const io::Checkpoint& ck, const ModelDesc& d) {
  std::vector<io::TensorView> v;
  for (int L : d.moe_layers)
    for (const auto& n : ck.names_with_prefix(d.layer_prefix(L))) v.push_back(ck.lookup(n));
  return v;
}

TEST(Store, StreamingColdLoadMatchesLoadMoeLayer) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 2, 11);
  const io::Checkpoint ck(dir.path());
  WeightStore st = WeightStore::for_checkpoint(ck, d);
  ASSERT_EQ(st.layers(), d.moe_layers);
  for (int L : st.layers()) EXPECT_FALSE(st.ready(L));
  const FinishReport r = st.load(ck);
  EXPECT_EQ(r.layers_processed, 2);
  EXPECT_EQ(r.tensors, moe_views(ck, d).size());
  for (int L : st.layers()) {
    EXPECT_TRUE(st.ready(L));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(st.base(L)) % 256, 0u);
    EXPECT_EQ(layer_bytes(st, L), host_bytes(load_moe_layer(ck, d, L))) << "layer " << L;
  }
}

TEST(Store, SplitAndShuffledUpdates) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 2, 12);
  const io::Checkpoint ck(dir.path());
  auto views = moe_views(ck, d);
  // Every scale first, then every weight, each half in a random order: no
  // pair arrives together, and layers interleave.
  std::stable_partition(views.begin(), views.end(),
                        [](const io::TensorView& v) { return v.name.ends_with("_scale_inv"); });
  const auto mid = std::find_if(views.begin(), views.end(),
                                [](const io::TensorView& v) { return !v.name.ends_with("_scale_inv"); });
  std::mt19937_64 rng(5);
  std::shuffle(views.begin(), mid, rng);
  std::shuffle(mid, views.end(), rng);

  WeightStore st = WeightStore::for_checkpoint(ck, d);
  st.begin(ReloadMode::kLayerwise);
  for (const auto& v : views) EXPECT_TRUE(st.update(v));
  // Non-MoE tensors are not the store's business: ignored, not an error.
  EXPECT_FALSE(st.update(ck.lookup("lm_head.weight")));
  st.finish();
  for (int L : st.layers()) EXPECT_EQ(layer_bytes(st, L), host_bytes(load_moe_layer(ck, d, L)));

  // load() with its own shuffle gives the same bytes.
  WeightStore st2 = WeightStore::for_checkpoint(ck, d);
  LoadOptions lo;
  lo.shuffle = true, lo.seed = 3, lo.mode = ReloadMode::kDirect;
  st2.load(ck, lo);
  for (int L : st.layers()) EXPECT_EQ(layer_bytes(st2, L), layer_bytes(st, L));
}

TEST(Store, MissingScaleAtFinishNamesTheTensor) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 1, 13);
  const io::Checkpoint ck(dir.path());
  const std::string p = d.layer_prefix(d.moe_layers[0]);
  const std::string lost_scale = p + "experts.3.up_proj.weight_scale_inv";
  const std::string lost_weight = p + "experts.5.down_proj.weight";
  for (auto mode : {ReloadMode::kLayerwise, ReloadMode::kDirect}) {
    WeightStore st = WeightStore::for_checkpoint(ck, d);
    st.begin(mode);
    for (const auto& v : moe_views(ck, d))
      if (v.name != lost_scale && v.name != lost_weight) st.update(v);
    try {
      st.finish();
      FAIL() << "finish() accepted incomplete pairs";
    } catch (const io::NotFoundError& e) {
      const std::string m = e.what();
      EXPECT_NE(
          m.find("'" + p + "experts.3.up_proj.weight' arrived without its block scale '" + lost_scale + "'"),
          std::string::npos)
          << m;
      EXPECT_NE(m.find("block scale '" + lost_weight + "_scale_inv' arrived without its weight '" +
                       lost_weight + "'"),
                std::string::npos)
          << m;
    }
    EXPECT_FALSE(st.in_session());
    EXPECT_FALSE(st.ready(d.moe_layers[0]));
  }
}

TEST(Store, NeverLoadedLayerIsReported) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 2, 14);
  const io::Checkpoint ck(dir.path());
  WeightStore st = WeightStore::for_checkpoint(ck, d);
  st.begin(ReloadMode::kDirect);
  for (const auto& v : moe_views(ck, d))
    if (v.name.starts_with(d.layer_prefix(d.moe_layers[0]))) st.update(v);
  try {
    st.finish();
    FAIL() << "finish() accepted a layer that never arrived";
  } catch (const io::NotFoundError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(fmt::format("layer {}:", d.moe_layers[1])), std::string::npos) << m;
    EXPECT_NE(m.find("never loaded"), std::string::npos) << m;
    EXPECT_NE(m.find(d.layer_prefix(d.moe_layers[1]) + "experts.0.gate_proj.weight"), std::string::npos) << m;
  }
  EXPECT_TRUE(st.ready(d.moe_layers[0]));
}

TEST(Store, HostileUpdatesAreRejected) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 1, 15);
  const io::Checkpoint ck(dir.path());
  const std::string p = d.layer_prefix(d.moe_layers[0]);
  WeightStore st = WeightStore::for_checkpoint(ck, d);
  const io::TensorView w = ck.lookup(p + "experts.1.gate_proj.weight");
  EXPECT_THROW(st.update(w), std::logic_error);  // no session
  st.load(ck);
  const auto before = layer_bytes(st, d.moe_layers[0]);
  st.begin(ReloadMode::kDirect);

  auto expect_format_error = [&](std::string_view name, io::Dtype dt, std::vector<int64_t> shape,
                                 size_t bytes, const void* data, std::string_view needle) {
    try {
      st.update(name, dt, shape, data, bytes);
      ADD_FAILURE() << "accepted " << name << " " << io::format_shape(shape);
    } catch (const io::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const std::vector<uint8_t> junk(1 << 20, 0x7e);
  const std::string wn(w.name);
  expect_format_error(wn, io::Dtype::kF32, {128, 256}, 128 * 256 * 4, junk.data(),
                      "expected F8_E4M3 [128, 256], found F32");
  expect_format_error(wn, io::Dtype::kF8_E4M3, {129, 256}, 129 * 256, junk.data(),
                      "found F8_E4M3 [129, 256]");
  expect_format_error(wn, io::Dtype::kF8_E4M3, {128 * 256}, 128 * 256, junk.data(), "found F8_E4M3 [32768]");
  expect_format_error(wn, io::Dtype::kF8_E4M3, {128, 256, 1}, 128 * 256, junk.data(), "[128, 256, 1]");
  expect_format_error(wn, io::Dtype::kF8_E4M3, {-128, -256}, 128 * 256, junk.data(), "[-128, -256]");
  expect_format_error(wn, io::Dtype::kF8_E4M3, {int64_t(1) << 62, int64_t(1) << 62}, 128 * 256, junk.data(),
                      "found");
  expect_format_error(wn, io::Dtype::kF8_E4M3, {128, 256}, 100, junk.data(), "the update brings 100");
  expect_format_error(wn, io::Dtype::kF8_E4M3, {128, 256}, 128 * 256, nullptr, "null data");
  expect_format_error(p + "experts.1.gate_proj.weight_scale_inv", io::Dtype::kF32, {2, 2}, 16, junk.data(),
                      "expected F32 [1, 2], found F32 [2, 2]");
  // The router in another dtype would need a different layout: never relocated.
  expect_format_error(p + "gate.weight", io::Dtype::kBF16, {8, 256}, 8 * 256 * 2, junk.data(), "relocated");
  // An expert the layout does not have (the file has more experts than the config).
  expect_format_error(p + "experts.8.gate_proj.weight", io::Dtype::kF8_E4M3, {128, 256}, 128 * 256,
                      junk.data(), "unexpected tensor");
  // Right dtype and shape, corrupt values: a block scale must be >= 0 with 448 times it
  // finite (3e38 would dequantize E4M3's 448 to infinity), the router and the bias finite
  // (each is refused with its position, before any byte lands).
  const std::string scale = p + "experts.1.gate_proj.weight_scale_inv";
  for (const float bad : {NAN, INFINITY, -1.0f, 3e38f, 7.6e35f}) {
    const float v[2] = {0.01f, bad};
    expect_format_error(scale, io::Dtype::kF32, {1, 2}, sizeof(v), v, fmt::format("holds {} at [0, 1]", bad));
    expect_format_error(scale, io::Dtype::kF32, {1, 2}, sizeof(v), v,
                        "a block scale must be >= 0 and 448 times it finite");
  }
  EXPECT_TRUE(num::is_valid_block_scale(7.5e35f));  // 448 x 7.5e35 = 3.36e38 < FLT_MAX
  EXPECT_TRUE(num::is_valid_block_scale(0.0f));
  std::vector<float> router(8 * 256, 0.5f);
  router[3 * 256 + 7] = -INFINITY;
  expect_format_error(p + "gate.weight", io::Dtype::kF32, {8, 256}, router.size() * 4, router.data(),
                      "holds -inf at [3, 7] (router weights and bias must be finite)");
  std::vector<float> bias(8, -0.25f);
  bias[5] = NAN;
  expect_format_error(p + "gate.e_score_correction_bias", io::Dtype::kF32, {8}, bias.size() * 4, bias.data(),
                      "holds nan at [5]");
  st.finish();  // nothing landed: no half pair
  EXPECT_EQ(layer_bytes(st, d.moe_layers[0]), before);
  EXPECT_TRUE(st.ready(d.moe_layers[0]));
}

// A direct session writes into the live layout, so a layer stays ready while its tensors
// come in; but one that closes with a pair half written (here the new weight landed and its
// scale was refused) leaves bytes that do not belong together: the layer is not ready until
// a later session brings both halves, and then it is again, with the new bytes.
TEST(Store, DirectSessionLeftHalfAPairIsNotReady) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 1, 16);
  const io::Checkpoint ck(dir.path());
  const int L = d.moe_layers[0];
  const std::string w = d.layer_prefix(L) + "experts.4.down_proj.weight", sc = w + "_scale_inv";
  WeightStore st = WeightStore::for_checkpoint(ck, d);
  st.load(ck);
  ASSERT_TRUE(st.ready(L));
  const io::TensorView wv = ck.lookup(w), sv = ck.lookup(sc);
  std::vector<uint8_t> new_w(static_cast<const uint8_t*>(wv.data),
                             static_cast<const uint8_t*>(wv.data) + wv.bytes);
  for (uint8_t& b : new_w) b = uint8_t(b ^ 0x01);  // other finite E4M3 bytes (never 0x7f / 0xff)
  std::vector<float> new_sc(sv.bytes / 4);
  std::memcpy(new_sc.data(), sv.data, sv.bytes);
  for (float& f : new_sc) f *= 2.0f;
  std::vector<float> bad_sc = new_sc;
  bad_sc[0] = NAN;

  st.begin(ReloadMode::kDirect);
  ASSERT_TRUE(st.update(w, wv.dtype, wv.shape, new_w.data(), new_w.size()));
  EXPECT_TRUE(st.ready(L)) << "direct mode keeps readiness while tensors come in";
  EXPECT_THROW(st.update(sc, sv.dtype, sv.shape, bad_sc.data(), sv.bytes), io::FormatError);
  EXPECT_THROW(st.finish(), io::NotFoundError);
  EXPECT_FALSE(st.ready(L)) << "a new weight with its old scale";
  // Only the scale in the next session: still half a pair (and still not ready).
  st.begin(ReloadMode::kDirect);
  ASSERT_TRUE(st.update(sc, sv.dtype, sv.shape, new_sc.data(), sv.bytes));
  EXPECT_THROW(st.finish(), io::NotFoundError);
  EXPECT_FALSE(st.ready(L));
  // Both halves: ready, with the new bytes.
  st.begin(ReloadMode::kDirect);
  ASSERT_TRUE(st.update(w, wv.dtype, wv.shape, new_w.data(), new_w.size()));
  ASSERT_TRUE(st.update(sc, sv.dtype, sv.shape, new_sc.data(), sv.bytes));
  st.finish();
  EXPECT_TRUE(st.ready(L));
  for (const TensorSlot& slot : moe_layer_slots(st.shape(L), d.layer_prefix(L)))
    if (slot.name == w) {
      std::vector<uint8_t> got(new_w.size());
      st.read_bytes(L, slot.at(st.layout(L)), got.size(), got.data());
      EXPECT_EQ(got, new_w);
    }
  // A load that throws half way in direct mode leaves the same mark: the whole layer again clears it.
  st.begin(ReloadMode::kDirect);
  ASSERT_TRUE(st.update(w, wv.dtype, wv.shape, wv.data, wv.bytes));
  EXPECT_THROW(st.update(sc, sv.dtype, sv.shape, bad_sc.data(), sv.bytes), io::FormatError);
  EXPECT_THROW(st.finish(), io::NotFoundError);
  EXPECT_FALSE(st.ready(L));
  LoadOptions lo;
  lo.mode = ReloadMode::kDirect;
  st.load(ck, lo);
  EXPECT_TRUE(st.ready(L));
  EXPECT_EQ(layer_bytes(st, L), host_bytes(load_layer_via_store(ck, d, L)));
}

// A NaN block scale in a shard on disk: both load paths (streaming pread, and the shuffled
// updates) refuse it naming the tensor, and the streaming path never writes it to the layout.
TEST(Store, CorruptScaleOnDiskIsRefusedByEveryLoadPath) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 1, 15);
  const std::string name = d.layer_prefix(d.moe_layers[0]) + "experts.2.up_proj.weight_scale_inv";
  {
    const std::string path(io::Checkpoint(dir.path()).lookup(name).file);
    const io::SafetensorsFile f(path);
    const io::TensorInfo& t = *f.header().find(name);
    std::fstream out(path, std::ios::binary | std::ios::in | std::ios::out);
    const float inf = INFINITY;
    out.seekp(std::streamoff(f.header().data_offset + t.begin));
    out.write(reinterpret_cast<const char*>(&inf), 4);
  }
  const io::Checkpoint ck(dir.path());
  for (const bool shuffle : {false, true}) {
    SCOPED_TRACE(shuffle ? "shuffled updates" : "streaming");
    WeightStore st = WeightStore::for_checkpoint(ck, d);
    LoadOptions o;
    o.shuffle = shuffle;
    try {
      st.load(ck, o);
      ADD_FAILURE() << "loaded a checkpoint with an infinite block scale";
    } catch (const io::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("tensor '" + name + "' holds inf at [0, 0]"), std::string::npos)
          << e.what();
    }
    EXPECT_FALSE(st.ready(d.moe_layers[0]));
  }
}

// A multi-token-prediction layer (num_nextn_predict_layers; DeepSeek-V3's model.layers.61):
// the checkpoint's last MoE layer relabelled as the MTP layer. A default store holds the
// main layers and passes over the MTP tensors; asked for by index, the MTP layer loads with
// the bytes it had as a main layer; inspect marks it, and an MTP layer the files lack is
// named, not fatal.
TEST(Store, MtpLayerLoadsWhenAskedFor) {
  TempDir dir;
  const ModelDesc d = write_synthetic_checkpoint(dir.path(), find_preset("deepseek-v3"), 2, 31, false,
                                                 test::store_test_shape());
  const int mtp = d.moe_layers.back();
  ModelDesc m = d;
  m.num_layers = mtp;
  m.moe_layers.pop_back();
  m.mtp_layers = {mtp};
  io::write_config(dir.path(), m);
  const ModelDesc desc = load_config(dir.path());
  ASSERT_EQ(desc.mtp_layers, std::vector<int>{mtp});
  const io::Checkpoint ck(dir.path());

  WeightStore main = WeightStore::for_checkpoint(ck, desc);
  main.load(ck);
  EXPECT_EQ(main.layers(), desc.moe_layers);
  EXPECT_FALSE(main.holds(mtp));

  WeightStoreOptions o;
  o.layers = {mtp};
  WeightStore st = WeightStore::for_checkpoint(ck, desc, o);
  st.load(ck);
  EXPECT_TRUE(st.ready(mtp));
  EXPECT_EQ(layer_bytes(st, mtp), host_bytes(load_moe_layer(ck, d, mtp)));
  EXPECT_EQ(layer_bytes(st, mtp), host_bytes(load_layer_via_store(ck, desc, mtp)));

  const auto r = test::run_cli("inspect " + dir.path().string());
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find(fmt::format("MoE: {}, MTP {}", desc.moe_layers.front(), mtp)), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("(MTP)"), std::string::npos) << r.output;

  m.mtp_layers = {mtp, mtp + 1};  // a second MTP layer the files do not have
  io::write_config(dir.path(), m);
  const ModelDesc two = load_config(dir.path());
  WeightStore still = WeightStore::for_checkpoint(ck, two);
  EXPECT_NO_THROW(still.load(ck));
  o.layers = {mtp + 1};
  WeightStore absent = WeightStore::for_checkpoint(ck, two, o);
  try {
    absent.load(ck);
    ADD_FAILURE() << "an MTP layer without tensors loaded";
  } catch (const io::NotFoundError& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("layer {}: ", mtp + 1)), std::string::npos) << e.what();
  }
  const auto r2 = test::run_cli("inspect " + dir.path().string());
  EXPECT_NE(r2.output.find(fmt::format("MTP layer {} not in this checkpoint", mtp + 1)), std::string::npos)
      << r2.output;
}

#if defined(MEGAMOE_HAVE_CUDA)
// A layer object borrows a store's layer only where it can run it: held, in device memory,
// loaded (the GPU test StoreDevice.LayerObjectBorrowsTheStore has the rest). These two
// fail before any CUDA call, so they run here.
TEST(Store, LayerObjectRefusesWhatItCannotRun) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 1, 17);
  const io::Checkpoint ck(dir.path());
  WeightStore host = WeightStore::for_checkpoint(ck, d);
  host.load(ck);
  const int L = d.moe_layers[0];
  auto error_of = [&](int layer) {
    try {
      api::CudaMoeLayer moe(host, layer, {});
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of(L).find(fmt::format("holds layer {} in host memory", L)), std::string::npos)
      << error_of(L);
  EXPECT_NE(error_of(L + 7).find(fmt::format("layer {} is not held (held: {})", L + 7, L)), std::string::npos)
      << error_of(L + 7);
}

// The same for the expert-parallel layer (StoreDevice.EpLayerBorrowsRankStores has the rest):
// its stores must be there and loaded.
TEST(Store, EpLayerObjectRefusesWhatItCannotRun) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 1, 18);
  const io::Checkpoint ck(dir.path());
  const int L = d.moe_layers[0];
  WeightStoreOptions o;
  o.experts = {4, 4};
  WeightStore part = WeightStore::for_checkpoint(ck, d, o), unloaded = WeightStore::for_checkpoint(ck, d, o);
  part.load(ck);
  auto error_of = [&](auto make) {
    try {
      make();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  api::EpLayerOptions eo;
  eo.ranks = 2;
  const std::string unl = error_of([&] { api::CudaEpMoeLayer ep(unloaded, L, eo); });
  EXPECT_NE(unl.find(fmt::format("layer {} of WeightStore 0 is not loaded", L)), std::string::npos) << unl;
  const std::string nul = error_of([&] {
    api::CudaEpMoeLayer ep(std::vector<const WeightStore*>{&part, nullptr}, L, eo);
  });
  EXPECT_NE(nul.find("a null WeightStore"), std::string::npos) << nul;
}
#endif

TEST(Store, LayerSubsetAndBadOptions) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 3, 16);
  const io::Checkpoint ck(dir.path());
  WeightStoreOptions o;
  o.layers = {d.moe_layers[1]};
  WeightStore st = WeightStore::for_checkpoint(ck, d, o);
  EXPECT_EQ(st.layers(), o.layers);
  st.load(ck);  // the other layers' tensors are ignored
  EXPECT_EQ(layer_bytes(st, d.moe_layers[1]), host_bytes(load_moe_layer(ck, d, d.moe_layers[1])));
  EXPECT_THROW(st.base(d.moe_layers[0]), std::invalid_argument);
  o.layers = {0};  // GLM-5.3-Flash's first layers are dense
  ASSERT_FALSE(d.is_moe_layer(0));
  EXPECT_THROW(WeightStore(d, o), std::invalid_argument);
}

TEST(Store, LoadLayerViaStoreMatchesLoadMoeLayer) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 2, 17);
  const io::Checkpoint ck(dir.path());
  for (int L : d.moe_layers) {
    const HostMoeWeights a = load_layer_via_store(ck, d, L), b = load_moe_layer(ck, d, L);
    EXPECT_EQ(a.shape.router_dtype, b.shape.router_dtype);
    EXPECT_EQ(host_bytes(a), host_bytes(b));
  }
  EXPECT_THROW(load_layer_via_store(ck, d, d.num_layers + 3), std::invalid_argument);
}

TEST(Store, DeviceMemoryWithoutDeviceIsAClearError) {
  std::string why;
  if (dev::device_memory_available(&why)) GTEST_SKIP() << "a CUDA device is present (covered by GPU tests)";
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 1, 18);
  WeightStoreOptions o;
  o.memory = StoreMemory::kDevice;
  EXPECT_THROW(WeightStore(d, o), std::runtime_error);
}

// Dequantized value of every element of the block-FP8 tensor and of its MXFP8 copy.
void expect_mxfp8_exact(const WeightStore& st, int L, const io::Checkpoint& ck, const std::string& name) {
  const io::TensorView w = ck.lookup(name), s = ck.lookup(name + "_scale_inv");
  const int rows = int(w.shape[0]), cols = int(w.shape[1]);
  std::vector<float> scale(s.bytes / 4), ref(size_t(rows) * cols);
  std::memcpy(scale.data(), s.data, s.bytes);
  num::dequant_block(w.data, scale.data(), rows, cols, ref.data());
  // Where the copy lives: the same element offset as the weight in the
  // kernel layout (the slot table's offset), scales at offset / 32.
  size_t off = 0;
  const Mxfp8Layout& mx = st.mxfp8_layout(L);
  Region q_reg{}, sf_reg{};
  for (const auto& slot :
       moe_layer_slots(st.shape(L), name.substr(0, name.find("experts.")), st.layout(L).experts))
    if (slot.name == name) {
      off = slot.offset;
      if (slot.region == &MoeWeightLayout::w13) q_reg = mx.w13, sf_reg = mx.w13_sf;
      if (slot.region == &MoeWeightLayout::w2) q_reg = mx.w2, sf_reg = mx.w2_sf;
    }
  ASSERT_GT(q_reg.bytes, 0u) << name;
  const size_t mx_at =
      size_t(static_cast<const uint8_t*>(st.mxfp8_base(L)) - static_cast<const uint8_t*>(st.base(L)));
  std::vector<uint8_t> q(size_t(rows) * cols), sf(q.size() / 32);
  st.read_bytes(L, mx_at + q_reg.offset + off, q.size(), q.data());
  st.read_bytes(L, mx_at + sf_reg.offset + off / 32, sf.size(), sf.data());
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const float got =
          num::e4m3_decode(q[size_t(r) * cols + c]) * num::ue8m0_decode(sf[size_t(r) * (cols / 32) + c / 32]);
      ASSERT_EQ(num::float_bits(got), num::float_bits(ref[size_t(r) * cols + c]))
          << name << " at [" << r << ", " << c << "]: " << got << " vs " << ref[size_t(r) * cols + c];
    }
}

TEST(Store, Mxfp8CopyIsExactForPow2Scales) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 1, 19, /*pow2_scales=*/true);
  const io::Checkpoint ck(dir.path());
  WeightStoreOptions o;
  o.kernel_format = KernelFormat::kMxfp8Blackwell;
  WeightStore st = WeightStore::for_checkpoint(ck, d, o);
  num::test_hooks::reset_warn_once();
  testing::internal::CaptureStderr();
  LoadOptions lo;
  lo.shuffle = true;
  const FinishReport r = st.load(ck, lo);
  const std::string err = testing::internal::GetCapturedStderr();
  const int L = d.moe_layers[0];
  EXPECT_TRUE(st.ready(L));
  EXPECT_TRUE(r.mxfp8.all_pow2);
  EXPECT_EQ(r.mxfp8.rel_l2, 0.0);
  EXPECT_EQ(st.mxfp8_report(L).max_abs_err, 0.0);
  EXPECT_GT(st.mxfp8_report(L).elements, 0);
  EXPECT_EQ(err.find("power"), std::string::npos) << "no warning expected: " << err;
  ASSERT_NE(st.mxfp8_base(L), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(st.mxfp8_base(L)) % 256, 0u);
  const std::string p = d.layer_prefix(L);
  expect_mxfp8_exact(st, L, ck, p + "experts.0.gate_proj.weight");
  expect_mxfp8_exact(st, L, ck, p + "experts.7.up_proj.weight");
  expect_mxfp8_exact(st, L, ck, p + "experts.4.down_proj.weight");
  // The Hopper layout itself is untouched by the derived copy.
  EXPECT_EQ(layer_bytes(st, L), host_bytes(load_moe_layer(ck, d, L)));
}

// An expert-parallel rank's store (WeightStoreOptions::experts): only its experts'
// tensors land, laid out from the region starts; the other experts' are not held.
TEST(Store, ExpertRangeHoldsOneRanksExperts) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 2, 23, /*pow2_scales=*/true);
  const io::Checkpoint ck(dir.path());
  const ExpertRange own{2, 2};  // rank 1 of 4 (E = 8)
  WeightStoreOptions o;
  o.experts = own;
  o.kernel_format = KernelFormat::kMxfp8Blackwell;  // its derived copy holds the range too
  WeightStore st = WeightStore::for_checkpoint(ck, d, o);
  const FinishReport r = st.load(ck);  // finish() asks for the held tensors only
  EXPECT_EQ(r.layers_processed, 2);
  size_t held = 0;
  for (int L : d.moe_layers) held += moe_layer_slots(st.shape(L), d.layer_prefix(L), own).size();
  EXPECT_EQ(r.tensors, held);
  EXPECT_LT(r.tensors, moe_views(ck, d).size());
  for (int L : d.moe_layers) {
    const MoeShape& s = st.shape(L);
    EXPECT_TRUE(st.ready(L));
    EXPECT_EQ(st.layout(L).experts.first, own.first);
    EXPECT_EQ(st.layout(L).experts.count, own.count);
    EXPECT_FALSE(st.layout(L).whole(s));
    EXPECT_EQ(st.mxfp8_layout(L).w13.bytes * 4, Mxfp8Layout::compute(s).w13.bytes);
    // The bytes: the whole layer's, cut by region_copies into the rank's layout.
    const HostMoeWeights all = load_moe_layer(ck, d, L);
    std::vector<uint8_t> want(st.layout(L).total_bytes, 0);
    for (const RegionCopy& c : region_copies(all.layout, st.layout(L)))
      std::memcpy(want.data() + c.dst_offset, all.data() + c.src_offset, c.bytes);
    EXPECT_EQ(layer_bytes(st, L), want) << "layer " << L;
    const HostMoeWeights part = st.to_host(L);
    EXPECT_EQ(part.layout.experts.first, own.first);
    EXPECT_EQ(host_bytes(part), want);
    // A partial layer is no whole layer: no CPU view, no CPU forward.
    EXPECT_THROW(st.host_view(L), std::logic_error);
    const std::vector<num::bf16_t> x(size_t(2) * s.hidden, num::bf16_t{0x3f80});
    EXPECT_THROW(api::forward(api::Backend::kCpu, part, x.data(), 2), std::invalid_argument);
    // Written back, it is the rank's experts' tensors under their own names.
    const auto tensors = layer_tensors(part, d.layer_prefix(L));
    EXPECT_EQ(tensors.size(), moe_layer_slots(s, d.layer_prefix(L), own).size());
    for (const auto& t : tensors) {
      const io::TensorView v = ck.lookup(t.name);
      ASSERT_EQ(v.bytes, t.bytes) << t.name;
      EXPECT_EQ(std::memcmp(v.data, t.data, t.bytes), 0) << t.name;
    }
  }
  const int L = d.moe_layers[0];
  const std::string p = d.layer_prefix(L);
  expect_mxfp8_exact(st, L, ck, p + "experts.2.gate_proj.weight");
  expect_mxfp8_exact(st, L, ck, p + "experts.3.down_proj.weight");
  // Updates: another rank's expert is not held, an expert the layer lacks is an error.
  st.begin(ReloadMode::kDirect);
  EXPECT_FALSE(st.update(ck.lookup(p + "experts.5.up_proj.weight")));
  EXPECT_TRUE(st.update(ck.lookup(p + "experts.3.up_proj.weight")));
  EXPECT_TRUE(st.update(ck.lookup(p + "experts.3.up_proj.weight_scale_inv")));
  const io::TensorView g = ck.lookup(p + "experts.5.gate_proj.weight");
  EXPECT_THROW(st.update(p + "experts.8.gate_proj.weight", g.dtype, g.shape, g.data, g.bytes),
               io::FormatError);
  EXPECT_THROW(st.update(p + "experts.5.gate_proj.bias", g.dtype, g.shape, g.data, g.bytes), io::FormatError);
  st.finish();
  // Ranges outside the layer's experts are refused when the store is made.
  for (ExpertRange bad : {ExpertRange{7, 2}, ExpertRange{-1, 2}, ExpertRange{8, 1}}) {
    o.experts = bad;
    EXPECT_THROW(WeightStore::for_checkpoint(ck, d, o), std::invalid_argument)
        << bad.first << "+" << bad.count;
  }
}

TEST(Store, Mxfp8NonPow2WarnsOnceAndReportsTheError) {
  TempDir dir;
  const ModelDesc d = test::write_test_checkpoint(dir.path(), 2, 20, /*pow2_scales=*/false);
  const io::Checkpoint ck(dir.path());
  WeightStoreOptions o;
  o.kernel_format = KernelFormat::kMxfp8Blackwell;
  for (auto mode : {ReloadMode::kLayerwise, ReloadMode::kDirect}) {
    WeightStore st = WeightStore::for_checkpoint(ck, d, o);
    num::test_hooks::reset_warn_once();
    testing::internal::CaptureStderr();
    LoadOptions lo;
    lo.mode = mode;
    const FinishReport r = st.load(ck, lo);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_FALSE(r.mxfp8.all_pow2);
    // Second rounding of every element: about a few percent (docs/numerics.md §5).
    EXPECT_GT(r.mxfp8.rel_l2, 1e-3);
    EXPECT_LT(r.mxfp8.rel_l2, 0.1);
    // Exactly one warning per process, however many pairs and layers.
    size_t count = 0;
    for (size_t at = 0; (at = err.find("power", at)) != std::string::npos; ++at) ++count;
    EXPECT_EQ(count, 1u) << err;
  }
}

TEST(Store, Mxfp8NeedsK32) {
  MoeShape s = test::store_test_shape();
  s.hidden = 200;
  EXPECT_THROW(Mxfp8Layout::compute(s), std::invalid_argument);
}

TEST(Store, HashSeesEveryByte) {
  std::vector<uint8_t> a(1001, 3);
  const uint64_t h = hash_bytes(a.data(), a.size());
  for (size_t i : {size_t(0), size_t(500), size_t(1000)}) {
    a[i] ^= 1;
    EXPECT_NE(hash_bytes(a.data(), a.size()), h) << i;
    a[i] ^= 1;
  }
  EXPECT_NE(hash_bytes(a.data(), 1000), hash_bytes(a.data(), 1001));
}

}  // namespace
}  // namespace megamoe
