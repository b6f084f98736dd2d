// The model description read from a checkpoint's config.json (docs/numerics.md §1, §2):
// the MoE shape, which layers are MoE, where their tensors live, and the FP8
// quantization. Also the inverse (config_json) so synthetic checkpoints carry
// a config our parser reads back.
//
// Families (model_type): deepseek_v3, glm_moe_dsa (GLM-5), glm4_moe_lite
// (GLM-4.7-Flash), glm5_next (GLM-5.3-Flash). Any family accepts every key
// spelling below; a key present under two spellings must agree.
//   experts      n_routed_experts | num_experts
//   top-k        num_experts_per_tok | num_experts_per_token
//   renormalize  norm_topk_prob | moe_renormalize          (default true)
//   MoE layers   mlp_layer_types ("dense"/"sparse" per layer) if present, else
//                first_k_dense_replace with moe_layer_freq (default 1):
//                layer L is MoE iff L >= first_k_dense_replace and L % freq == 0
// Language-model keys are read from `text_config` when the config has one
// (multimodal GLM-5.3-Flash), else from the top level; quantization_config
// from the top level, else text_config.
//
// Router dtype rule: `moe_router_dtype` when present ("float32" -> f32,
// "bfloat16" -> bf16); otherwise bf16 for deepseek_v3 and f32 for the GLM
// families (their reference code runs the router in fp32). This is the
// config's claim; load_moe_layer uses the dtype gate.weight has in the file.
// correction_bias is true unless `topk_method` names a method without one
// (anything other than "noaux_tc").
#pragma once

#include <array>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "megamoe/model/shape.h"

namespace megamoe {

// config.json is unusable: the message names the file and every problem found
// (all missing keys at once, not just the first).
class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct QuantConfig {
  std::string quant_method = "fp8";
  std::string fmt = "e4m3";
  std::array<int, 2> block = {128, 128};
  std::optional<std::string> scale_fmt;  // "ue8m0": every weight scale is a power of two
  std::string activation_scheme = "dynamic";
  std::vector<std::string> ignored_layers;  // ignored_layers / modules_to_not_convert

  bool pow2_scales() const { return scale_fmt && *scale_fmt == "ue8m0"; }
};

struct ModelDesc {
  // The most decoder layers a config may claim (real models have tens to a few hundred):
  // the MoE layer list is built from num_hidden_layers, so it must not size an allocation.
  static constexpr int kMaxLayers = 1 << 16;

  std::string model_type;  // config.json model_type
  std::string family;      // preset name: glm-5.3-flash, glm-5, deepseek-v3, glm-4.7-flash
  MoeShape shape;
  int num_layers = 0;           // decoder layers
  std::vector<int> moe_layers;  // ascending layer indices
  // Multi-token-prediction layers (num_nextn_predict_layers; DeepSeek-V3 and GLM use them
  // for speculative decoding): [num_layers, num_layers + n), each a full decoder layer
  // whose MoE block has the main layers' shape, under the same prefix (DeepSeek-V3's is
  // model.layers.61). Not in moe_layers: checkpoints may leave them out, so a store or a
  // forward takes one only when asked for it by index.
  std::vector<int> mtp_layers;
  static constexpr int kMaxMtpLayers = 16;
  std::string layer_prefix_format;  // e.g. "model.layers.{}.mlp."; {} is the layer index
  QuantConfig quant;

  // "model.layers.7.mlp." for layer 7.
  std::string layer_prefix(int layer) const;
  // A main MoE layer or an MTP layer: one whose MoE block can be loaded and run.
  bool is_moe_layer(int layer) const;
  // "3-60" or "3-60, MTP 61": the layers is_moe_layer takes, for messages.
  std::string moe_layers_text() const;
  // Throws std::invalid_argument naming the layer, the model and its MoE layers unless
  // is_moe_layer(layer); `what` starts the message (e.g. "--layer", "WeightStore: layer").
  void require_moe_layer(int layer, std::string_view what = "layer") const;
};

// Ascending layer indices as runs: "0,3-60" ("none" when empty).
std::string layer_ranges_text(const std::vector<int>& layers);

// The model_type values we accept, in docs/numerics.md §1 order.
const std::vector<std::string>& known_model_types();

// Parses config.json text. `label` names the source in messages.
ModelDesc parse_config(std::string_view json_text, std::string_view label = "config.json");
// `path` is a config.json file or a directory containing one.
ModelDesc load_config(const std::filesystem::path& path);

// A config.json in the family's own key style that parse_config reads back to
// `d` (moe_layers must be expressible in that style: for first_k_dense_replace
// families, every layer from the first MoE layer on).
std::string config_json(const ModelDesc& d);

// The description of a preset's full model: MoE layers [first_dense, num_layers).
ModelDesc model_desc(const Preset& p);

}  // namespace megamoe
