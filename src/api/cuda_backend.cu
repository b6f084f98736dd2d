// The CUDA backend behind api::forward (one-shot: uploads, runs, downloads).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <stdexcept>

#include "../kernels/cuda_check.h"
#include "cuda_backend.h"
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

ForwardOutput cuda_forward(const HostMoeWeights& w, const num::bf16_t* x, int T, int ranks) {
  if (ranks != 1)
    throw std::invalid_argument(
        "--ranks > 1 with the CUDA backend needs the expert-parallel kernel, which is not built yet; "
        "use --backend cpu for the expert-parallel reference");
  std::string why;
  if (!cuda_device_ok(&why)) throw std::runtime_error("CUDA backend unavailable: " + why);
  const MoeShape& s = w.shape;
  MoeLayerOptions opt;
  opt.max_tokens = std::max(1, T);
  CudaMoeLayer layer(w, opt);
  const size_t xb = size_t(T) * s.hidden * 2;
  num::bf16_t *dx = nullptr, *dy = nullptr;
  MEGAMOE_CUDA_CHECK(cudaMalloc(&dx, std::max<size_t>(xb, 16)));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&dy, std::max<size_t>(xb, 16)));
  MEGAMOE_CUDA_CHECK(cudaMemcpy(dx, x, xb, cudaMemcpyHostToDevice));
  MEGAMOE_CUDA_CHECK(cudaMemset(dy, 0xFF, std::max<size_t>(xb, 16)));  // poison
  cudaStream_t stream;
  MEGAMOE_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaEvent_t e0, e1;
  MEGAMOE_CUDA_CHECK(cudaEventCreate(&e0));
  MEGAMOE_CUDA_CHECK(cudaEventCreate(&e1));
  layer.forward(dx, dy, T, nullptr, stream);  // warm-up (module load, first touch)
  MEGAMOE_CUDA_CHECK(cudaEventRecord(e0, stream));
  layer.forward(dx, dy, T, nullptr, stream);
  MEGAMOE_CUDA_CHECK(cudaEventRecord(e1, stream));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  float ms = 0;
  MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  ForwardOutput out;
  out.backend = Backend::kCuda;
  out.seconds = ms * 1e-3;
  out.y.resize(size_t(T) * s.hidden);
  out.ids.resize(size_t(T) * s.topk);
  out.weights.resize(size_t(T) * s.topk);
  MEGAMOE_CUDA_CHECK(cudaMemcpy(out.y.data(), dy, xb, cudaMemcpyDeviceToHost));
  MEGAMOE_CUDA_CHECK(
      cudaMemcpy(out.ids.data(), layer.topk_ids(), out.ids.size() * 4, cudaMemcpyDeviceToHost));
  MEGAMOE_CUDA_CHECK(
      cudaMemcpy(out.weights.data(), layer.topk_weights(), out.weights.size() * 4, cudaMemcpyDeviceToHost));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(stream);
  cudaFree(dx);
  cudaFree(dy);
  return out;
}

}  // namespace megamoe::api::detail
