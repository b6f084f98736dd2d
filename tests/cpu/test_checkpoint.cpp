// Checkpoint <-> kernel layout: synthetic HF-layout checkpoints load back
// byte-identical to make_random_weights, the slot table tiles the layout, and
// load_moe_layer reports missing tensors and wrong dtypes/shapes by name.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "megamoe/weights/checkpoint_layout.h"
#include "store_support.h"

namespace megamoe {
namespace {

namespace fs = std::filesystem;

using io::Checkpoint;
using io::Dtype;
using io::Error;
using io::FormatError;
using io::NotFoundError;
using io::TensorToWrite;
using io::write_config;
using io::write_safetensors;
using test::TempDir;  // one per test, removed afterwards (store_support.h)

MoeShape small_shape(RouterDtype router) {
  MoeShape s;
  s.hidden = 256, s.inter = 128, s.experts = 8, s.topk = 2, s.shared_experts = 1;
  s.routed_scaling = 2.5f, s.router_dtype = router;
  return s;
}

// The deprecated io:: spellings of the layout mapping still compile and call it.
TEST(Checkpoint, IoSpellingsStillWork) {
  const MoeShape s = small_shape(RouterDtype::kBF16);
  EXPECT_EQ(io::moe_layer_slots(s, "p.").size(), moe_layer_slots(s, "p.").size());
}

// Partial edge blocks on both axes, two shared experts, no correction bias.
MoeShape ragged_shape() {
  MoeShape s;
  s.hidden = 320, s.inter = 96, s.experts = 4, s.topk = 2, s.shared_experts = 2;
  s.router_dtype = RouterDtype::kF32, s.correction_bias = false;
  return s;
}

::testing::AssertionResult same_bytes(const HostMoeWeights& a, const HostMoeWeights& b) {
  if (a.bytes() != b.bytes())
    return ::testing::AssertionFailure() << "sizes " << a.bytes() << " vs " << b.bytes();
  for (size_t i = 0; i < a.bytes(); ++i)
    if (a.data()[i] != b.data()[i])
      return ::testing::AssertionFailure()
             << "first difference at byte " << i << ": " << int(a.data()[i]) << " vs " << int(b.data()[i]);
  return ::testing::AssertionSuccess();
}

// A one-file checkpoint of one MoE layer (layer 1 of 2) for the tests that edit tensors.
ModelDesc small_desc(const MoeShape& s, const char* preset = "deepseek-v3") {
  ModelDesc d = model_desc(find_preset(preset));
  d.shape = s;
  d.num_layers = 2;
  d.moe_layers = {1};
  return d;
}

// Layer 1's tensors (BF16 router) as the tests that edit them before writing start.
struct LayerFile {
  ModelDesc d = small_desc(small_shape(RouterDtype::kBF16));
  HostMoeWeights w = make_random_weights(d.shape, 5);
  std::string prefix = d.layer_prefix(1);
  std::vector<TensorToWrite> ts = layer_tensors(w, prefix);  // views into w
};

std::string load_error(const fs::path& dir, const ModelDesc& d, int layer) {
  try {
    (void)load_moe_layer(Checkpoint(dir), d, layer);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

TEST(CheckpointSlots, TileTheLayoutExactly) {
  for (const MoeShape& s : {small_shape(RouterDtype::kBF16), ragged_shape()}) {
    SCOPED_TRACE(s.describe());
    const MoeWeightLayout l = MoeWeightLayout::compute(s);
    const auto slots = moe_layer_slots(s, "p.");
    // Sorted by absolute offset, the slots must be contiguous inside each
    // region and sum to the region's size: every byte written exactly once.
    std::vector<const TensorSlot*> sorted;
    for (const auto& t : slots) sorted.push_back(&t);
    std::sort(sorted.begin(), sorted.end(),
              [&](const TensorSlot* a, const TensorSlot* b) { return a->at(l) < b->at(l); });
    std::map<size_t, size_t> covered;  // region offset -> bytes
    for (size_t i = 0; i < sorted.size(); ++i) {
      const TensorSlot& t = *sorted[i];
      const Region& r = l.*t.region;
      EXPECT_LE(t.offset + t.bytes(), r.bytes) << t.name;
      if (i + 1 < sorted.size() && sorted[i + 1]->region == t.region) {
        EXPECT_EQ(t.at(l) + t.bytes(), sorted[i + 1]->at(l)) << t.name << " then " << sorted[i + 1]->name;
      }
      covered[r.offset] += t.bytes();
    }
    for (const Region* r : {&l.w13, &l.w13_scale, &l.w2, &l.w2_scale, &l.shared_w13, &l.shared_w13_scale,
                            &l.shared_w2, &l.shared_w2_scale, &l.router, &l.bias})
      if (r->bytes) {
        EXPECT_EQ(covered[r->offset], r->bytes) << "region at " << r->offset;
      }
    const size_t expect = size_t(s.experts) * 6 + (s.has_shared() ? 6 : 0) + 1 + (s.correction_bias ? 1 : 0);
    EXPECT_EQ(slots.size(), expect);
  }
}

TEST(CheckpointSlots, NamesAndShapes) {
  const MoeShape s = ragged_shape();  // H = 320 (3 blocks), I = 96 (1 block), Is = 192 (2 blocks)
  const auto slots = moe_layer_slots(s, "model.layers.4.mlp.");
  auto find = [&](const std::string& n) -> const TensorSlot& {
    auto it = std::find_if(slots.begin(), slots.end(), [&](const TensorSlot& t) { return t.name == n; });
    if (it == slots.end()) throw std::runtime_error("no slot " + n);
    return *it;
  };
  const TensorSlot& up = find("model.layers.4.mlp.experts.3.up_proj.weight");
  EXPECT_EQ(up.shape, (std::vector<int64_t>{96, 320}));
  EXPECT_EQ(up.dtype, Dtype::kF8_E4M3);
  EXPECT_EQ(up.offset, size_t(3 * 2 * 96 * 320 + 96 * 320));  // second half of expert 3's w13
  const TensorSlot& ups = find("model.layers.4.mlp.experts.3.up_proj.weight_scale_inv");
  EXPECT_EQ(ups.shape, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(ups.offset, size_t((3 * 2 + 1) * 3 * 4));  // block-row 1 of expert 3's two
  EXPECT_EQ(find("model.layers.4.mlp.shared_experts.down_proj.weight").shape,
            (std::vector<int64_t>{320, 192}));
  EXPECT_EQ(find("model.layers.4.mlp.shared_experts.down_proj.weight_scale_inv").shape,
            (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(find("model.layers.4.mlp.gate.weight").dtype, Dtype::kF32);
  EXPECT_THROW(find("model.layers.4.mlp.gate.e_score_correction_bias"), std::runtime_error);
}

struct SyntheticCase {
  const char* preset;
  bool pow2;
};

class CheckpointSynthetic : public ::testing::TestWithParam<SyntheticCase> {};

TEST_P(CheckpointSynthetic, LoadsBackByteIdentical) {
  const auto [preset_name, pow2] = GetParam();
  TempDir dir;
  const Preset& preset = find_preset(preset_name);
  MoeShape s = small_shape(preset.shape.router_dtype);
  s.swiglu_limit = preset.shape.swiglu_limit;
  const uint64_t seed = 1234;
  const ModelDesc written = write_synthetic_checkpoint(dir.path(), preset, 2, seed, pow2, s);

  const ModelDesc d = load_config(dir.path());
  EXPECT_EQ(d.family, preset.name);
  EXPECT_EQ(d.shape.describe(), s.describe());
  EXPECT_EQ(d.moe_layers, written.moe_layers);
  EXPECT_EQ(d.num_layers, preset.first_dense + 2);
  EXPECT_EQ(d.quant.pow2_scales(), pow2);

  const Checkpoint ckpt(dir.path());
  EXPECT_EQ(ckpt.num_files(), 5u);  // non-MoE shard + two per MoE layer
  // Dummy dense-layer MLP tensors sit under the same prefix form; the loader must skip them.
  if (preset.first_dense > 0) {
    EXPECT_FALSE(ckpt.names_with_prefix(d.layer_prefix(0)).empty());
  }
  ASSERT_EQ(d.moe_layers.size(), 2u);
  for (int layer : d.moe_layers) {
    SCOPED_TRACE(layer);
    const HostMoeWeights got = load_moe_layer(ckpt, d, layer);
    const HostMoeWeights want = make_random_weights(s, seed + uint64_t(layer), pow2);
    EXPECT_EQ(got.shape.router_dtype, s.router_dtype);
    EXPECT_TRUE(same_bytes(got, want));
    // The layer really spans two shards.
    EXPECT_NE(ckpt.lookup(d.layer_prefix(layer) + "experts.0.gate_proj.weight").file,
              ckpt.lookup(d.layer_prefix(layer) + "experts.7.gate_proj.weight").file);
  }
  EXPECT_THROW(load_moe_layer(ckpt, d, 0), std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(Families, CheckpointSynthetic,
                         ::testing::Values(SyntheticCase{"deepseek-v3", false},
                                           SyntheticCase{"glm-5.3-flash", true},
                                           SyntheticCase{"glm-5", false},
                                           SyntheticCase{"glm-4.7-flash", true}),
                         [](const auto& info) {
                           std::string n = std::string(info.param.preset) + (info.param.pow2 ? "_pow2" : "");
                           for (char& c : n)
                             if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

// A layer count the disk cannot hold (GLM-5: 9.7 GB a layer) or the config cannot name
// is an error before anything is written, and leaves no folder behind.
TEST(CheckpointSynthetic, TooManyLayersWriteNothing) {
  TempDir dir;
  const std::filesystem::path out = dir.path() / "ckpt";
  const Preset& glm5 = find_preset("glm-5");
  try {
    write_synthetic_checkpoint(out, glm5, 60000, 1, false);
    ADD_FAILURE() << "60000 GLM-5 layers (582 TB) were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("60000 MoE layers of glm-5 take 582"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("GB are free there"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(out));
  EXPECT_THROW(write_synthetic_checkpoint(out, glm5, ModelDesc::kMaxLayers, 1, false), std::invalid_argument);
  EXPECT_FALSE(std::filesystem::exists(out));
}

TEST(CheckpointLoad, RaggedShapeSingleFile) {
  TempDir dir;
  const MoeShape s = ragged_shape();
  const ModelDesc d = small_desc(s, "glm-4.7-flash");
  const HostMoeWeights w = make_random_weights(s, 7);
  write_layer_tensors(dir.path() / "model.safetensors", w, d.layer_prefix(1));
  write_config(dir.path(), d);
  const ModelDesc back = load_config(dir.path());
  EXPECT_FALSE(back.shape.correction_bias);
  EXPECT_TRUE(same_bytes(load_moe_layer(Checkpoint(dir.path()), back, 1), w));
}

TEST(CheckpointLoad, RouterDtypeComesFromTheFile) {
  // The GLM config implies an fp32 router; the file stores BF16: the file wins.
  TempDir dir;
  const ModelDesc d = small_desc(small_shape(RouterDtype::kF32), "glm-4.7-flash");
  const HostMoeWeights w = make_random_weights(small_shape(RouterDtype::kBF16), 3);
  write_layer_tensors(dir.path() / "model.safetensors", w, d.layer_prefix(1));
  const HostMoeWeights got = load_moe_layer(Checkpoint(dir.path()), d, 1);
  EXPECT_EQ(got.shape.router_dtype, RouterDtype::kBF16);
  EXPECT_TRUE(same_bytes(got, w));
}

TEST(CheckpointLoad, ReportsMissingTensorsByName) {
  TempDir dir;
  LayerFile f;
  auto& [d, w, prefix, ts] = f;
  std::erase_if(ts, [&](const TensorToWrite& t) {
    return t.name == prefix + "experts.3.up_proj.weight_scale_inv" ||
           t.name == prefix + "shared_experts.down_proj.weight";
  });
  write_safetensors(dir.path() / "model.safetensors", ts);
  const std::string msg = load_error(dir.path(), d, 1);
  EXPECT_NE(msg.find("2 missing tensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'model.layers.1.mlp.experts.3.up_proj.weight_scale_inv'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'model.layers.1.mlp.shared_experts.down_proj.weight'"), std::string::npos) << msg;
  EXPECT_THROW(load_moe_layer(Checkpoint(dir.path()), d, 1), NotFoundError);
}

TEST(CheckpointLoad, ReportsWrongShapeAndDtype) {
  TempDir dir;
  LayerFile f;
  auto& [d, w, prefix, ts] = f;
  for (auto& t : ts) {
    if (t.name == prefix + "experts.1.down_proj.weight") t.shape = {128, 256};  // transposed: same bytes
    if (t.name == prefix + "gate.e_score_correction_bias") t.dtype = Dtype::kI32;
  }
  const fs::path file = dir.path() / "model.safetensors";
  write_safetensors(file, ts);
  const std::string msg = load_error(dir.path(), d, 1);
  EXPECT_NE(
      msg.find(file.string() + ": tensor 'model.layers.1.mlp.experts.1.down_proj.weight': expected F8_E4M3 "
                               "[256, 128], found F8_E4M3 [128, 256]"),
      std::string::npos)
      << msg;
  EXPECT_NE(msg.find("'model.layers.1.mlp.gate.e_score_correction_bias': expected F32 [8], found I32 [8]"),
            std::string::npos)
      << msg;
  EXPECT_THROW(load_moe_layer(Checkpoint(dir.path()), d, 1), FormatError);
}

// Values no checkpoint holds, right dtype and shape: load_moe_layer refuses them as the
// WeightStore does (find_corrupt_value), naming file, tensor, position and rule.
TEST(CheckpointLoad, RefusesCorruptValues) {
  TempDir dir;
  LayerFile f;
  auto& [d, w, prefix, ts] = f;
  std::deque<std::vector<float>> copies;  // the altered F32 tensors' bytes
  auto poison = [&](const std::string& name, size_t i, float v) {
    for (auto& t : ts)
      if (t.name == prefix + name) {
        auto& c = copies.emplace_back(t.bytes / 4);
        std::memcpy(c.data(), t.data, t.bytes);
        c.at(i) = v;
        t.data = c.data();
        return;
      }
    ADD_FAILURE() << "no tensor " << name;
  };
  poison("experts.3.up_proj.weight_scale_inv", 1, 3e38f);  // [0, 1] of the [1, 2] grid: 448 x 3e38 overflows
  poison("gate.e_score_correction_bias", 5, NAN);
  write_safetensors(dir.path() / "model.safetensors", ts);
  const std::string msg = load_error(dir.path(), d, 1);
  EXPECT_NE(msg.find("tensor 'model.layers.1.mlp.experts.3.up_proj.weight_scale_inv' holds 3e+38 at [0, 1] "
                     "(a block scale must be >= 0 and 448 times it finite): the checkpoint is corrupt"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("tensor 'model.layers.1.mlp.gate.e_score_correction_bias' holds nan at [5] (router "
                     "weights and bias must be finite)"),
            std::string::npos)
      << msg;
  EXPECT_THROW(load_moe_layer(Checkpoint(dir.path()), d, 1), FormatError);
}

TEST(CheckpointLoad, RejectsUnsupportedRouterDtype) {
  TempDir dir;
  LayerFile f;
  auto& [d, w, prefix, ts] = f;
  for (auto& t : ts)
    if (t.name.ends_with("gate.weight")) t.dtype = Dtype::kF16;
  write_safetensors(dir.path() / "model.safetensors", ts);
  const std::string msg = load_error(dir.path(), d, 1);
  EXPECT_NE(msg.find("gate.weight': expected dtype BF16 or F32, found F16"), std::string::npos) << msg;
}

TEST(CheckpointLoad, ConfigWithFewerExpertsThanTheFile) {
  TempDir dir;
  const HostMoeWeights w = make_random_weights(small_shape(RouterDtype::kBF16), 5);
  MoeShape fewer = small_shape(RouterDtype::kBF16);
  fewer.experts = 4;
  const ModelDesc d = small_desc(fewer);
  write_layer_tensors(dir.path() / "model.safetensors", w, d.layer_prefix(1));
  const std::string msg = load_error(dir.path(), d, 1);
  EXPECT_NE(msg.find("unexpected tensor 'model.layers.1.mlp.experts.4.down_proj.weight'"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("E = 4"), std::string::npos) << msg;
}

}  // namespace
}  // namespace megamoe
