#include "megamoe/model/shape.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

namespace megamoe {

std::string_view to_string(ScoreFunc f) {
  switch (f) {
    case ScoreFunc::kSigmoid: return "sigmoid";
    case ScoreFunc::kSoftmax: return "softmax";
    case ScoreFunc::kSqrtSoftplus: return "sqrtsoftplus";
  }
  return "?";
}

std::string_view to_string(RouterDtype d) { return d == RouterDtype::kBF16 ? "bf16" : "f32"; }

void MoeShape::validate() const {
  auto bad = [](const std::string& what) { throw std::invalid_argument("invalid MoE shape: " + what); };
  if (hidden <= 0 || hidden > kMaxDim)
    bad(fmt::format("hidden size H = {} must be in [1, {}]", hidden, kMaxDim));
  if (inter <= 0 || inter > kMaxDim)
    bad(fmt::format("intermediate size I = {} must be in [1, {}]", inter, kMaxDim));
  if (experts <= 0 || experts > kMaxExperts)
    bad(fmt::format("experts E = {} must be in [1, {}]", experts, kMaxExperts));
  if (topk <= 0 || topk > experts) bad(fmt::format("top-k K = {} must be in [1, E = {}]", topk, experts));
  if (shared_experts < 0 || shared_experts > kMaxSharedExperts)
    bad(fmt::format("shared experts S = {} must be in [0, {}]", shared_experts, kMaxSharedExperts));
  if (n_group <= 0 || experts % n_group != 0)
    bad(fmt::format("n_group = {} must divide E = {}", n_group, experts));
  if (topk_group <= 0 || topk_group > n_group)
    bad(fmt::format("topk_group = {} must be in [1, n_group = {}]", topk_group, n_group));
  if (n_group > 1 && experts / n_group < 2)
    bad(fmt::format("grouped top-k needs >= 2 experts per group (E = {}, n_group = {})", experts, n_group));
  if (n_group > 1 && topk > topk_group * (experts / n_group))
    bad(fmt::format("K = {} exceeds the experts in topk_group = {} groups", topk, topk_group));
  if (!std::isfinite(routed_scaling) || !(routed_scaling > 0.0f))
    bad(fmt::format("routed_scaling = {} must be finite and > 0", routed_scaling));
  if (!std::isfinite(swiglu_limit) || !(swiglu_limit >= 0.0f))
    bad(fmt::format("swiglu_limit = {} must be finite and >= 0 (0: no clamp)", swiglu_limit));
}

double MoeShape::flops_per_token() const { return expert_flops(inter) * topk + expert_flops(shared_inter()); }

bool MoeShape::same_as(const MoeShape& o) const {
  return hidden == o.hidden && inter == o.inter && experts == o.experts && topk == o.topk &&
         shared_experts == o.shared_experts && n_group == o.n_group && topk_group == o.topk_group &&
         score == o.score && norm_topk_prob == o.norm_topk_prob && routed_scaling == o.routed_scaling &&
         swiglu_limit == o.swiglu_limit && router_dtype == o.router_dtype &&
         correction_bias == o.correction_bias;
}

std::string MoeShape::describe() const {
  return fmt::format(
      "H={} I={} E={} K={} shared={} groups={}/{} score={} norm={} scale={} clamp={} router={}", hidden,
      inter, experts, topk, shared_experts, n_group, topk_group, to_string(score), norm_topk_prob,
      routed_scaling, swiglu_limit, to_string(router_dtype));
}

const std::vector<Preset>& presets() {
  static const std::vector<Preset> kPresets = [] {
    std::vector<Preset> p;
    {
      MoeShape s;
      s.hidden = 4096, s.inter = 2048, s.experts = 288, s.topk = 8, s.shared_experts = 1;
      s.routed_scaling = 2.5f, s.swiglu_limit = 10.0f, s.router_dtype = RouterDtype::kF32;
      p.push_back({"glm-5.3-flash", "glm5_next", s, 45, 3});
    }
    {
      MoeShape s;
      s.hidden = 6144, s.inter = 2048, s.experts = 256, s.topk = 8, s.shared_experts = 1;
      s.routed_scaling = 2.5f, s.router_dtype = RouterDtype::kF32;
      p.push_back({"glm-5", "glm_moe_dsa", s, 78, 3});
    }
    {
      MoeShape s;
      s.hidden = 7168, s.inter = 2048, s.experts = 256, s.topk = 8, s.shared_experts = 1;
      s.n_group = 8, s.topk_group = 4, s.routed_scaling = 2.5f, s.router_dtype = RouterDtype::kBF16;
      p.push_back({"deepseek-v3", "deepseek_v3", s, 61, 3});
    }
    {
      MoeShape s;
      s.hidden = 2048, s.inter = 1536, s.experts = 64, s.topk = 4, s.shared_experts = 1;
      s.routed_scaling = 1.8f, s.router_dtype = RouterDtype::kF32;
      p.push_back({"glm-4.7-flash", "glm4_moe_lite", s, 47, 1});
    }
    return p;
  }();
  return kPresets;
}

std::string preset_names(std::string_view separator) {
  std::string out;
  for (const auto& p : presets()) out += (out.empty() ? "" : std::string(separator)) + p.name;
  return out;
}

const Preset& find_preset(std::string_view name) {
  for (const auto& p : presets())
    if (p.name == name) return p;
  throw std::invalid_argument(fmt::format("unknown preset '{}' (known: {})", name, preset_names(", ")));
}

}  // namespace megamoe
