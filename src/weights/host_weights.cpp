#include "megamoe/weights/host_weights.h"

#include <fmt/format.h>

#include <new>
#include <stdexcept>

namespace megamoe {

HostMoeWeights::HostMoeWeights(const MoeShape& s) : HostMoeWeights(s, ExpertRange{0, s.experts}) {}

HostMoeWeights::HostMoeWeights(const MoeShape& s, ExpertRange experts)
    : shape(s), layout(MoeWeightLayout::compute(s, experts)) {
  void* p = std::aligned_alloc(4096, (layout.total_bytes + 4095) & ~size_t(4095));
  if (!p) throw std::bad_alloc();
  storage_.reset(static_cast<uint8_t*>(p));
}

const HostMoeWeights& whole_layer(const HostMoeWeights& w, const char* what) {
  if (!w.layout.whole(w.shape))
    throw std::invalid_argument(
        fmt::format("{}: the weights hold {} (an expert-parallel rank's part), not the whole layer", what,
                    w.layout.experts_text(w.shape)));
  return w;
}

}  // namespace megamoe
