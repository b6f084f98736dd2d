#include "megamoe/weights/host_weights.h"

#include <new>

namespace megamoe {

HostMoeWeights::HostMoeWeights(const MoeShape& s) : shape(s), layout(MoeWeightLayout::compute(s)) {
  void* p = std::aligned_alloc(4096, (layout.total_bytes + 4095) & ~size_t(4095));
  if (!p) throw std::bad_alloc();
  storage_.reset(static_cast<uint8_t*>(p));
}

}  // namespace megamoe
