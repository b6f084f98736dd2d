// Checkpoint subcommands of the `megamoe` tool: make-checkpoint, inspect,
// reload-check and load-bench. Everything they load goes through the
// WeightStore (weights/store.h), so the commands exercise the same code as a
// serving process.
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "commands.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/io/safetensors.h"
#include "megamoe/model/config.h"
#include "megamoe/numerics/quant.h"
#include "megamoe/weights/checkpoint_layout.h"
#include "megamoe/weights/device_memory.h"
#include "megamoe/weights/store.h"

namespace fs = std::filesystem;

namespace megamoe::tools {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---------------------------------------------------------------- make-checkpoint
struct MakeArgs {
  std::string preset = "glm-4.7-flash", out;
  int layers = 1;
  bool pow2 = false;
  uint64_t seed = 1;
  int hidden = 0, inter = 0, experts = 0, topk = 0;
};

int run_make(const MakeArgs& a) {
  const Preset& p = find_preset(a.preset);
  // Over an existing checkpoint the new shards would sit beside the old ones (whose names
  // differ when the layer count does): refused, not mixed.
  if (fs::exists(a.out) && (!fs::is_directory(a.out) || !fs::is_empty(a.out)))
    throw std::invalid_argument(
        fmt::format("--out {}: {}; make-checkpoint writes into a new or empty folder", a.out,
                    fs::is_directory(a.out) ? "the folder is not empty" : "exists and is not a folder"));
  std::optional<MoeShape> shape;
  if (a.hidden || a.inter || a.experts || a.topk)
    shape = with_shape_overrides(p.shape, a.hidden, a.inter, a.experts, a.topk);
  const ModelDesc d = write_synthetic_checkpoint(a.out, p, a.layers, a.seed, a.pow2, shape);
  fmt::print("wrote {} ({}): {} MoE layer{} ({}), {}\n", a.out, d.family, d.moe_layers.size(),
             d.moe_layers.size() == 1 ? "" : "s", d.moe_layers_text(), d.shape.describe());
  return 0;
}

// ---------------------------------------------------------------- progress bar
// A one-line bar on stderr, only when stderr is a terminal and the work is
// long enough to be worth one (many shards); redirected output stays clean.
class Progress {
 public:
  Progress(std::string label, size_t total, bool enabled)
      : label_(std::move(label)), total_(total), on_(enabled && total > 0 && ::isatty(2)) {}
  ~Progress() {
    if (on_ && drawn_) std::fputs("\n", stderr);
  }
  void set(size_t done) {
    if (!on_) return;
    const int width = 30, filled = int(double(done) / double(total_) * width);
    std::fprintf(stderr, "\r%s [%s%s] %zu/%zu", label_.c_str(), std::string(size_t(filled), '#').c_str(),
                 std::string(size_t(width - filled), '.').c_str(), done, total_);
    std::fflush(stderr);
    drawn_ = true;
  }

 private:
  std::string label_;
  size_t total_;
  bool on_;
  bool drawn_ = false;
};

std::string human_bytes(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (b >= 1000 && u < 4) b /= 1000, ++u;
  return fmt::format("{:.{}f} {}", b, u == 0 ? 0 : 2, units[u]);
}

// ---------------------------------------------------------------- inspect
struct InspectArgs {
  std::string path;
  bool json = false;
  int sample = 8;
  int ranks = 1;  // the device memory an expert-parallel rank needs, R ranks
};

// The tensors of a checkpoint folder or of one file, with the file each is in.
struct Source {
  std::optional<io::Checkpoint> ckpt;
  std::optional<io::SafetensorsFile> single;
  size_t num_files() const { return ckpt ? ckpt->num_files() : 1; }
  const io::SafetensorsFile& file(size_t i) const { return ckpt ? ckpt->file(i) : *single; }
  std::optional<io::TensorView> find(const std::string& name) const {
    return ckpt ? ckpt->find(name) : single->find(name);
  }
  std::vector<std::string> names_with_prefix(const std::string& prefix) const {
    if (ckpt) return ckpt->names_with_prefix(prefix);
    std::vector<std::string> out;
    for (const auto& t : single->tensors())
      if (t.name.starts_with(prefix)) out.push_back(t.name);
    return out;
  }
};

struct ScaleStats {
  int64_t scales = 0, pow2 = 0;
  size_t tensors = 0;
  // Scales no quantizer writes (NaN, infinite, negative or too large: a block scale is amax / 448
  // of finite weights, num::is_valid_block_scale),
  // which the loader refuses; the first one's tensor, index and value.
  int64_t corrupt = 0;
  std::string first_corrupt;
};

int run_inspect(const InspectArgs& a) {
  const fs::path path(a.path);
  Source src;
  std::optional<ModelDesc> desc;
  if (fs::is_directory(path)) {
    desc = load_config(path);
    src.ckpt.emplace(path);
  } else {
    src.single.emplace(path);
    // A lone shard: describe it with the model's config when one sits beside it.
    if (fs::exists(path.parent_path() / "config.json")) desc = load_config(path.parent_path());
  }
  if (!desc && a.ranks != 1)
    throw std::invalid_argument(fmt::format(
        "--ranks {}: a rank's memory needs the model's config.json (none beside {})", a.ranks, a.path));

  nlohmann::ordered_json j;
  j["path"] = a.path;
  size_t num_tensors = 0, bytes = 0;
  for (size_t f = 0; f < src.num_files(); ++f)
    for (const auto& t : src.file(f).tensors()) ++num_tensors, bytes += t.bytes();
  j["files"] = src.num_files();
  j["tensors"] = num_tensors;
  j["bytes"] = bytes;

  std::string text;
  auto out = std::back_inserter(text);
  fmt::format_to(out, "{}: {} file{}, {} tensors, {}\n", a.path, src.num_files(),
                 src.num_files() == 1 ? "" : "s", num_tensors, human_bytes(double(bytes)));

  if (desc) {
    const MoeShape& s = desc->shape;
    j["model"] = {{"model_type", desc->model_type},
                  {"family", desc->family},
                  {"hidden", s.hidden},
                  {"inter", s.inter},
                  {"experts", s.experts},
                  {"topk", s.topk},
                  {"shared_experts", s.shared_experts},
                  {"num_layers", desc->num_layers},
                  {"moe_layers", desc->moe_layers},
                  {"mtp_layers", desc->mtp_layers},
                  {"routing",
                   {{"score", to_string(s.score)},
                    {"n_group", s.n_group},
                    {"topk_group", s.topk_group},
                    {"norm_topk_prob", s.norm_topk_prob},
                    {"routed_scaling", s.routed_scaling},
                    {"router_dtype", to_string(s.router_dtype)},
                    {"correction_bias", s.correction_bias},
                    {"swiglu_limit", s.swiglu_limit}}},
                  {"quant",
                   {{"fmt", desc->quant.fmt},
                    {"block", desc->quant.block},
                    {"scale_fmt", desc->quant.scale_fmt.value_or("float32")}}}};
    fmt::format_to(out, "model     {} (family {})\n", desc->model_type, desc->family);
    fmt::format_to(out, "shape     H {}  I {}  E {}  K {}  shared {}\n", s.hidden, s.inter, s.experts, s.topk,
                   s.shared_experts);
    fmt::format_to(out, "layers    {} decoder layers, {} MoE: {}\n", desc->num_layers,
                   desc->moe_layers.size(), desc->moe_layers_text());
    fmt::format_to(
        out,
        "routing   {} scores, groups {}/{}, renormalize {}, scaling {}, router {} (config), bias {}, swiglu "
        "limit {}\n",
        to_string(s.score), s.n_group, s.topk_group, s.norm_topk_prob, s.routed_scaling,
        to_string(s.router_dtype), s.correction_bias, s.swiglu_limit);
    fmt::format_to(out, "quant     {} {} blocks {}x{}, scale_fmt {}\n", desc->quant.quant_method,
                   desc->quant.fmt, desc->quant.block[0], desc->quant.block[1],
                   desc->quant.scale_fmt.value_or("float32"));
    // Device memory of the weights in the kernel layout (the router as the config says):
    // a whole MoE layer, and an expert-parallel rank's part (WeightStoreOptions::experts).
    const int R = a.ranks, layers = int(desc->moe_layers.size());
    if (R < 1 || s.experts % R != 0)
      throw std::invalid_argument(fmt::format("--ranks {}: must be >= 1 and divide E = {}", R, s.experts));
    const size_t whole = MoeWeightLayout::compute(s).total_bytes;
    const size_t part = MoeWeightLayout::compute(s, ExpertRange{0, s.experts / R}).total_bytes;
    j["memory"] = {{"layer_bytes", whole},
                   {"ranks", R},
                   {"rank_layer_bytes", part},
                   {"rank_bytes", part * size_t(layers)}};
    fmt::format_to(out, "memory    {} a MoE layer in the kernel layout, {} for the {} MoE layer{}\n",
                   human_bytes(double(whole)), human_bytes(double(whole) * layers), layers,
                   layers == 1 ? "" : "s");
    if (R > 1)
      fmt::format_to(out,
                     "          {} ranks: {} a rank and layer ({} of {} experts, the shared expert, the "
                     "router), {} a rank\n",
                     R, human_bytes(double(part)), s.experts / R, s.experts,
                     human_bytes(double(part) * layers));
  }

  // Per-layer table (with a config) and the scale statistics. Reading every
  // scale touches every shard: that is where the progress bar goes.
  Progress bar("inspect: reading scales", src.num_files(), src.num_files() >= 4);
  ScaleStats total;
  // Tensors the loader refuses: a dtype or shape the config does not give, a name in a
  // layer's expert namespaces that the config has no slot for (it disagrees on E or S), a
  // router or bias value that is not finite (the block scales count as corrupt scales).
  std::vector<std::string> refused;
  std::vector<std::pair<std::string, std::string>> pairs;  // (weight, scale) names, for the MXFP8 sample
  auto count_scales = [&](const io::TensorView& v, ScaleStats& st) {
    if (v.dtype != io::Dtype::kF32) return;
    const size_t n = v.bytes / 4;
    for (size_t i = 0; i < n; ++i) {
      float x;
      std::memcpy(&x, v.data + 4 * i, 4);
      st.pow2 += num::is_pow2_scale(x);
      if (!num::is_valid_block_scale(x) && st.corrupt++ == 0) {
        const size_t cols = v.shape.size() == 2 ? size_t(v.shape[1]) : 1;
        st.first_corrupt = fmt::format("{} [{}, {}] = {}", v.name, i / cols, i % cols, x);
      }
    }
    st.scales += int64_t(n);
    ++st.tensors;
  };

  // The table's layers: the main MoE layers, then the MTP layers the checkpoint holds
  // (their router is there; a checkpoint may leave them out).
  std::vector<int> table_layers, absent_mtp;
  if (desc) {
    table_layers = desc->moe_layers;
    for (int L : desc->mtp_layers)
      (src.find(desc->layer_prefix(L) + "gate.weight") ? table_layers : absent_mtp).push_back(L);
  }
  if (!table_layers.empty()) {
    fmt::format_to(out, "\n{:>6}  {:<40} {:>9} {:>10} {:>7} {:>6} {:>7}\n", "layer", "prefix", "tensors",
                   "bytes", "router", "shards", "pow2");
    j["layers"] = nlohmann::json::array();
  }
  std::vector<ScaleStats> per_layer(table_layers.size());
  size_t done_files = 0;
  std::set<std::string_view> seen_files;
  if (desc) {
    for (size_t li = 0; li < table_layers.size(); ++li) {
      const int L = table_layers[li];
      const bool mtp = li >= desc->moe_layers.size();
      const std::string prefix = desc->layer_prefix(L);
      MoeShape s = desc->shape;
      std::string router = "missing";
      if (auto g = src.find(prefix + "gate.weight")) {
        router = std::string(io::to_string(g->dtype));
        s.router_dtype = g->dtype == io::Dtype::kBF16 ? RouterDtype::kBF16 : RouterDtype::kF32;
      }
      const auto slots = moe_layer_slots(s, prefix);
      size_t found = 0, layer_bytes = 0;
      std::set<std::string_view> shards;
      std::vector<std::string> missing, wrong;
      for (const auto& slot : slots) {
        auto v = src.find(slot.name);
        if (!v) {
          missing.push_back(slot.name);
          continue;
        }
        if (auto mismatch = slot_mismatch(slot, v->dtype, v->shape))
          wrong.push_back(fmt::format("tensor '{}': {}", slot.name, *mismatch));
        else if (slot.region == &MoeWeightLayout::router || slot.region == &MoeWeightLayout::bias)
          // (the block scales are counted below, as corrupt scales)
          if (auto bad = find_corrupt_value(slot, v->data))
            wrong.push_back(fmt::format("tensor '{}' {}", slot.name, *bad));
        ++found, layer_bytes += v->bytes;
        shards.insert(v->file);
        if (slot.name.ends_with("_scale_inv")) {
          count_scales(*v, per_layer[li]);
          if (slot.region != &MoeWeightLayout::shared_w13_scale &&
              slot.region != &MoeWeightLayout::shared_w2_scale)
            pairs.emplace_back(slot.name.substr(0, slot.name.size() - 10), slot.name);
        }
        if (seen_files.insert(v->file).second) bar.set(++done_files);
      }
      for (auto& u : unexpected_tensors(slots, prefix, s, src.names_with_prefix(prefix)))
        wrong.push_back(std::move(u));
      refused.insert(refused.end(), wrong.begin(), wrong.end());
      const ScaleStats& st = per_layer[li];
      total.scales += st.scales, total.pow2 += st.pow2, total.tensors += st.tensors;
      if (total.corrupt == 0) total.first_corrupt = st.first_corrupt;
      total.corrupt += st.corrupt;
      const double frac = st.scales ? double(st.pow2) / double(st.scales) : 0.0;
      fmt::format_to(
          out, "{:>6}  {:<40} {:>4}/{:<4} {:>10} {:>7} {:>6} {:>6.1f}%{}{}{}\n", L, prefix, found,
          slots.size(), human_bytes(double(layer_bytes)), router, shards.size(), 100 * frac,
          mtp ? "  (MTP)" : "",
          missing.empty() ? "" : fmt::format("  missing {} (first: {})", missing.size(), missing.front()),
          wrong.empty() ? "" : fmt::format("  refused {} (first: {})", wrong.size(), wrong.front()));
      j["layers"].push_back({{"layer", L},
                             {"mtp", mtp},
                             {"prefix", prefix},
                             {"tensors", found},
                             {"expected", slots.size()},
                             {"missing", missing},
                             {"refused", wrong},
                             {"bytes", layer_bytes},
                             {"router_dtype", router},
                             {"shards", shards.size()},
                             {"pow2_scale_fraction", frac}});
    }
    if (!absent_mtp.empty()) {
      fmt::format_to(out, "{:>6}  MTP layer{} {} not in this checkpoint\n", "",
                     absent_mtp.size() == 1 ? "" : "s", layer_ranges_text(absent_mtp));
      j["mtp_layers_absent"] = absent_mtp;
    }
  } else {
    // No config: every block scale in the file, paired by name.
    const io::SafetensorsFile& f = src.file(0);
    for (const auto& t : f.tensors()) {
      if (!t.name.ends_with("_scale_inv")) continue;
      count_scales(f.view(t), total);
      const std::string w = t.name.substr(0, t.name.size() - 10);
      if (f.find(w)) pairs.emplace_back(w, t.name);
    }
    bar.set(1);
  }
  bar.set(src.num_files());

  // Estimated MXFP8 requantization error on an evenly spread sample of pairs.
  num::RequantReport est;
  size_t sampled = 0;
  const size_t n_sample = std::min(pairs.size(), size_t(std::max(a.sample, 0)));
  for (size_t k = 0; k < n_sample; ++k) {
    const auto& [wn, sn] = pairs[k * pairs.size() / n_sample];
    auto w = src.find(wn), sc = src.find(sn);
    if (!w || !sc || w->dtype != io::Dtype::kF8_E4M3 || sc->dtype != io::Dtype::kF32 ||
        w->shape.size() != 2 || w->shape[1] % num::kMxGroup != 0)
      continue;
    const int rows = int(w->shape[0]), cols = int(w->shape[1]);
    if (sc->shape.size() != 2 || sc->shape[0] != (rows + 127) / 128 || sc->shape[1] != (cols + 127) / 128)
      continue;
    std::vector<float> scale(sc->bytes / 4);
    std::memcpy(scale.data(), sc->data, sc->bytes);
    if (!std::all_of(scale.begin(), scale.end(), num::is_valid_block_scale))
      continue;  // (counted above as corrupt; the requantization would refuse it)
    std::vector<uint8_t> q(w->bytes), sf(w->bytes / num::kMxGroup);
    est += num::requant_block_to_mxfp8(w->data, scale.data(), rows, cols, q.data(), sf.data());
    ++sampled;
  }
  const double pow2_frac = total.scales ? double(total.pow2) / double(total.scales) : 0.0;
  j["scales"] = {{"tensors", total.tensors},
                 {"count", total.scales},
                 {"pow2_fraction", pow2_frac},
                 {"corrupt", total.corrupt},
                 {"first_corrupt", total.first_corrupt}};
  j["mxfp8_estimate"] = {{"sampled_tensors", sampled},
                         {"rel_l2", est.rel_l2},
                         {"max_abs_err", est.max_abs_err},
                         {"exact", sampled > 0 && est.all_pow2}};
  fmt::format_to(out, "\nscales    {} block scales in {} tensors, {:.2f}% powers of two\n", total.scales,
                 total.tensors, 100 * pow2_frac);
  if (total.corrupt)
    fmt::format_to(
        out,
        "CORRUPT   {} block scale{} NaN, infinite, negative or too large (first: {}): the loader refuses "
        "this checkpoint\n",
        total.corrupt, total.corrupt == 1 ? " is" : "s are", total.first_corrupt);
  j["refused"] = refused.size();
  if (!refused.empty())
    fmt::format_to(out,
                   "REFUSED   {} tensor{} with a dtype, shape or name the config does not give, or a "
                   "non-finite router or bias value (first: {}): the loader refuses this checkpoint\n",
                   refused.size(), refused.size() == 1 ? "" : "s", refused.front());
  if (sampled)
    fmt::format_to(
        out, "mxfp8     requantization estimate on {} sampled tensor{}: rel L2 {:.3e}, max abs {:.3e}{}\n",
        sampled, sampled == 1 ? "" : "s", est.rel_l2, est.max_abs_err,
        est.all_pow2 ? " (exact: power-of-two scales)" : "");
  else
    fmt::format_to(out, "mxfp8     no tensor to sample (needs E4M3 weights with K % 32 == 0)\n");

  if (a.json)
    fmt::print("{}\n", j.dump(2));
  else
    fmt::print("{}", text);
  return total.corrupt || !refused.empty() ? 1 : 0;  // (the report is the output either way)
}

// ---------------------------------------------------------------- reload-check
struct ReloadArgs {
  std::string checkpoint, mode = "layerwise", backend = "cpu", format = "hopper";
  int tokens = 16;
  uint64_t seed = 1;
};

struct Snapshot {
  std::vector<uintptr_t> address;  // per region
  std::vector<uint64_t> hash;
  std::vector<uint8_t> bytes;  // the whole allocation, for an exact compare
};

struct NamedRegion {
  std::string name;
  size_t offset, bytes;
};

// Every buffer of a layer: the kernel layout's regions and the MXFP8 copy's.
std::vector<NamedRegion> layer_regions(const WeightStore& st, int L) {
  const MoeWeightLayout& l = st.layout(L);
  std::vector<NamedRegion> r = {{"w13", l.w13.offset, l.w13.bytes},
                                {"w13_scale", l.w13_scale.offset, l.w13_scale.bytes},
                                {"w2", l.w2.offset, l.w2.bytes},
                                {"w2_scale", l.w2_scale.offset, l.w2_scale.bytes},
                                {"shared_w13", l.shared_w13.offset, l.shared_w13.bytes},
                                {"shared_w13_scale", l.shared_w13_scale.offset, l.shared_w13_scale.bytes},
                                {"shared_w2", l.shared_w2.offset, l.shared_w2.bytes},
                                {"shared_w2_scale", l.shared_w2_scale.offset, l.shared_w2_scale.bytes},
                                {"router", l.router.offset, l.router.bytes},
                                {"bias", l.bias.offset, l.bias.bytes}};
  if (st.mxfp8_base(L)) {
    const Mxfp8Layout& m = st.mxfp8_layout(L);
    const size_t at =
        size_t(static_cast<const uint8_t*>(st.mxfp8_base(L)) - static_cast<const uint8_t*>(st.base(L)));
    for (auto [n, reg] : {std::pair{"mx_w13", m.w13},
                          {"mx_w13_sf", m.w13_sf},
                          {"mx_w2", m.w2},
                          {"mx_w2_sf", m.w2_sf},
                          {"mx_shared_w13", m.shared_w13},
                          {"mx_shared_w13_sf", m.shared_w13_sf},
                          {"mx_shared_w2", m.shared_w2},
                          {"mx_shared_w2_sf", m.shared_w2_sf}})
      r.push_back({n, at + reg.offset, reg.bytes});
  }
  std::erase_if(r, [](const NamedRegion& x) { return x.bytes == 0; });
  return r;
}

Snapshot snapshot(const WeightStore& st, int L) {
  Snapshot s;
  s.bytes.resize(st.allocation_bytes(L));
  st.read_bytes(L, 0, s.bytes.size(), s.bytes.data());
  for (const auto& r : layer_regions(st, L)) {
    s.address.push_back(reinterpret_cast<uintptr_t>(st.base(L)) + r.offset);
    s.hash.push_back(hash_bytes(s.bytes.data() + r.offset, r.bytes));
  }
  return s;
}

// One forward of every held layer on the same tokens; the output bytes per layer.
class Forwarder {
 public:
  Forwarder(const WeightStore& st, bool cuda, int T, uint64_t seed) : st_(st), cuda_(cuda), T_(T) {
    for (int L : st.layers()) {
      const int H = st.shape(L).hidden;
      std::mt19937_64 rng(seed + uint64_t(L));
      std::normal_distribution<float> nd(0.0f, 1.0f);
      auto& x = x_.emplace_back(size_t(T) * H);
      for (auto& v : x) v = num::bf16_encode(nd(rng));
    }
    if (!cuda_) {
      api::MoeLayerOptions o;
      o.max_tokens = std::max(T, 1);
      // (over the buffer, as the CUDA layers: the check also runs the zeroed experts,
      // which a layer over the store would refuse as not ready)
      for (int L : st.layers())
        cpu_layers_.push_back(std::make_unique<api::CpuMoeLayer>(st.shape(L), st.host_view(L), o));
    }
#if defined(MEGAMOE_HAVE_CUDA)
    // NOTE: the layers borrow the store's buffers once, before any reload: a
    // reload that moved a buffer would leave them reading freed memory.
    if (cuda_) {
      api::MoeLayerOptions o;
      o.max_tokens = T;
      for (int L : st.layers()) layers_.push_back(std::make_unique<api::CudaMoeLayer>(st, L, o));
    }
#else
    if (cuda_) throw std::runtime_error("--backend cuda: this build has no CUDA backend");
#endif
  }

  std::vector<std::vector<uint8_t>> run() {
    std::vector<std::vector<uint8_t>> out;
    for (size_t i = 0; i < st_.layers().size(); ++i) {
      const int L = st_.layers()[i];
      const MoeShape& s = st_.shape(L);
      std::vector<uint8_t> y;
      if (!cuda_) {
        // The CPU layer over the store's live host buffer itself (no copy), so the
        // check reads what a server would.
        std::vector<float> yf(size_t(T_) * s.hidden);
        cpu_layers_[i]->forward(x_[i].data(), yf.data(), T_, nullptr);
        y.resize(yf.size() * 4);
        std::memcpy(y.data(), yf.data(), y.size());
      } else {
#if defined(MEGAMOE_HAVE_CUDA)
        const size_t xb = x_[i].size() * 2;
        void* dx = dev::device_alloc(xb);
        void* dy = dev::device_alloc(xb);
        try {
          dev::copy_to_device(dx, x_[i].data(), xb);
          layers_[i]->forward(static_cast<const num::bf16_t*>(dx), static_cast<num::bf16_t*>(dy), T_, nullptr,
                              nullptr);
          y.resize(xb);
          dev::copy_to_host(y.data(), dy, xb);  // synchronous: waits for the forward
        } catch (...) {
          dev::device_free(dx), dev::device_free(dy);
          throw;
        }
        dev::device_free(dx), dev::device_free(dy);
#endif
      }
      out.push_back(std::move(y));
    }
    return out;
  }

 private:
  const WeightStore& st_;
  bool cuda_;
  int T_;
  std::vector<std::vector<num::bf16_t>> x_;
  std::vector<std::unique_ptr<api::CpuMoeLayer>> cpu_layers_;
#if defined(MEGAMOE_HAVE_CUDA)
  std::vector<std::unique_ptr<api::CudaMoeLayer>> layers_;
#endif
};

int run_reload_check(const ReloadArgs& a) {
  const ReloadMode mode = parse_reload_mode(a.mode);
  if (a.backend != "cpu" && a.backend != "cuda")
    throw std::invalid_argument(fmt::format("--backend {}: expected cpu or cuda", a.backend));
  if (a.format != "hopper" && a.format != "mxfp8")
    throw std::invalid_argument(fmt::format("--format {}: expected hopper or mxfp8", a.format));
  if (a.tokens < 1) throw std::invalid_argument(fmt::format("--tokens {} must be >= 1", a.tokens));
  const bool cuda = a.backend == "cuda";
  if (cuda) {
    std::string why;
    if (!dev::device_memory_available(&why)) throw std::runtime_error("--backend cuda: " + why);
  }
  const ModelDesc desc = load_config(a.checkpoint);
  const io::Checkpoint ckpt(a.checkpoint);
  WeightStoreOptions opt;
  opt.memory = cuda ? StoreMemory::kDevice : StoreMemory::kHost;
  opt.kernel_format = a.format == "mxfp8" ? KernelFormat::kMxfp8Blackwell : KernelFormat::kBlockFp8Hopper;
  WeightStore st = WeightStore::for_checkpoint(ckpt, desc, opt);

  auto t0 = Clock::now();
  const FinishReport cold = st.load(ckpt);
  fmt::print("cold load: {} layers, {} tensors, {} in {:.3f} s ({} memory, {})\n", st.layers().size(),
             cold.tensors, human_bytes(double(cold.bytes)), seconds_since(t0), to_string(st.memory()),
             to_string(st.kernel_format()));
  if (st.kernel_format() == KernelFormat::kMxfp8Blackwell)
    fmt::print("MXFP8 derived copy: rel L2 {:.3e} vs block FP8, max abs {:.3e}{}\n", cold.mxfp8.rel_l2,
               cold.mxfp8.max_abs_err, cold.mxfp8.all_pow2 ? " (exact: power-of-two scales)" : "");
  Forwarder fwd(st, cuda, a.tokens, a.seed);
  const auto y_cold = fwd.run();
  std::vector<Snapshot> before;
  for (int L : st.layers()) before.push_back(snapshot(st, L));

  for (int L : st.layers()) st.zero_experts(L);
  const auto y_zero = fwd.run();

  LoadOptions lo;
  lo.mode = mode, lo.shuffle = true, lo.seed = a.seed;
  t0 = Clock::now();
  const FinishReport re = st.load(ckpt, lo);
  fmt::print("reload ({}, shuffled, weights and scales in separate calls): {} tensors in {:.3f} s\n",
             to_string(mode), re.tensors, seconds_since(t0));
  const auto y_re = fwd.run();

  int failures = 0;
  fmt::print("\n{:>5}  {:<17} {:>18} {:>18} {:>16} {:>16}  {}\n", "layer", "buffer", "address before",
             "address after", "hash before", "hash after", "status");
  for (size_t i = 0; i < st.layers().size(); ++i) {
    const int L = st.layers()[i];
    const Snapshot after = snapshot(st, L);
    const auto regions = layer_regions(st, L);
    for (size_t r = 0; r < regions.size(); ++r) {
      const bool ok = before[i].address[r] == after.address[r] && before[i].hash[r] == after.hash[r] &&
                      std::memcmp(before[i].bytes.data() + regions[r].offset,
                                  after.bytes.data() + regions[r].offset, regions[r].bytes) == 0;
      failures += !ok;
      fmt::print("{:>5}  {:<17} {:>#18x} {:>#18x} {:>016x} {:>016x}  {}\n", L, regions[r].name,
                 before[i].address[r], after.address[r], before[i].hash[r], after.hash[r],
                 ok ? "ok" : "DIFFERS");
    }
    const bool whole = before[i].bytes == after.bytes;
    const bool out_ok = y_cold[i] == y_re[i];
    const bool zero_changed = y_zero[i] != y_cold[i];
    failures += !whole + !out_ok + !st.ready(L);
    fmt::print("{:>5}  {:<17} {} bytes {}, forward output ({} tokens, {}) {}{}{}\n", L, "(layer)",
               before[i].bytes.size(), whole ? "identical" : "DIFFER", a.tokens, a.backend,
               out_ok ? "identical" : "DIFFERS",
               zero_changed ? "" : " (warning: zeroed experts gave the same output)",
               st.ready(L) ? "" : ", layer NOT READY");
  }
  if (failures) {
    fmt::print("reload-check: FAILED ({} difference{})\n", failures, failures == 1 ? "" : "s");
    return 1;
  }
  fmt::print("reload-check: OK ({} mode, {} backend): addresses, bytes and outputs identical\n",
             to_string(mode), a.backend);
  return 0;
}

// ---------------------------------------------------------------- load-bench
struct LoadBenchArgs {
  std::string checkpoint, json;
};

// Resident and peak resident set size in bytes (Linux /proc).
std::pair<size_t, size_t> rss_now_and_peak() {
  std::ifstream in("/proc/self/status");
  std::string line;
  size_t rss = 0, hwm = 0;
  while (std::getline(in, line)) {
    if (line.starts_with("VmRSS:")) rss = std::stoull(line.substr(6)) * 1024;
    if (line.starts_with("VmHWM:")) hwm = std::stoull(line.substr(6)) * 1024;
  }
  return {rss, hwm};
}

// Resets the peak RSS to the current RSS (Linux >= 4.0), so VmHWM measures
// only what follows.
bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  return bool(f);
}

// The floor: read every shard once, sequentially, into one reused buffer.
double plain_read_seconds(const std::vector<std::string>& files, std::vector<char>& buf) {
  const auto t0 = Clock::now();
  for (const auto& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw io::Error(fmt::format("{}: open failed: {}", f, std::strerror(errno)));
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    ssize_t r;
    while ((r = ::read(fd, buf.data(), buf.size())) > 0) {
    }
    ::close(fd);
    if (r < 0) throw io::Error(fmt::format("{}: read failed", f));
  }
  return seconds_since(t0);
}

int run_load_bench(const LoadBenchArgs& a) {
  if (!a.json.empty()) check_output_file("--json", a.json);  // (before the benchmark)
  const ModelDesc desc = load_config(a.checkpoint);
  const io::Checkpoint ckpt(a.checkpoint);
  std::vector<std::string> files;
  size_t file_bytes = 0, largest = 0;
  for (size_t i = 0; i < ckpt.num_files(); ++i) {
    files.push_back(ckpt.file(i).path());
    const size_t n = fs::file_size(files.back());
    file_bytes += n, largest = std::max(largest, n);
  }
  fmt::print("load-bench: {} ({}), {} shards, {} (largest shard {})\n", a.checkpoint, desc.family,
             files.size(), human_bytes(double(file_bytes)), human_bytes(double(largest)));

  // Plain reads and store loads interleaved (R L R L R L), so both see the
  // same page-cache state; medians of three. The later loads are in-place
  // reloads into the same buffers, which is also what an RL weight push does.
  // The plain read's buffer, zeroed (resident) before the baseline: it is this benchmark's
  // comparison, not the store's overhead (inside the loop it put 16.8 MB into every peak, 17 MB
  // of the 17.3 reported on a tiny checkpoint).
  std::vector<char> read_buf(16u << 20);
  const auto [rss0, hwm0] = rss_now_and_peak();
  (void)hwm0;
  const bool peak_ok = reset_peak_rss();
  auto t0 = Clock::now();
  WeightStore st = WeightStore::for_checkpoint(ckpt, desc);
  const double alloc_s = seconds_since(t0);
  std::vector<double> reads, loads;
  FinishReport rep;
  for (int i = 0; i < 3; ++i) {
    reads.push_back(plain_read_seconds(files, read_buf));
    t0 = Clock::now();
    rep = st.load(ckpt);
    loads.push_back(seconds_since(t0));
  }
  const auto [rss1, hwm1] = rss_now_and_peak();
  (void)rss1;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double read_s = median(reads), load_s = median(loads);
  const double read_gbs = double(file_bytes) / read_s * 1e-9;
  const double load_gbs = double(rep.bytes) / load_s * 1e-9;
  // Extra memory: the peak above the store's own buffers (which are the
  // destination, not overhead).
  const double extra = double(hwm1) - double(rss0) - double(st.total_bytes());

  fmt::print("plain sequential read : {} in {:.3f} s = {:.2f} GB/s (median of {:.3f} {:.3f} {:.3f} s)\n",
             human_bytes(double(file_bytes)), read_s, read_gbs, reads[0], reads[1], reads[2]);
  fmt::print("store allocate + zero : {} in {:.3f} s\n", human_bytes(double(st.total_bytes())), alloc_s);
  fmt::print(
      "store load (streaming): {} ({} tensors, {} layers) in {:.3f} s = {:.2f} GB/s (median of {:.3f} {:.3f} "
      "{:.3f} s)\n",
      human_bytes(double(rep.bytes)), rep.tensors, st.layers().size(), load_s, load_gbs, loads[0], loads[1],
      loads[2]);
  fmt::print("ratio load / read     : {:.2f} (target >= 0.5)\n", load_gbs / read_gbs);
  if (peak_ok)
    fmt::print("peak RSS above the store's buffers: {} ({:.1f}% of the largest shard, target < 100%)\n",
               human_bytes(std::max(extra, 0.0)), 100 * std::max(extra, 0.0) / double(largest));
  else
    fmt::print("peak RSS: unavailable (/proc/self/clear_refs not writable)\n");

  if (!a.json.empty()) {
    nlohmann::ordered_json j = {
        {"checkpoint", a.checkpoint},     {"family", desc.family},
        {"shape", desc.shape.describe()}, {"shards", files.size()},
        {"file_bytes", file_bytes},       {"largest_shard_bytes", largest},
        {"loaded_bytes", rep.bytes},      {"plain_read_s", reads},
        {"plain_read_gbs", read_gbs},     {"store_alloc_s", alloc_s},
        {"store_load_s", loads},          {"store_load_gbs", load_gbs},
        {"ratio", load_gbs / read_gbs},   {"peak_extra_rss_bytes", peak_ok ? std::max(extra, 0.0) : -1.0}};
    std::ofstream f(a.json);
    if (!(f << j.dump(2) << "\n"))
      throw std::runtime_error(fmt::format("cannot write {}: {}", a.json, std::strerror(errno)));
    fmt::print("wrote {}\n", a.json);
  }
  return 0;
}

}  // namespace

std::vector<Command> add_checkpoint_commands(CLI::App& app) {
  std::vector<Command> cmds;
  auto mk = std::make_shared<MakeArgs>();
  auto* c_make = app.add_subcommand("make-checkpoint", "Write a synthetic HF-layout block-FP8 checkpoint");
  c_make->add_option("--preset", mk->preset, preset_names(" | ") + " (the model family; its config.json)")
      ->capture_default_str();
  c_make
      ->add_option("--layers", mk->layers,
                   "MoE layers to write (numbered from the family's first MoE layer: inspect lists them)")
      ->check(CLI::Range(1, ModelDesc::kMaxLayers))
      ->capture_default_str();
  c_make->add_option("--out", mk->out, "output directory")->required();
  c_make->add_flag("--pow2-scales", mk->pow2, "round every block scale to a power of two");
  c_make->add_option("--seed", mk->seed)->check(seed_check())->capture_default_str();
  c_make->add_option("--hidden", mk->hidden, "override H (small test checkpoints)")
      ->check(shape_override_range());
  c_make->add_option("--inter", mk->inter, "override I")->check(shape_override_range());
  c_make->add_option("--experts", mk->experts, "override E")->check(shape_override_range());
  c_make->add_option("--topk", mk->topk, "override K")->check(shape_override_range());
  cmds.push_back({c_make, [mk] { return run_make(*mk); }});

  auto in = std::make_shared<InspectArgs>();
  auto* c_inspect = app.add_subcommand("inspect", "Summarize a checkpoint folder or one .safetensors file");
  c_inspect->add_option("path", in->path, "checkpoint directory or .safetensors file")->required();
  c_inspect->add_flag("--json", in->json, "machine-readable output");
  c_inspect
      ->add_option("--ranks", in->ranks,
                   "also the weight memory of one of R expert-parallel ranks (its E/R experts)")
      ->check(CLI::Range(1, 1 << 16));
  c_inspect->add_option("--sample", in->sample, "weight tensors sampled for the MXFP8 error estimate")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  cmds.push_back({c_inspect, [in] { return run_inspect(*in); }});

  auto rc = std::make_shared<ReloadArgs>();
  auto* c_rc = app.add_subcommand(
      "reload-check",
      "Cold load, forward, zero the experts, reload in place; check addresses, bytes and outputs");
  c_rc->add_option("--checkpoint", rc->checkpoint, "HF-layout checkpoint directory")->required();
  c_rc->add_option("--mode", rc->mode, "layerwise | direct")->capture_default_str();
  c_rc->add_option("--backend", rc->backend, "cpu | cuda")->capture_default_str();
  c_rc->add_option("--format", rc->format, "kernel format: hopper | mxfp8 (adds the derived MXFP8 copy)")
      ->capture_default_str();
  c_rc->add_option("--tokens", rc->tokens, "tokens per forward")->capture_default_str();
  c_rc->add_option("--seed", rc->seed, "tokens and shuffle order")
      ->check(seed_check())
      ->capture_default_str();
  cmds.push_back({c_rc, [rc] { return run_reload_check(*rc); }});

  auto lb = std::make_shared<LoadBenchArgs>();
  auto* c_lb =
      app.add_subcommand("load-bench", "Time loading every MoE layer into host memory vs a plain read");
  c_lb->add_option("--checkpoint", lb->checkpoint, "HF-layout checkpoint directory")->required();
  c_lb->add_option("--json", lb->json, "write the figures as JSON here");
  cmds.push_back({c_lb, [lb] { return run_load_bench(*lb); }});
  return cmds;
}

}  // namespace megamoe::tools
