// config.json <-> ModelDesc (see config.h for the key rules).
#include "megamoe/model/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace megamoe {

namespace {

using json = nlohmann::json;

// Real configs nest a few levels (text_config, quantization_config, rope_scaling); the
// limit keeps a hostile one from driving the recursive parts of nlohmann::json (dump,
// comparison) off the stack.
constexpr int kMaxConfigDepth = 32;

// A JSON integer that fits an int (a larger one would be narrowed by get<int>).
bool is_int32(const json& v) {
  return v.is_number_integer() && v.get<int64_t>() >= INT32_MIN && v.get<int64_t>() <= INT32_MAX;
}

// A value for a message: its JSON, cut after kMaxShown characters (a key may hold a
// megabyte of array).
std::string brief(const json& v) {
  constexpr size_t kMaxShown = 80;
  std::string s = v.dump();
  if (s.size() > kMaxShown) s = s.substr(0, kMaxShown) + fmt::format("... ({} characters)", s.size());
  return s;
}

struct Family {
  std::string_view model_type;
  std::string_view preset;  // family name == preset name
  std::string_view prefix_format;
  RouterDtype default_router;
  bool text_config;      // config_json nests LM keys under text_config
  bool mlp_layer_types;  // config_json names MoE layers with mlp_layer_types
};

constexpr Family kFamilies[] = {
    {"glm5_next", "glm-5.3-flash", "model.language_model.layers.{}.mlp.", RouterDtype::kF32, true, true},
    {"glm_moe_dsa", "glm-5", "model.layers.{}.mlp.", RouterDtype::kF32, false, false},
    {"deepseek_v3", "deepseek-v3", "model.layers.{}.mlp.", RouterDtype::kBF16, false, false},
    {"glm4_moe_lite", "glm-4.7-flash", "model.layers.{}.mlp.", RouterDtype::kF32, false, false},
};

const Family* find_family(std::string_view model_type) {
  for (const auto& f : kFamilies)
    if (f.model_type == model_type) return &f;
  return nullptr;
}

// Reads keys from one JSON object, collecting every problem instead of
// stopping at the first, so one error message can list them all.
class Reader {
 public:
  Reader(const json& obj, std::vector<std::string>& problems) : obj_(obj), problems_(problems) {}

  // The value under the first spelling present; several present must agree.
  const json* find(std::initializer_list<std::string_view> names) {
    const json* found = nullptr;
    std::string_view found_name;
    for (auto n : names) {
      auto it = obj_.find(std::string(n));
      if (it == obj_.end() || it->is_null()) continue;
      if (found && *found != *it)
        problems_.push_back(
            fmt::format("'{}' = {} disagrees with '{}' = {}", n, brief(*it), found_name, brief(*found)));
      if (!found) found = &*it, found_name = n;
    }
    return found;
  }

  std::optional<int> integer(std::initializer_list<std::string_view> names, bool required,
                             std::optional<int> def = std::nullopt) {
    const json* v = find(names);
    if (!v) return missing(names, required) ? std::nullopt : def;
    if (!is_int32(*v)) {
      wrong(names, "an integer", *v);
      return def;
    }
    return v->get<int>();
  }

  // A number that fits a float (the shape's fields are floats; a larger double would not
  // convert).
  float real32(std::initializer_list<std::string_view> names, float def) {
    const json* v = find(names);
    if (!v) return def;
    if (!v->is_number() || !(std::fabs(v->get<double>()) <= double(FLT_MAX))) {
      wrong(names, "a finite number in float range", *v);
      return def;
    }
    return float(v->get<double>());
  }

  bool boolean(std::initializer_list<std::string_view> names, bool def) {
    const json* v = find(names);
    if (!v) return def;
    if (!v->is_boolean()) {
      wrong(names, "true or false", *v);
      return def;
    }
    return v->get<bool>();
  }

  std::optional<std::string> string(std::initializer_list<std::string_view> names) {
    const json* v = find(names);
    if (!v) return std::nullopt;
    if (!v->is_string()) {
      wrong(names, "a string", *v);
      return std::nullopt;
    }
    return v->get<std::string>();
  }

  // Returns true when the key was required (and so recorded as missing).
  bool missing(std::initializer_list<std::string_view> names, bool required) {
    if (required) missing_.push_back(spell(names));
    return required;
  }

  void wrong(std::initializer_list<std::string_view> names, std::string_view expected, const json& v) {
    problems_.push_back(fmt::format("'{}' must be {}, found {}", spell(names), expected, brief(v)));
  }

  static std::string spell(std::initializer_list<std::string_view> names) {
    return fmt::format("{}", fmt::join(names, "|"));
  }

  const std::vector<std::string>& missing_keys() const { return missing_; }

 private:
  const json& obj_;
  std::vector<std::string>& problems_;
  std::vector<std::string> missing_;
};

void parse_quant(const json& q, QuantConfig& out, std::vector<std::string>& problems) {
  Reader r(q, problems);
  if (auto m = r.string({"quant_method"}))
    out.quant_method = *m;
  else
    r.missing({"quantization_config.quant_method"}, true);
  if (auto f = r.string({"fmt"})) out.fmt = *f;  // GLM configs omit it; e4m3 is implied
  if (auto a = r.string({"activation_scheme"})) out.activation_scheme = *a;
  out.scale_fmt = r.string({"scale_fmt"});
  if (const json* b = r.find({"weight_block_size"})) {
    if (!b->is_array() || b->size() != 2 || !is_int32((*b)[0]) || !is_int32((*b)[1]))
      r.wrong({"quantization_config.weight_block_size"}, "[rows, cols]", *b);
    else
      out.block = {(*b)[0].get<int>(), (*b)[1].get<int>()};
  } else {
    r.missing({"quantization_config.weight_block_size"}, true);
  }
  if (const json* ig = r.find({"ignored_layers", "modules_to_not_convert"}); ig && ig->is_array())
    for (const auto& s : *ig)
      if (s.is_string()) out.ignored_layers.push_back(s.get<std::string>());
  for (const auto& m : r.missing_keys()) problems.push_back(fmt::format("missing key '{}'", m));

  // Only block FP8 E4M3 with 128x128 scales is what our kernels consume.
  if (out.quant_method != "fp8")
    problems.push_back(
        fmt::format("quantization_config.quant_method is '{}', expected 'fp8'", out.quant_method));
  if (out.fmt != "e4m3")
    problems.push_back(fmt::format("quantization_config.fmt is '{}', expected 'e4m3'", out.fmt));
  if (out.block != std::array<int, 2>{128, 128})
    problems.push_back(fmt::format("quantization_config.weight_block_size is [{}, {}], expected [128, 128]",
                                   out.block[0], out.block[1]));
  if (out.activation_scheme != "dynamic")
    problems.push_back(fmt::format("quantization_config.activation_scheme is '{}', expected 'dynamic'",
                                   out.activation_scheme));
  if (out.scale_fmt && *out.scale_fmt != "ue8m0")
    problems.push_back(
        fmt::format("quantization_config.scale_fmt is '{}', expected 'ue8m0' or absent", *out.scale_fmt));
}

[[noreturn]] void fail(std::string_view label, const std::vector<std::string>& problems) {
  std::string msg = fmt::format("{}: {} problem{}", label, problems.size(), problems.size() == 1 ? "" : "s");
  for (const auto& p : problems) msg += "\n  " + p;
  throw ConfigError(msg);
}

std::string known_types_text() { return fmt::format("{}", fmt::join(known_model_types(), ", ")); }

}  // namespace

const std::vector<std::string>& known_model_types() {
  static const std::vector<std::string> kTypes = [] {
    std::vector<std::string> v;
    for (const auto& f : kFamilies) v.emplace_back(f.model_type);
    return v;
  }();
  return kTypes;
}

std::string ModelDesc::layer_prefix(int layer) const {
  return fmt::format(fmt::runtime(layer_prefix_format), layer);
}

bool ModelDesc::is_moe_layer(int layer) const {
  return std::binary_search(moe_layers.begin(), moe_layers.end(), layer) ||
         std::binary_search(mtp_layers.begin(), mtp_layers.end(), layer);
}

std::string layer_ranges_text(const std::vector<int>& layers) {
  std::string t;
  auto out = std::back_inserter(t);
  for (size_t i = 0; i < layers.size();) {
    size_t j = i;
    while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) ++j;
    fmt::format_to(out, "{}{}", i ? "," : "", layers[i]);
    if (j > i) fmt::format_to(out, "-{}", layers[j]);
    i = j + 1;
  }
  return t.empty() ? "none" : t;
}

std::string ModelDesc::moe_layers_text() const {
  if (mtp_layers.empty()) return layer_ranges_text(moe_layers);
  return fmt::format("{}, MTP {}", layer_ranges_text(moe_layers), layer_ranges_text(mtp_layers));
}

void ModelDesc::require_moe_layer(int layer, std::string_view what) const {
  if (!is_moe_layer(layer))
    throw std::invalid_argument(fmt::format("{} {} is not an MoE layer of this {} model (MoE layers: {})",
                                            what, layer, family, moe_layers_text()));
}

ModelDesc parse_config(std::string_view text, std::string_view label) {
  json root;
  try {
    root = json::parse(text, [&](int depth, json::parse_event_t ev, json&) {
      if ((ev == json::parse_event_t::object_start || ev == json::parse_event_t::array_start) &&
          depth + 1 > kMaxConfigDepth)  // (depth: the enclosing containers')
        throw ConfigError(fmt::format("{}: nests deeper than {} levels", label, kMaxConfigDepth));
      return true;
    });
  } catch (const json::exception& e) {
    throw ConfigError(fmt::format("{}: not valid JSON: {}", label, e.what()));
  }
  if (!root.is_object()) throw ConfigError(fmt::format("{}: expected a JSON object", label));

  std::vector<std::string> problems;
  ModelDesc d;
  const Family* fam = nullptr;
  if (auto it = root.find("model_type"); it == root.end() || !it->is_string()) {
    problems.push_back(fmt::format("missing key 'model_type' (known: {})", known_types_text()));
  } else {
    d.model_type = it->get<std::string>();
    fam = find_family(d.model_type);
    if (!fam)
      problems.push_back(
          fmt::format("unknown model_type '{}' (known: {})", d.model_type, known_types_text()));
  }

  const json* lm = &root;
  if (auto it = root.find("text_config"); it != root.end()) {
    if (it->is_object())
      lm = &*it;
    else
      problems.push_back(fmt::format("'text_config' must be an object, found {}", brief(*it)));
  }
  Reader r(*lm, problems);
  MoeShape& s = d.shape;
  s.hidden = r.integer({"hidden_size"}, true).value_or(0);
  if (const auto n = r.integer({"num_hidden_layers"}, true)) {
    if (*n >= 1 && *n <= ModelDesc::kMaxLayers)
      d.num_layers = *n;
    else  // (num_layers stays 0: nothing below is sized by it)
      problems.push_back(
          fmt::format("'num_hidden_layers' = {} must be in [1, {}]", *n, ModelDesc::kMaxLayers));
  }
  s.inter = r.integer({"moe_intermediate_size"}, true).value_or(0);
  s.experts = r.integer({"n_routed_experts", "num_experts"}, true).value_or(0);
  s.topk = r.integer({"num_experts_per_tok", "num_experts_per_token"}, true).value_or(0);
  s.shared_experts = r.integer({"n_shared_experts"}, true).value_or(0);
  s.n_group = r.integer({"n_group"}, false, 1).value_or(1);
  s.topk_group = r.integer({"topk_group"}, false, 1).value_or(1);
  s.norm_topk_prob = r.boolean({"norm_topk_prob", "moe_renormalize"}, true);
  s.routed_scaling = r.real32({"routed_scaling_factor"}, 1.0f);
  s.swiglu_limit = r.real32({"swiglu_limit"}, 0.0f);

  if (auto sf = r.string({"scoring_func"})) {
    if (*sf == "sigmoid")
      s.score = ScoreFunc::kSigmoid;
    else if (*sf == "softmax")
      s.score = ScoreFunc::kSoftmax;
    else if (*sf == "sqrtsoftplus")
      s.score = ScoreFunc::kSqrtSoftplus;
    else
      problems.push_back(
          fmt::format("'scoring_func' is '{}', expected sigmoid, softmax or sqrtsoftplus", *sf));
  }
  if (auto tm = r.string({"topk_method"})) s.correction_bias = *tm == "noaux_tc";

  s.router_dtype = fam ? fam->default_router : RouterDtype::kBF16;
  if (auto rd = r.string({"moe_router_dtype"})) {
    if (*rd == "float32" || *rd == "fp32")
      s.router_dtype = RouterDtype::kF32;
    else if (*rd == "bfloat16" || *rd == "bf16")
      s.router_dtype = RouterDtype::kBF16;
    else
      problems.push_back(fmt::format("'moe_router_dtype' is '{}', expected float32 or bfloat16", *rd));
  }

  // Which layers are MoE.
  if (const json* types = r.find({"mlp_layer_types"})) {
    if (!types->is_array()) {
      r.wrong({"mlp_layer_types"}, "a list of \"dense\"/\"sparse\"", *types);
    } else {
      if (d.num_layers > 0 && int(types->size()) != d.num_layers)
        problems.push_back(fmt::format("'mlp_layer_types' has {} entries, num_hidden_layers is {}",
                                       types->size(), d.num_layers));
      for (size_t i = 0; i < types->size(); ++i) {
        const json& t = (*types)[i];
        if (t == "sparse")
          d.moe_layers.push_back(int(i));
        else if (t != "dense")
          problems.push_back(
              fmt::format("mlp_layer_types[{}] is {}, expected \"dense\" or \"sparse\"", i, brief(t)));
      }
    }
  } else {
    const auto first = r.integer({"first_k_dense_replace"}, false);
    if (!first) {
      r.missing({"first_k_dense_replace", "mlp_layer_types"}, true);
    } else {
      const int freq = r.integer({"moe_layer_freq"}, false, 1).value_or(1);
      if (freq <= 0) problems.push_back(fmt::format("'moe_layer_freq' = {} must be > 0", freq));
      for (int l = std::max(*first, 0); freq > 0 && l < d.num_layers; ++l)
        if (l % freq == 0) d.moe_layers.push_back(l);
    }
  }
  // MTP layers follow the main ones (their MoE block has the same shape).
  if (const auto n = r.integer({"num_nextn_predict_layers"}, false, 0); n && *n != 0) {
    if (*n < 0 || *n > ModelDesc::kMaxMtpLayers)
      problems.push_back(
          fmt::format("'num_nextn_predict_layers' = {} must be in [0, {}]", *n, ModelDesc::kMaxMtpLayers));
    else
      for (int i = 0; i < *n && d.num_layers > 0; ++i) d.mtp_layers.push_back(d.num_layers + i);
  }
  for (const auto& m : r.missing_keys()) problems.push_back(fmt::format("missing key '{}'", m));

  const json* q = nullptr;
  if (auto it = root.find("quantization_config"); it != root.end())
    q = &*it;
  else if (auto it2 = lm->find("quantization_config"); it2 != lm->end())
    q = &*it2;
  if (!q) {
    problems.push_back("missing key 'quantization_config' (only block-FP8 checkpoints are supported)");
  } else if (!q->is_object()) {
    problems.push_back(fmt::format("'quantization_config' must be an object, found {}", brief(*q)));
  } else {
    parse_quant(*q, d.quant, problems);
  }

  if (!problems.empty()) fail(label, problems);

  d.family = fam->preset;
  d.layer_prefix_format = fam->prefix_format;
  try {
    s.validate();
  } catch (const std::invalid_argument& e) {
    throw ConfigError(fmt::format("{}: {}", label, e.what()));
  }
  if (d.moe_layers.empty()) throw ConfigError(fmt::format("{}: the config has no MoE layers", label));
  return d;
}

ModelDesc load_config(const std::filesystem::path& path) {
  const auto file = std::filesystem::is_directory(path) ? path / "config.json" : path;
  std::ifstream in(file, std::ios::binary);
  if (!in) throw ConfigError(fmt::format("{}: cannot open", file.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_config(ss.str(), file.string());
}

std::string config_json(const ModelDesc& d) {
  const Family* fam = find_family(d.model_type);
  if (!fam)
    throw ConfigError(
        fmt::format("config_json: unknown model_type '{}' (known: {})", d.model_type, known_types_text()));
  const MoeShape& s = d.shape;
  // ordered_json: keep the human order of a real config.
  // A float as the shortest decimal that reads back as it (1.8f as 1.8, not 1.7999999523162842).
  auto real = [](float f) { return std::strtod(fmt::format("{}", f).c_str(), nullptr); };
  nlohmann::ordered_json lm;
  lm["hidden_size"] = s.hidden;
  lm["num_hidden_layers"] = d.num_layers;
  lm["moe_intermediate_size"] = s.inter;
  lm["n_routed_experts"] = s.experts;
  lm["num_experts_per_tok"] = s.topk;
  lm["n_shared_experts"] = s.shared_experts;
  lm["n_group"] = s.n_group;
  lm["topk_group"] = s.topk_group;
  lm["norm_topk_prob"] = s.norm_topk_prob;
  lm["routed_scaling_factor"] = real(s.routed_scaling);
  lm["scoring_func"] = std::string(to_string(s.score));
  lm["topk_method"] = s.correction_bias ? "noaux_tc" : "greedy";
  if (s.swiglu_limit != 0.0f) lm["swiglu_limit"] = real(s.swiglu_limit);
  if (s.router_dtype != fam->default_router || fam->mlp_layer_types)
    lm["moe_router_dtype"] = s.router_dtype == RouterDtype::kF32 ? "float32" : "bfloat16";
  if (!d.mtp_layers.empty()) {
    for (size_t i = 0; i < d.mtp_layers.size(); ++i)
      if (d.mtp_layers[i] != d.num_layers + int(i))
        throw ConfigError(
            fmt::format("config_json: MTP layers {} are not {}, {}, ... after the {} main layers",
                        fmt::join(d.mtp_layers, ","), d.num_layers, d.num_layers + 1, d.num_layers));
    lm["num_nextn_predict_layers"] = d.mtp_layers.size();
  }

  if (fam->mlp_layer_types) {
    std::vector<std::string> types(size_t(std::max(d.num_layers, 0)), "dense");
    for (int l : d.moe_layers) {
      if (l < 0 || l >= d.num_layers)
        throw ConfigError(fmt::format("config_json: MoE layer {} outside [0, {})", l, d.num_layers));
      types[size_t(l)] = "sparse";
    }
    lm["mlp_layer_types"] = types;
  } else {
    // first_k_dense_replace with freq 1 expresses exactly "every layer from k on".
    const int first = d.moe_layers.empty() ? d.num_layers : d.moe_layers.front();
    if (int(d.moe_layers.size()) != d.num_layers - first ||
        (!d.moe_layers.empty() && d.moe_layers.back() != d.num_layers - 1))
      throw ConfigError(
          fmt::format("config_json: {} names MoE layers by first_k_dense_replace; layers {} "
                      "are not every layer from {} to {}",
                      d.model_type, fmt::join(d.moe_layers, ","), first, d.num_layers - 1));
    lm["first_k_dense_replace"] = first;
    lm["moe_layer_freq"] = 1;
  }

  nlohmann::ordered_json q;
  q["quant_method"] = d.quant.quant_method;
  q["fmt"] = d.quant.fmt;
  q["activation_scheme"] = d.quant.activation_scheme;
  q["weight_block_size"] = d.quant.block;
  if (d.quant.scale_fmt) q["scale_fmt"] = *d.quant.scale_fmt;

  nlohmann::ordered_json root;
  root["model_type"] = d.model_type;
  root["torch_dtype"] = "bfloat16";
  if (fam->text_config) {
    lm["model_type"] = d.model_type + "_text";
    root["text_config"] = lm;
  } else {
    for (auto& [k, v] : lm.items()) root[k] = v;
  }
  root["quantization_config"] = q;
  return root.dump(2) + "\n";
}

ModelDesc model_desc(const Preset& p) {
  const Family* fam = find_family(p.model_type);
  if (!fam) throw ConfigError(fmt::format("preset '{}': unknown model_type '{}'", p.name, p.model_type));
  ModelDesc d;
  d.model_type = p.model_type;
  d.family = p.name;
  d.shape = p.shape;
  d.num_layers = p.num_layers;
  for (int l = p.first_dense; l < p.num_layers; ++l) d.moe_layers.push_back(l);
  d.layer_prefix_format = fam->prefix_format;
  return d;
}

}  // namespace megamoe
