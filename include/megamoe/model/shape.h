// The shape and routing semantics of one MoE layer (docs/numerics.md §1, §6, §7), and the
// presets of the model families we support. Knows nothing of files or devices.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace megamoe {

enum class ScoreFunc { kSigmoid, kSoftmax, kSqrtSoftplus };
enum class RouterDtype { kBF16, kF32 };

std::string_view to_string(ScoreFunc f);
std::string_view to_string(RouterDtype d);

struct MoeShape {
  int hidden = 0;          // H
  int inter = 0;           // I, per routed expert
  int experts = 0;         // E, routed experts
  int topk = 0;            // K
  int shared_experts = 0;  // S; the shared MLP has intermediate S*I
  int n_group = 1;         // grouped top-k (docs/numerics.md §6.3); 1 = plain top-k
  int topk_group = 1;
  ScoreFunc score = ScoreFunc::kSigmoid;
  bool norm_topk_prob = true;
  float routed_scaling = 1.0f;
  float swiglu_limit = 0.0f;  // 0 = no clamp
  RouterDtype router_dtype = RouterDtype::kBF16;
  bool correction_bias = true;  // gate.e_score_correction_bias present

  // Bounds validate() enforces, whatever a config.json claims: far above every real model
  // (H and I in the thousands, E in the hundreds, S one or two), and low enough that no
  // count derived from them overflows (a layer's bytes E x 3 x H x I in size_t, S x I in int).
  static constexpr int kMaxDim = 1 << 20;  // H, I
  static constexpr int kMaxExperts = 1 << 14;
  static constexpr int kMaxSharedExperts = 64;

  int shared_inter() const { return shared_experts * inter; }
  bool has_shared() const { return shared_experts > 0; }
  // Output slots per token: K routed + 1 shared (when present).
  int slots() const { return topk + (has_shared() ? 1 : 0); }
  // Throws std::invalid_argument naming the first bad field (sizes out of their bounds
  // above included; routed_scaling must be finite and > 0, swiglu_limit finite and >= 0).
  void validate() const;
  // Multiply-adds x2 for one token through K routed experts and the shared one.
  double flops_per_token() const;
  // ... and for one token row through one expert of intermediate `inter_size`.
  double expert_flops(int inter_size) const { return 2.0 * 3.0 * double(hidden) * double(inter_size); }
  std::string describe() const;
  // Every field equal (two layers of one layout and one routing).
  bool same_as(const MoeShape& o) const;
};

struct Preset {
  std::string name;        // glm-5.3-flash, glm-5, deepseek-v3, glm-4.7-flash
  std::string model_type;  // config.json model_type
  MoeShape shape;
  int num_layers = 0;   // decoder layers
  int first_dense = 0;  // leading dense layers
};

const std::vector<Preset>& presets();
// Throws std::invalid_argument listing the known names.
// The presets' names joined by `separator` ("glm-5.3-flash | glm-5 | ..." for a --preset help).
std::string preset_names(std::string_view separator);
const Preset& find_preset(std::string_view name);

}  // namespace megamoe
