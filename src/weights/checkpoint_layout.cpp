// HF checkpoint tensors <-> the kernel layout of one MoE layer (see checkpoint_layout.h).
#include "megamoe/weights/checkpoint_layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <set>
#include <stdexcept>

#include "megamoe/numerics/fp8.h"
#include "megamoe/numerics/quant.h"

namespace megamoe {

using io::Dtype;
using io::dtype_size;
using io::format_shape;
using io::TensorToWrite;
using io::TensorView;

namespace {

// Only the first problems go into a message: a wrong E can make thousands.
constexpr size_t kMaxListed = 24;

std::string join_problems(const std::vector<std::string>& problems) {
  std::string out;
  for (size_t i = 0; i < problems.size() && i < kMaxListed; ++i) out += "\n  " + problems[i];
  if (problems.size() > kMaxListed) out += fmt::format("\n  ... and {} more", problems.size() - kMaxListed);
  return out;
}

// The slots of one SwiGLU MLP (a routed expert or the shared one): gate and up
// fill the two halves of its w13 rows and scale block-rows, down fills w2.
void add_mlp_slots(std::vector<TensorSlot>& out, const std::string& base, int H, int I, size_t index,
                   Region MoeWeightLayout::*w13, Region MoeWeightLayout::*w13_scale,
                   Region MoeWeightLayout::*w2, Region MoeWeightLayout::*w2_scale) {
  const int hb = MoeWeightLayout::hidden_blocks(H), ib = MoeWeightLayout::inter_blocks(I);
  const size_t half = size_t(I) * H;                          // bytes of gate (or up) codes
  const size_t half_scale = size_t(ib) * hb * sizeof(float);  // bytes of gate (or up) scales
  const size_t w2_bytes = size_t(H) * I, w2_scale_bytes = size_t(hb) * ib * sizeof(float);
  const size_t w13_at = index * 2 * half, w13s_at = index * 2 * half_scale;
  out.push_back({base + "gate_proj.weight", w13, w13_at, Dtype::kF8_E4M3, {I, H}});
  out.push_back({base + "gate_proj.weight_scale_inv", w13_scale, w13s_at, Dtype::kF32, {ib, hb}});
  out.push_back({base + "up_proj.weight", w13, w13_at + half, Dtype::kF8_E4M3, {I, H}});
  out.push_back({base + "up_proj.weight_scale_inv", w13_scale, w13s_at + half_scale, Dtype::kF32, {ib, hb}});
  out.push_back({base + "down_proj.weight", w2, index * w2_bytes, Dtype::kF8_E4M3, {H, I}});
  out.push_back(
      {base + "down_proj.weight_scale_inv", w2_scale, index * w2_scale_bytes, Dtype::kF32, {hb, ib}});
}

// Zeroes the bytes no tensor covers (alignment gaps between regions), so two
// loads of the same checkpoint are byte-identical over the whole buffer.
void zero_gaps(HostMoeWeights& w) {
  const MoeWeightLayout& l = w.layout;
  std::vector<Region> rs = {
      l.w13,       l.w13_scale,       l.w2,     l.w2_scale, l.shared_w13, l.shared_w13_scale,
      l.shared_w2, l.shared_w2_scale, l.router, l.bias};
  std::sort(rs.begin(), rs.end(), [](const Region& a, const Region& b) { return a.offset < b.offset; });
  size_t cursor = 0;
  for (const Region& r : rs) {
    if (r.bytes == 0) continue;
    if (r.offset > cursor) std::memset(w.data() + cursor, 0, r.offset - cursor);
    cursor = std::max(cursor, r.offset + r.bytes);
  }
  if (l.total_bytes > cursor) std::memset(w.data() + cursor, 0, l.total_bytes - cursor);
}

// Small deterministic dummy tensors; `store` owns their bytes until written.
TensorToWrite dummy(std::deque<std::vector<uint8_t>>& store, std::string name, Dtype dt,
                    std::vector<int64_t> shape) {
  size_t n = dtype_size(dt);
  for (int64_t d : shape) n *= size_t(d);
  auto& buf = store.emplace_back(n);
  for (size_t i = 0; i < n; ++i) buf[i] = uint8_t((i * 37 + 11) & 0x77);  // & 0x77: never an E4M3 NaN
  return {std::move(name), dt, std::move(shape), buf.data(), n};
}

}  // namespace

size_t TensorSlot::bytes() const {
  size_t n = dtype_size(dtype);
  for (int64_t d : shape) n *= size_t(d);
  return n;
}

std::optional<std::string> slot_mismatch(const TensorSlot& s, Dtype dtype, std::span<const int64_t> shape) {
  if (dtype == s.dtype && std::ranges::equal(shape, s.shape)) return std::nullopt;
  return fmt::format("expected {} {}, found {} {}", io::to_string(s.dtype), format_shape(s.shape),
                     io::to_string(dtype), format_shape(shape));
}

std::vector<std::string> unexpected_tensors(const std::vector<TensorSlot>& slots, std::string_view prefix,
                                            const MoeShape& s, const std::vector<std::string>& names) {
  std::set<std::string_view> expected;
  for (const TensorSlot& t : slots) expected.insert(t.name);
  std::vector<std::string> out;
  for (const std::string& n : names) {
    if (!n.starts_with(prefix)) continue;
    const std::string_view rest = std::string_view(n).substr(prefix.size());
    if ((rest.starts_with("experts.") || rest.starts_with("shared_experts.")) && !expected.count(n))
      out.push_back(fmt::format("unexpected tensor '{}' (config: E = {}, shared experts = {})", n, s.experts,
                                s.shared_experts));
  }
  return out;
}

std::optional<std::string> find_corrupt_value(const TensorSlot& s, const void* data) {
  const bool scale = s.region == &MoeWeightLayout::w13_scale || s.region == &MoeWeightLayout::w2_scale ||
                     s.region == &MoeWeightLayout::shared_w13_scale ||
                     s.region == &MoeWeightLayout::shared_w2_scale;
  auto good = [&](float v) { return scale ? num::is_valid_block_scale(v) : std::isfinite(v); };
  const int64_t cols = s.shape.size() >= 2 ? s.shape.back() : 1;
  auto scan = [&](auto value, size_t n) -> std::optional<std::string> {
    // (the common case without a branch a value: one pass, then find the culprit)
    bool ok = true;
    for (size_t i = 0; i < n; ++i) ok &= good(value(i));
    if (ok) return std::nullopt;
    size_t i = 0;
    while (good(value(i))) ++i;
    const int64_t r = int64_t(i) / cols, c = int64_t(i) % cols;
    return fmt::format("holds {} at [{}{}] ({})", value(i), r,
                       s.shape.size() >= 2 ? fmt::format(", {}", c) : std::string(),
                       scale ? "a block scale must be >= 0 and 448 times it finite"
                             : "router weights and bias must be finite");
  };
  if (s.dtype == Dtype::kF32) {
    const auto* f = static_cast<const float*>(data);
    return scan([&](size_t i) { return f[i]; }, s.bytes() / 4);
  }
  if (s.dtype == Dtype::kBF16) {
    const auto* h = static_cast<const num::bf16_t*>(data);
    return scan([&](size_t i) { return num::bf16_decode(h[i]); }, s.bytes() / 2);
  }
  return std::nullopt;  // E4M3 weights
}

std::vector<TensorSlot> moe_layer_slots(const MoeShape& s, std::string_view prefix) {
  return moe_layer_slots(s, prefix, ExpertRange{0, s.experts});
}

std::vector<TensorSlot> moe_layer_slots(const MoeShape& s, std::string_view prefix, ExpertRange experts) {
  const std::string p(prefix);
  std::vector<TensorSlot> out;
  out.reserve(size_t(experts.count) * 6 + 8);
  for (int e = experts.first; e < experts.first + experts.count; ++e)
    add_mlp_slots(out, fmt::format("{}experts.{}.", p, e), s.hidden, s.inter, size_t(e - experts.first),
                  &MoeWeightLayout::w13, &MoeWeightLayout::w13_scale, &MoeWeightLayout::w2,
                  &MoeWeightLayout::w2_scale);
  if (s.has_shared())
    add_mlp_slots(out, p + "shared_experts.", s.hidden, s.shared_inter(), 0, &MoeWeightLayout::shared_w13,
                  &MoeWeightLayout::shared_w13_scale, &MoeWeightLayout::shared_w2,
                  &MoeWeightLayout::shared_w2_scale);
  out.push_back({p + "gate.weight",
                 &MoeWeightLayout::router,
                 0,
                 s.router_dtype == RouterDtype::kBF16 ? Dtype::kBF16 : Dtype::kF32,
                 {s.experts, s.hidden}});
  if (s.correction_bias)
    out.push_back({p + "gate.e_score_correction_bias", &MoeWeightLayout::bias, 0, Dtype::kF32, {s.experts}});
  return out;
}

HostMoeWeights load_moe_layer(const io::Checkpoint& ckpt, const ModelDesc& desc, int layer) {
  desc.require_moe_layer(layer);
  const std::string prefix = desc.layer_prefix(layer);
  const std::string where = fmt::format("{}: MoE layer {} ({})", ckpt.dir().string(), layer, prefix);

  // The router dtype is the file's: configs do not always say how the router is stored.
  MoeShape shape = desc.shape;
  std::vector<std::string> problems;
  if (auto g = ckpt.find(prefix + "gate.weight")) {
    if (g->dtype == Dtype::kBF16)
      shape.router_dtype = RouterDtype::kBF16;
    else if (g->dtype == Dtype::kF32)
      shape.router_dtype = RouterDtype::kF32;
    else
      problems.push_back(fmt::format("{}: tensor '{}': expected dtype BF16 or F32, found {}", g->file,
                                     g->name, io::to_string(g->dtype)));
  }

  HostMoeWeights w(shape);
  const std::vector<TensorSlot> slots = moe_layer_slots(shape, prefix);
  std::vector<std::string> missing;
  std::vector<std::pair<const TensorSlot*, TensorView>> found;
  found.reserve(slots.size());
  for (const TensorSlot& s : slots) {
    auto v = ckpt.find(s.name);
    if (!v) {
      missing.push_back(s.name);
      continue;
    }
    if (auto wrong = slot_mismatch(s, v->dtype, v->shape)) {
      if (s.region == &MoeWeightLayout::router && v->dtype != s.dtype) continue;  // reported above
      problems.push_back(fmt::format("{}: tensor '{}': {}", v->file, s.name, *wrong));
      continue;
    }
    if (auto bad = find_corrupt_value(s, v->data)) {
      problems.push_back(fmt::format("{}: tensor '{}' {}: the checkpoint is corrupt", v->file, s.name, *bad));
      continue;
    }
    found.emplace_back(&s, *v);
  }

  for (auto& u : unexpected_tensors(slots, prefix, shape, ckpt.names_with_prefix(prefix)))
    problems.push_back(std::move(u));

  if (!missing.empty()) {
    std::vector<std::string> all;
    for (const auto& m : missing) all.push_back(fmt::format("missing tensor '{}'", m));
    all.insert(all.end(), problems.begin(), problems.end());
    throw io::NotFoundError(fmt::format("{}: {} missing tensor{}{}", where, missing.size(),
                                        missing.size() == 1 ? "" : "s", join_problems(all)));
  }
  if (!problems.empty())
    throw io::FormatError(fmt::format("{}: {} problem{}{}", where, problems.size(),
                                      problems.size() == 1 ? "" : "s", join_problems(problems)));

  zero_gaps(w);
  for (const auto& [slot, view] : found) std::memcpy(w.data() + slot->at(w.layout), view.data, view.bytes);
  return w;
}

std::vector<TensorToWrite> layer_tensors(const HostMoeWeights& w, std::string_view prefix) {
  std::vector<TensorToWrite> out;
  for (const TensorSlot& s : moe_layer_slots(w.shape, prefix, w.layout.experts))
    out.push_back({s.name, s.dtype, s.shape, w.data() + s.at(w.layout), s.bytes()});
  return out;
}

void write_layer_tensors(const std::filesystem::path& file, const HostMoeWeights& w,
                         std::string_view prefix) {
  io::write_safetensors(file, layer_tensors(w, prefix));
}

ModelDesc write_synthetic_checkpoint(const std::filesystem::path& dir, const ModelDesc& base,
                                     int num_moe_layers, uint64_t seed, bool pow2_scales,
                                     std::optional<MoeShape> shape) {
  if (num_moe_layers <= 0)
    throw std::invalid_argument(
        fmt::format("write_synthetic_checkpoint: num_moe_layers = {} must be > 0", num_moe_layers));
  ModelDesc d = base;
  if (shape) d.shape = *shape;
  d.shape.validate();
  const int first = base.moe_layers.empty() ? 0 : base.moe_layers.front();
  d.num_layers = first + num_moe_layers;
  d.moe_layers.clear();
  for (int l = first; l < d.num_layers; ++l) d.moe_layers.push_back(l);
  d.quant = QuantConfig{};
  if (pow2_scales) d.quant.scale_fmt = "ue8m0";

  if (num_moe_layers > ModelDesc::kMaxLayers - first)
    throw std::invalid_argument(
        fmt::format("write_synthetic_checkpoint: {} MoE layers from layer {} exceed {}", num_moe_layers,
                    first, ModelDesc::kMaxLayers));

  // Enough room for every layer before the first byte (a layer of GLM-5 is 9.7 GB: a
  // mistyped layer count should not end in a full disk and half a checkpoint), measured
  // on the folder or, before it exists, the nearest one above it.
  const double need = double(MoeWeightLayout::compute(d.shape).total_bytes) * num_moe_layers;
  std::filesystem::path probe = std::filesystem::absolute(dir);
  while (!std::filesystem::exists(probe) && probe.has_parent_path() && probe != probe.parent_path())
    probe = probe.parent_path();
  std::error_code space_ec;
  const std::filesystem::space_info room = std::filesystem::space(probe, space_ec);
  auto size_text = [](double b) {
    return b >= 1e9 ? fmt::format("{:.1f} GB", b * 1e-9) : fmt::format("{:.1f} MB", b * 1e-6);
  };
  if (!space_ec && need > double(room.available)) {
    const std::string what = fmt::format(
        "{} MoE layer{} of {} take{} {}", num_moe_layers, num_moe_layers == 1 ? "" : "s",
        d.family.empty() ? d.shape.describe() : d.family, num_moe_layers == 1 ? "s" : "", size_text(need));
    if (room.available == 0)
      throw io::Error(fmt::format("{}: no space is free there (a read-only or pseudo file system?); {}",
                                  dir.string(), what));
    throw io::Error(
        fmt::format("{}: {}, {} are free there", dir.string(), what, size_text(double(room.available))));
  }
  std::filesystem::create_directories(dir);
  const int num_shards = 1 + 2 * num_moe_layers;
  auto shard_name = [&](int i) {
    return fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, num_shards);
  };
  std::map<std::string, std::string> weight_map;
  uint64_t total = 0;
  auto put = [&](int shard, const std::vector<TensorToWrite>& ts) {
    io::write_safetensors(dir / shard_name(shard), ts, {{"format", "pt"}});
    for (const auto& t : ts) weight_map[t.name] = shard_name(shard), total += t.bytes;
  };

  // The language model's root ("model." or "model.language_model."), from the prefix format.
  const std::string fmt_str = d.layer_prefix_format;
  const std::string root = fmt_str.substr(0, fmt_str.find("layers."));
  auto layer_root = [&](int l) { return fmt::format("{}layers.{}.", root, l); };
  const int64_t H = d.shape.hidden;

  // Shard 0: things a MoE loader must skip.
  std::deque<std::vector<uint8_t>> store;
  std::vector<TensorToWrite> misc;
  misc.push_back(dummy(store, root + "embed_tokens.weight", Dtype::kBF16, {4, H}));
  misc.push_back(dummy(store, root + "norm.weight", Dtype::kBF16, {H}));
  misc.push_back(dummy(store, "lm_head.weight", Dtype::kBF16, {4, H}));
  if (root != "model.")
    misc.push_back(dummy(store, "model.visual.patch_embed.proj.weight", Dtype::kBF16, {8, 3, 2, 2}));
  for (int l = 0; l < d.num_layers; ++l) {
    misc.push_back(dummy(store, layer_root(l) + "input_layernorm.weight", Dtype::kBF16, {H}));
    misc.push_back(dummy(store, layer_root(l) + "self_attn.o_proj.weight", Dtype::kF8_E4M3, {16, 16}));
    misc.push_back(dummy(store, layer_root(l) + "self_attn.o_proj.weight_scale_inv", Dtype::kF32, {1, 1}));
    if (!d.is_moe_layer(l)) {
      for (const char* p : {"gate_proj", "up_proj", "down_proj"}) {
        misc.push_back(
            dummy(store, fmt::format("{}mlp.{}.weight", layer_root(l), p), Dtype::kF8_E4M3, {16, 16}));
        misc.push_back(
            dummy(store, fmt::format("{}mlp.{}.weight_scale_inv", layer_root(l), p), Dtype::kF32, {1, 1}));
      }
    }
  }
  put(0, misc);

  for (int i = 0; i < num_moe_layers; ++i) {
    const int l = d.moe_layers[size_t(i)];
    const HostMoeWeights w = make_random_weights(d.shape, seed + uint64_t(l), pow2_scales);
    const std::string prefix = d.layer_prefix(l);
    const std::string split = fmt::format("{}experts.{}.", prefix, d.shape.experts / 2);
    // Split the layer in two shards so a layer spans files, as in real
    // checkpoints. layer_tensors lists experts in order, then the shared
    // expert, then the router: everything from expert E/2 on goes to `b`,
    // except the router, which joins the first experts in `a`.
    std::vector<TensorToWrite> a, b;
    bool second = false;
    for (auto& t : layer_tensors(w, prefix)) {
      if (t.name == split + "gate_proj.weight") second = true;
      const bool router = t.name.starts_with(prefix + "gate.");
      (second && !router ? b : a).push_back(std::move(t));
    }
    put(1 + 2 * i, a);
    put(2 + 2 * i, b);
  }

  io::write_index(dir, weight_map, total);
  io::write_config(dir, d);
  return d;
}

ModelDesc write_synthetic_checkpoint(const std::filesystem::path& dir, const Preset& base, int num_moe_layers,
                                     uint64_t seed, bool pow2_scales, std::optional<MoeShape> shape) {
  return write_synthetic_checkpoint(dir, model_desc(base), num_moe_layers, seed, pow2_scales, shape);
}

}  // namespace megamoe
