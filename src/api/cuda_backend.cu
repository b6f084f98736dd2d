// The CUDA backend behind api::forward (one-shot: uploads, runs, downloads).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <stdexcept>

#include "../kernels/cuda_check.h"
#include "cuda_backend.h"
#include "megamoe/api/ep_layer.h"
#include "megamoe/api/moe_layer.h"

namespace megamoe::api::detail {

bool cuda_device_ok(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();
    if (why) {
      // cudart reports a missing driver as "insufficient driver": say what it means.
      if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice || n == 0)
        *why = "no NVIDIA GPU (driver or device) on this machine";
      else
        *why = std::string("the CUDA runtime cannot use the GPU: ") + cudaGetErrorString(e);
    }
    return false;
  }
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

namespace {

// Device buffers of one forward, freed on every path.
struct DeviceBuffers {
  num::bf16_t* x = nullptr;
  num::bf16_t* y = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  DeviceBuffers(const num::bf16_t* host_x, size_t bytes) {
    MEGAMOE_CUDA_CHECK(cudaMalloc(&x, std::max<size_t>(bytes, 16)));
    MEGAMOE_CUDA_CHECK(cudaMalloc(&y, std::max<size_t>(bytes, 16)));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(x, host_x, bytes, cudaMemcpyHostToDevice));
    MEGAMOE_CUDA_CHECK(cudaMemset(y, 0xFF, std::max<size_t>(bytes, 16)));  // poison
    MEGAMOE_CUDA_CHECK(cudaStreamCreate(&stream));
    MEGAMOE_CUDA_CHECK(cudaEventCreate(&e0));
    MEGAMOE_CUDA_CHECK(cudaEventCreate(&e1));
  }
  ~DeviceBuffers() {
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaStreamDestroy(stream);
    cudaFree(x);
    cudaFree(y);
  }
  // Warm-up (module load, first touch), then one timed run of `run`.
  template <typename Run>
  double time_second(Run run) {
    run();
    MEGAMOE_CUDA_CHECK(cudaEventRecord(e0, stream));
    run();
    MEGAMOE_CUDA_CHECK(cudaEventRecord(e1, stream));
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    float ms = 0;
    MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return ms * 1e-3;
  }
};

}  // namespace

ForwardOutput cuda_forward(const HostMoeWeights& w, const num::bf16_t* x, int T, int ranks) {
  std::string why;
  if (!cuda_device_ok(&why)) throw std::runtime_error("CUDA backend unavailable: " + why);
  const MoeShape& s = w.shape;
  const size_t xb = size_t(T) * s.hidden * 2;
  DeviceBuffers d(x, xb);
  ForwardOutput out;
  out.backend = Backend::kCuda;
  out.y.resize(size_t(T) * s.hidden);
  out.ids.resize(size_t(T) * s.topk);
  out.weights.resize(size_t(T) * s.topk);
  if (ranks == 1) {
    MoeLayerOptions opt;
    opt.max_tokens = std::max(1, T);
    CudaMoeLayer layer(w, opt);
    out.seconds = d.time_second([&] { layer.forward(d.x, d.y, T, nullptr, d.stream); });
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
      xs[r] = d.x + size_t(begin) * s.hidden;
      ys[r] = d.y + size_t(begin) * s.hidden;
      begin += tokens[r];
    }
    EpLayerOptions opt;
    opt.ranks = ranks;
    opt.max_tokens = std::max(1, tokens[0]);
    CudaEpMoeLayer layer(w, opt);
    out.seconds = d.time_second([&] { layer.forward(xs, ys, tokens, d.stream); });
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
  MEGAMOE_CUDA_CHECK(cudaMemcpy(out.y.data(), d.y, xb, cudaMemcpyDeviceToHost));
  return out;
}

}  // namespace megamoe::api::detail
