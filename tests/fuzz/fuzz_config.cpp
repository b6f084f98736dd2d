// libFuzzer target for parse_config: config.json is the second untrusted input a
// checkpoint brings (after the safetensors headers), and every size the loader
// allocates and every offset it writes through derives from it. Built by
// scripts/fuzz.sh with clang (-fsanitize=fuzzer,address,undefined).
//
// Contract checked: any input either throws ConfigError, or parses into a description
// whose shape validates, whose MoE layers are ascending and inside [0, num_layers) (its
// MTP layers the next ones, at most ModelDesc::kMaxMtpLayers), and
// whose sizes stay inside the bounds MoeShape::validate states (so the layout's size_t
// products cannot wrap). Any other exception, an allocation past the fuzzer's limit
// (e.g. a layer list sized by a hostile num_hidden_layers), an out-of-bounds read or
// undefined behaviour (integer overflow included) is a crash.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "megamoe/model/config.h"
#include "megamoe/weights/layout.h"

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "parse_config accepted a bad config: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace megamoe;
  ModelDesc d;
  try {
    d = parse_config(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz-config.json");
  } catch (const ConfigError&) {
    return 0;  // the expected outcome for hostile input
  }
  const MoeShape& s = d.shape;
  try {
    s.validate();
  } catch (const std::invalid_argument&) {
    fail("shape does not validate");
  }
  if (s.hidden > MoeShape::kMaxDim || s.inter > MoeShape::kMaxDim || s.experts > MoeShape::kMaxExperts ||
      s.shared_experts > MoeShape::kMaxSharedExperts)
    fail("a size above MoeShape's bounds");
  if (!std::isfinite(s.routed_scaling) || !(s.routed_scaling > 0.0f))
    fail("routed_scaling not finite and > 0");
  if (!std::isfinite(s.swiglu_limit)) fail("swiglu_limit not finite");
  if (d.num_layers <= 0 || d.num_layers > ModelDesc::kMaxLayers) fail("num_layers out of range");
  if (d.moe_layers.empty()) fail("no MoE layers");
  for (size_t i = 0; i < d.moe_layers.size(); ++i) {
    if (d.moe_layers[i] < 0 || d.moe_layers[i] >= d.num_layers) fail("MoE layer outside [0, num_layers)");
    if (i > 0 && d.moe_layers[i] <= d.moe_layers[i - 1]) fail("MoE layers not ascending");
  }
  // MTP layers: at most kMaxMtpLayers, consecutive from num_layers on.
  if (d.mtp_layers.size() > size_t(ModelDesc::kMaxMtpLayers)) fail("too many MTP layers");
  for (size_t i = 0; i < d.mtp_layers.size(); ++i)
    if (d.mtp_layers[i] != d.num_layers + int(i)) fail("MTP layers not right after the main ones");
  if (d.family.empty() || d.layer_prefix(d.moe_layers.back()).empty()) fail("no family or layer prefix");
  // The layout of one layer: its size_t products must not wrap (UBSan does not see
  // unsigned wrap-around, so compare with the same sum in long double).
  const MoeWeightLayout l = MoeWeightLayout::compute(s);
  const long double H = s.hidden, I = s.inter, E = s.experts, Is = double(s.shared_experts) * s.inter;
  const long double fp8 = E * 3 * H * I + 3 * H * Is;
  if (static_cast<long double>(l.total_bytes) < fp8) fail("layout size wrapped");
  return 0;
}
