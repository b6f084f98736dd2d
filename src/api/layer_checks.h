// The checks both layer objects (CudaMoeLayer, CpuMoeLayer) make, each rule and its
// message once: the token count against max_tokens, the id width of external routing, and
// which regions a weights view must hold. Host-only (the .cu files include it too).
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

#include "megamoe/model/shape.h"
#include "megamoe/weights/layout.h"

namespace megamoe::api::detail {

// `op` names the call ("forward", "route"); T is x's rows (or a capture's hint).
inline void require_token_count(const char* op, int tokens, int max_tokens) {
  if (tokens < 0)
    throw std::invalid_argument(fmt::format("{} x: a token count of {} (expected >= 0)", op, tokens));
  if (tokens > max_tokens)
    throw std::invalid_argument(
        fmt::format("{} x: {} tokens, more than the layer's max_tokens = {} (build the layer with a larger "
                    "max_tokens)",
                    op, tokens, max_tokens));
}

inline void require_max_tokens(int max_tokens) {
  if (max_tokens <= 0) throw std::invalid_argument(fmt::format("max_tokens = {} must be > 0", max_tokens));
}

inline void require_id_bytes(int id_bytes) {
  if (id_bytes != 4 && id_bytes != 8)
    throw std::invalid_argument(
        fmt::format("forward routing.id_bytes: expected 4 (int32) or 8 (int64), got {}", id_bytes));
}

// Every region of the shape's layout present in `v`, every absent one null; `each` is then
// called as each(pointer, name, alignment) for the present ones (the weights and the router
// 16 bytes: TMA and the router's 16-byte copies; the scales and the bias, read as floats, 4).
// `who` prefixes the messages ("CudaMoeLayer weights view").
template <class Each>
void check_weights_view(const char* who, const MoeShape& s, const MoeWeightsView& v, Each&& each) {
  const MoeWeightLayout l = MoeWeightLayout::compute(s);
  auto region = [&](const void* p, const Region& r, const char* name, size_t align) {
    if (r.bytes == 0) {
      if (p)
        throw std::invalid_argument(
            fmt::format("{}: {}: the shape has no such region ({}), but pointer {} is given (expected null)",
                        who, name, s.describe(), p));
      return;
    }
    if (!p)
      throw std::invalid_argument(
          fmt::format("{}: {}: null pointer ({} bytes expected)", who, name, r.bytes));
    each(p, fmt::format("{}: {}", who, name), align);
  };
  region(v.w13, l.w13, "w13", 16);
  region(v.w13_scale, l.w13_scale, "w13_scale", 4);
  region(v.w2, l.w2, "w2", 16);
  region(v.w2_scale, l.w2_scale, "w2_scale", 4);
  region(v.shared_w13, l.shared_w13, "shared_w13", 16);
  region(v.shared_w13_scale, l.shared_w13_scale, "shared_w13_scale", 4);
  region(v.shared_w2, l.shared_w2, "shared_w2", 16);
  region(v.shared_w2_scale, l.shared_w2_scale, "shared_w2_scale", 4);
  region(v.router, l.router, "router", 16);
  region(v.bias, l.bias, "bias", 4);
}

}  // namespace megamoe::api::detail
