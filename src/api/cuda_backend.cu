// The CUDA backend behind api::forward (one-shot: uploads, runs, downloads).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <stdexcept>

#include "../kernels/cuda_check.h"
#include "cuda_backend.h"
#include "device_run.h"
#include "megamoe/api/ep_layer.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/kernels/fused_moe.h"
#include "megamoe/weights/device_memory.h"

namespace megamoe::api::detail {

const kernels::Overrides& switches() { return kernels::overrides(); }

transport::NcclSearch nccl_search() {
  const kernels::Overrides& sw = switches();
  transport::NcclSearch where;
  where.library = sw.nccl_lib.value_or("");
  for (const auto& p : {sw.virtual_env, sw.conda_prefix})
    if (p && !p->empty()) where.python_prefixes.push_back(*p);
  return where;
}

bool cuda_device_ok(std::string* why) {
  if (!dev::device_memory_available(why)) return false;
  int dev = 0, major = 0, minor = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major != 9 || minor != 0) {
    if (why)
      *why = fmt::format("device {} has compute capability {}.{}; the kernels are built for sm_90a (Hopper)",
                         dev, major, minor);
    return false;
  }
  return true;
}

ForwardOutput cuda_forward(const HostMoeWeights& w, const num::bf16_t* x, int T, int ranks) {
  std::string why;
  if (!cuda_device_ok(&why)) throw std::runtime_error("CUDA backend unavailable: " + why);
  const MoeShape& s = w.shape;
  const size_t xb = size_t(T) * s.hidden * 2;
  DeviceBuffer dx(xb), dy(xb);
  MEGAMOE_CUDA_CHECK(cudaMemcpy(dx.p, x, xb, cudaMemcpyHostToDevice));
  MEGAMOE_CUDA_CHECK(cudaMemset(dy.p, 0xFF, xb));  // poison
  TimedStream ts;
  ForwardOutput out;
  out.backend = Backend::kCuda;
  out.y.resize(size_t(T) * s.hidden);
  out.ids.resize(size_t(T) * s.topk);
  out.weights.resize(size_t(T) * s.topk);
  if (ranks == 1) {
    MoeLayerOptions opt;
    opt.max_tokens = std::max(1, T);
    CudaMoeLayer layer(w, opt);
    out.seconds = ts.time_second(
        [&] { layer.forward(dx.as<num::bf16_t>(), dy.as<num::bf16_t>(), T, nullptr, ts.stream); });
    MEGAMOE_CUDA_CHECK(
        cudaMemcpy(out.ids.data(), layer.topk_ids(), out.ids.size() * 4, cudaMemcpyDeviceToHost));
    MEGAMOE_CUDA_CHECK(
        cudaMemcpy(out.weights.data(), layer.topk_weights(), out.weights.size() * 4, cudaMemcpyDeviceToHost));
  } else {
    // R virtual ranks on this GPU; the tokens split evenly (the first ranks take the
    // remainder), as the CPU expert-parallel reference splits them.
    std::vector<int> tokens(ranks);
    std::vector<const num::bf16_t*> xs(ranks);
    std::vector<num::bf16_t*> ys(ranks);
    int begin = 0;
    for (int r = 0; r < ranks; ++r) {
      tokens[r] = T / ranks + (r < T % ranks ? 1 : 0);
      xs[r] = dx.as<num::bf16_t>() + size_t(begin) * s.hidden;
      ys[r] = dy.as<num::bf16_t>() + size_t(begin) * s.hidden;
      begin += tokens[r];
    }
    EpLayerOptions opt;
    opt.ranks = ranks;
    opt.max_tokens = std::max(1, tokens[0]);
    CudaEpMoeLayer layer(w, opt);
    out.seconds = ts.time_second([&] { layer.forward(xs, ys, tokens, ts.stream); });
    layer.check();
    begin = 0;
    for (int r = 0; r < ranks; ++r) {
      const size_t n = size_t(tokens[r]) * s.topk, at = size_t(begin) * s.topk;
      MEGAMOE_CUDA_CHECK(cudaMemcpy(out.ids.data() + at, layer.topk_ids(r), n * 4, cudaMemcpyDeviceToHost));
      MEGAMOE_CUDA_CHECK(
          cudaMemcpy(out.weights.data() + at, layer.topk_weights(r), n * 4, cudaMemcpyDeviceToHost));
      begin += tokens[r];
    }
  }
  MEGAMOE_CUDA_CHECK(cudaMemcpy(out.y.data(), dy.p, xb, cudaMemcpyDeviceToHost));
  return out;
}

}  // namespace megamoe::api::detail

namespace megamoe::kernels {

// (the deprecated overload: the API edge's switches)
FusedMoePlan* fused_moe_plan_create(const MoeShape& s, const MoeWeightsView& w, const MoeWorkspaceLayout& ws,
                                    void* workspace, const FusedMoeConfig& cfg, const EpRank* ep) {
  return fused_moe_plan_create(s, w, ws, workspace, cfg, api::detail::switches(), ep);
}

}  // namespace megamoe::kernels

namespace megamoe::transport {

// (the search with the API edge's switches: the transport itself reads none)
const NcclLibrary& find_nccl() { return find_nccl(api::detail::nccl_search()); }

}  // namespace megamoe::transport
