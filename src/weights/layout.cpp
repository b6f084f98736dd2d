#include "megamoe/weights/layout.h"

namespace megamoe {

MoeWeightLayout MoeWeightLayout::compute(const MoeShape& s) {
  s.validate();
  MoeWeightLayout l;
  RegionPlanner plan(256);
  auto place = [&](Region& r, size_t bytes) { plan.place(r, bytes); };
  const size_t H = s.hidden, I = s.inter, E = s.experts, Is = s.shared_inter();
  const size_t hb = hidden_blocks(s.hidden);
  place(l.w13, E * 2 * I * H);
  place(l.w13_scale, E * w13_scale_rows(s.inter) * hb * sizeof(float));
  place(l.w2, E * H * I);
  place(l.w2_scale, E * hb * inter_blocks(s.inter) * sizeof(float));
  if (s.has_shared()) {
    place(l.shared_w13, 2 * Is * H);
    place(l.shared_w13_scale, size_t(w13_scale_rows(int(Is))) * hb * sizeof(float));
    place(l.shared_w2, H * Is);
    place(l.shared_w2_scale, hb * inter_blocks(int(Is)) * sizeof(float));
  }
  place(l.router, E * H * (s.router_dtype == RouterDtype::kBF16 ? 2 : 4));
  if (s.correction_bias) place(l.bias, E * sizeof(float));
  l.total_bytes = plan.total();
  return l;
}

MoeWeightsView MoeWeightsView::at(const void* base, const MoeWeightLayout& l, const MoeShape& s) {
  auto p = [&](const Region& r) -> const uint8_t* {
    return r.bytes ? static_cast<const uint8_t*>(base) + r.offset : nullptr;
  };
  MoeWeightsView v;
  v.w13 = p(l.w13);
  v.w13_scale = reinterpret_cast<const float*>(p(l.w13_scale));
  v.w2 = p(l.w2);
  v.w2_scale = reinterpret_cast<const float*>(p(l.w2_scale));
  v.shared_w13 = p(l.shared_w13);
  v.shared_w13_scale = reinterpret_cast<const float*>(p(l.shared_w13_scale));
  v.shared_w2 = p(l.shared_w2);
  v.shared_w2_scale = reinterpret_cast<const float*>(p(l.shared_w2_scale));
  v.router = p(l.router);
  v.bias = reinterpret_cast<const float*>(p(l.bias));
  return v;
}

MoeWeightsView MoeWeightsView::from_expert(const MoeShape& s, int e) const {
  const size_t H = s.hidden, I = s.inter, hb = MoeWeightLayout::hidden_blocks(s.hidden);
  MoeWeightsView v = *this;
  v.w13 += size_t(e) * 2 * I * H;
  v.w13_scale += size_t(e) * MoeWeightLayout::w13_scale_rows(s.inter) * hb;
  v.w2 += size_t(e) * H * I;
  v.w2_scale += size_t(e) * hb * MoeWeightLayout::inter_blocks(s.inter);
  return v;
}

}  // namespace megamoe
