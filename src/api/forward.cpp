// api::forward: backend choice and the CPU backend (the kernel-faithful reference).
#include "megamoe/api/forward.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "cuda_backend.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/reference/moe.h"

namespace megamoe::api {

Backend parse_backend(const std::string& name) {
  if (name == "auto") return Backend::kAuto;
  if (name == "cpu") return Backend::kCpu;
  if (name == "cuda") return Backend::kCuda;
  throw std::invalid_argument(fmt::format("unknown backend '{}' (auto, cpu, cuda)", name));
}

std::string to_string(Backend b) {
  switch (b) {
    case Backend::kAuto: return "auto";
    case Backend::kCpu: return "cpu";
    case Backend::kCuda: return "cuda";
  }
  return "?";
}

bool cuda_available(std::string* why) {
#if defined(MEGAMOE_HAVE_CUDA)
  return detail::cuda_device_ok(why);
#else
  if (why) *why = "this build has no CUDA backend (nvcc was not found at configure time)";
  return false;
#endif
}

Backend resolve(Backend b) {
  if (b == Backend::kCpu) return b;
  std::string why;
  if (cuda_available(&why)) return Backend::kCuda;
  if (b == Backend::kCuda) throw std::runtime_error("CUDA backend requested but unavailable: " + why);
  return Backend::kCpu;
}

ForwardOutput forward(Backend b, const HostMoeWeights& w, const num::bf16_t* x, int T, int ranks) {
  const MoeShape& s = whole_layer(w, "forward").shape;
  if (T < 0) throw std::invalid_argument(fmt::format("token count {} must be >= 0", T));
  if (ranks < 1) throw std::invalid_argument(fmt::format("ranks = {} must be >= 1", ranks));
#if defined(MEGAMOE_HAVE_CUDA)
  if (resolve(b) == Backend::kCuda) return detail::cuda_forward(w, x, T, ranks);
#else
  resolve(b);  // (throws for an explicit cuda)
#endif
  ForwardOutput out;
  out.backend = Backend::kCpu;
  out.ids.resize(size_t(T) * s.topk);
  out.weights.resize(size_t(T) * s.topk);
  std::vector<float> y(size_t(T) * s.hidden);
  const auto t0 = std::chrono::steady_clock::now();
  if (ranks == 1) {
    MoeLayerOptions opt;
    opt.max_tokens = std::max(T, 1);
    CpuMoeLayer layer(s, w.view(), opt);  // (borrows w for this one forward)
    layer.forward(x, y.data(), T, nullptr);
    std::copy_n(layer.topk_ids(), out.ids.size(), out.ids.begin());
    std::copy_n(layer.topk_weights(), out.weights.size(), out.weights.begin());
  } else {
    // Split the tokens evenly over the ranks (the first ranks take the remainder).
    std::vector<ref::RankBatch> batches(ranks);
    std::vector<float*> ys(ranks);
    std::vector<int32_t*> ids(ranks);
    std::vector<float*> ws(ranks);
    int begin = 0;
    for (int r = 0; r < ranks; ++r) {
      const int n = T / ranks + (r < T % ranks ? 1 : 0);
      batches[r] = {x + size_t(begin) * s.hidden, n};
      ys[r] = y.data() + size_t(begin) * s.hidden;
      ids[r] = out.ids.data() + size_t(begin) * s.topk;
      ws[r] = out.weights.data() + size_t(begin) * s.topk;
      begin += n;
    }
    ref::moe_layer_ep(s, w.view(), ranks, batches, ys, ids, ws);
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  out.y.resize(y.size());
  for (size_t i = 0; i < y.size(); ++i) out.y[i] = num::bf16_encode(y[i]);
  return out;
}

}  // namespace megamoe::api
