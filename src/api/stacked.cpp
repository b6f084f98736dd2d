// The stacked weight tensors (moe_layer.h): what a binding or an engine hands a layer as
// ten tensors, described once from the kernel layout.
#include "megamoe/api/moe_layer.h"
#include "megamoe/weights/layout.h"

namespace megamoe::api {

std::vector<StackedTensor> stacked_tensors(const MoeShape& s) {
  using T = StackedTensor::Type;
  const int64_t E = s.experts, H = s.hidden, I = s.inter, Is = s.shared_inter();
  const int64_t hb = MoeWeightLayout::hidden_blocks(s.hidden), ib = MoeWeightLayout::inter_blocks(s.inter);
  const int64_t isb = MoeWeightLayout::inter_blocks(s.shared_inter());
  const char* no_shared = s.has_shared() ? nullptr : "the config has shared_experts=0";
  using L = MoeWeightLayout;
  return {
      {"w13", T::kE4M3, {E, 2 * I, H}, nullptr, &L::w13},
      {"w13_scale", T::kF32, {E, 2 * ib, hb}, nullptr, &L::w13_scale},
      {"w2", T::kE4M3, {E, H, I}, nullptr, &L::w2},
      {"w2_scale", T::kF32, {E, hb, ib}, nullptr, &L::w2_scale},
      {"shared_w13", T::kE4M3, {2 * Is, H}, no_shared, &L::shared_w13},
      {"shared_w13_scale", T::kF32, {2 * isb, hb}, no_shared, &L::shared_w13_scale},
      {"shared_w2", T::kE4M3, {H, Is}, no_shared, &L::shared_w2},
      {"shared_w2_scale", T::kF32, {hb, isb}, no_shared, &L::shared_w2_scale},
      {"router", T::kRouter, {E, H}, nullptr, &L::router},
      {"bias", T::kF32, {E}, s.correction_bias ? nullptr : "the config has correction_bias=False", &L::bias},
  };
}

MoeWeightsView stacked_view(const std::array<const void*, kStackedTensors>& p) {
  MoeWeightsView v;
  v.w13 = static_cast<const uint8_t*>(p[0]);
  v.w13_scale = static_cast<const float*>(p[1]);
  v.w2 = static_cast<const uint8_t*>(p[2]);
  v.w2_scale = static_cast<const float*>(p[3]);
  v.shared_w13 = static_cast<const uint8_t*>(p[4]);
  v.shared_w13_scale = static_cast<const float*>(p[5]);
  v.shared_w2 = static_cast<const uint8_t*>(p[6]);
  v.shared_w2_scale = static_cast<const float*>(p[7]);
  v.router = p[8];
  v.bias = static_cast<const float*>(p[9]);
  return v;
}

}  // namespace megamoe::api
