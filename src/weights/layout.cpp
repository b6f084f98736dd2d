#include "megamoe/weights/layout.h"

#include <fmt/format.h>

#include <stdexcept>

namespace megamoe {

std::string ExpertRange::text() const { return fmt::format("[{}, {})", first, int64_t(first) + count); }

MoeWeightLayout MoeWeightLayout::compute(const MoeShape& s) { return compute(s, ExpertRange{0, s.experts}); }

MoeWeightLayout MoeWeightLayout::compute(const MoeShape& s, ExpertRange range) {
  s.validate();
  if (range.count < 1 || range.first < 0 || range.first > s.experts - range.count)
    throw std::invalid_argument(fmt::format(
        "expert range {} is not a non-empty part of the layer's {} experts", range.text(), s.experts));
  MoeWeightLayout l;
  l.experts = range;
  RegionPlanner plan(256);
  auto place = [&](Region& r, size_t bytes) { plan.place(r, bytes); };
  const size_t H = s.hidden, I = s.inter, E = size_t(range.count), Is = s.shared_inter();
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
  const size_t all = size_t(s.experts);  // the router scores every expert on every rank
  place(l.router, all * H * (s.router_dtype == RouterDtype::kBF16 ? 2 : 4));
  if (s.correction_bias) place(l.bias, all * sizeof(float));
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

std::string MoeWeightLayout::experts_text(const MoeShape& s) const {
  return fmt::format("experts {} of {}", experts.text(), s.experts);
}

std::vector<RegionCopy> region_copies(const MoeWeightLayout& from, const MoeWeightLayout& to) {
  const ExpertRange f = from.experts, t = to.experts;
  if (!f.contains(t))
    throw std::invalid_argument(
        fmt::format("weights of experts {} cannot fill a layout of experts {}", f.text(), t.text()));
  std::vector<RegionCopy> out;
  // A routed region is [count][per-expert bytes]: the destination's experts are one
  // contiguous run of the source's.
  auto routed = [&](Region MoeWeightLayout::*r) {
    const size_t per = (from.*r).bytes / size_t(f.count);
    out.push_back(
        {(from.*r).offset + size_t(t.first - f.first) * per, (to.*r).offset, per * size_t(t.count)});
  };
  auto whole = [&](Region MoeWeightLayout::*r) {
    if ((to.*r).bytes) out.push_back({(from.*r).offset, (to.*r).offset, (to.*r).bytes});
  };
  for (auto r :
       {&MoeWeightLayout::w13, &MoeWeightLayout::w13_scale, &MoeWeightLayout::w2, &MoeWeightLayout::w2_scale})
    routed(r);
  for (auto r :
       {&MoeWeightLayout::shared_w13, &MoeWeightLayout::shared_w13_scale, &MoeWeightLayout::shared_w2,
        &MoeWeightLayout::shared_w2_scale, &MoeWeightLayout::router, &MoeWeightLayout::bias})
    whole(r);
  return out;
}

}  // namespace megamoe
