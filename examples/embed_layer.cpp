// How an inference engine or an RL trainer uses megamoe, start to end, on one MoE
// layer of a Hugging Face block-FP8 checkpoint:
//   1. config.json -> ModelDesc; the layer's tensors streamed into a WeightStore
//      (the kernel layout: device memory with a GPU, host memory without);
//   2. a forward (the fused Hopper kernel, or the CPU backend without a GPU);
//   3. with a GPU: a CUDA graph captured once at the largest token count and replayed
//      at smaller counts read from device memory, then CudaMoeLayer::check();
//   4. new weights (a trainer's step; here the same checkpoint again) reloaded in
//      place: same addresses, so the layer and the captured graph stay valid, and the
//      same bytes out.
// Exits non-zero if any of those does not hold.
//
//   embed_layer CHECKPOINT_DIR [TOKENS]      (e.g. megamoe make-checkpoint's output)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "megamoe/api/forward.h"
#include "megamoe/api/moe_layer.h"
#include "megamoe/io/safetensors.h"
#include "megamoe/model/config.h"
#include "megamoe/weights/device_memory.h"
#include "megamoe/weights/store.h"

#if MEGAMOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

using namespace megamoe;

namespace {

bool expect(bool ok, const char* what) {
  std::printf("  %-62s %s\n", what, ok ? "ok" : "FAILED");
  return ok;
}

#if MEGAMOE_HAVE_CUDA
void cuda_ok(cudaError_t e, const char* call) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(call) + ": " + cudaGetErrorString(e));
}
#define CUDA_OK(call) cuda_ok((call), #call)

// Steps 2-4 on the GPU. x: [T][H] host tokens.
bool run_on_gpu(const io::Checkpoint& ckpt, const ModelDesc& desc, int layer,
                const std::vector<num::bf16_t>& x, int T) {
  WeightStoreOptions so;
  so.memory = StoreMemory::kDevice;
  so.layers = {layer};
  WeightStore store = WeightStore::for_checkpoint(ckpt, desc, so);
  store.load(ckpt);
  const MoeShape& s = store.shape(layer);
  api::MoeLayerOptions lo;
  lo.max_tokens = T;  // sizes the workspace once; every forward takes at most this many tokens
  api::CudaMoeLayer moe(store, layer, lo);  // borrows the store's buffer (loaded, on the device)

  const size_t n = size_t(T) * s.hidden;
  num::bf16_t *dx = nullptr, *dy = nullptr;
  int* dcount = nullptr;
  CUDA_OK(cudaMalloc(&dx, n * 2));
  CUDA_OK(cudaMalloc(&dy, n * 2));
  CUDA_OK(cudaMalloc(&dcount, sizeof(int)));
  CUDA_OK(cudaMemcpy(dx, x.data(), n * 2, cudaMemcpyHostToDevice));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto read_y = [&](int tokens) {
    std::vector<num::bf16_t> y(size_t(tokens) * s.hidden);
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaMemcpy(y.data(), dy, y.size() * 2, cudaMemcpyDeviceToHost));
    return y;
  };

  // 2. Eager forwards (the layer keeps the token count itself).
  const int half = (T + 1) / 2;
  moe.forward(dx, dy, T, nullptr, stream);
  const std::vector<num::bf16_t> y_full = read_y(T);
  moe.forward(dx, dy, half, nullptr, stream);
  const std::vector<num::bf16_t> y_half = read_y(half);

  // 3. One graph at T; each replay reads the token count from device memory.
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  moe.forward(dx, dy, T, dcount, stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  auto replay = [&](int tokens) {
    CUDA_OK(cudaMemcpyAsync(dcount, &tokens, sizeof(int), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    return read_y(tokens);
  };
  bool ok = true;
  ok &= expect(replay(T) == y_full, "graph replay at T: the eager forward's bytes");
  ok &= expect(replay(half) == y_half, "graph replay at T/2 (count on the device): the same");
  moe.check();  // throws if a replay read a count outside [0, T]

  // 4. Reload in place (a trainer pushes new weights: update() also takes device memory).
  const void* base = store.base(layer);
  LoadOptions reload;
  reload.mode = ReloadMode::kDirect;
  store.load(ckpt, reload);
  ok &= expect(store.base(layer) == base, "reload in place: the store's address is unchanged");
  ok &= expect(replay(T) == y_full, "the captured graph after the reload: the same bytes");
  moe.check();

  // The CPU backend (the kernel-faithful reference) on the same weights and tokens.
  const api::ForwardOutput cpu = api::forward(api::Backend::kCpu, store.to_host(layer), x.data(), T);
  std::vector<int32_t> ids(size_t(T) * s.topk);
  CUDA_OK(cudaMemcpy(ids.data(), moe.topk_ids(), ids.size() * 4, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double a = num::bf16_decode(y_full[i]), r = num::bf16_decode(cpu.y[i]);
    num += (a - r) * (a - r), den += r * r;
  }
  std::printf("  GPU vs CPU backend: routing ids %s, relative L2 %.2e\n",
              ids == cpu.ids ? "identical" : "differ (ties?)", std::sqrt(num / den));
  ok &= expect(std::sqrt(num / den) < 1e-2, "GPU output within 1e-2 (relative L2) of the CPU backend's");

  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(dx);
  cudaFree(dy);
  cudaFree(dcount);
  return ok;
}
#endif

// Steps 2 and 4 on the CPU backend (no GPU, or a build without CUDA).
bool run_on_cpu(const io::Checkpoint& ckpt, const ModelDesc& desc, int layer,
                const std::vector<num::bf16_t>& x, int T) {
  WeightStoreOptions so;
  so.layers = {layer};  // host memory
  WeightStore store = WeightStore::for_checkpoint(ckpt, desc, so);
  store.load(ckpt);
  const api::ForwardOutput first = api::forward(api::Backend::kCpu, store.to_host(layer), x.data(), T);
  std::printf("  token 0 goes to experts");
  for (int k = 0; k < store.shape(layer).topk; ++k) std::printf(" %d", first.ids[size_t(k)]);
  std::printf("\n");
  const void* base = store.base(layer);
  store.zero_experts(layer);  // as if the weights were about to change
  LoadOptions reload;
  reload.mode = ReloadMode::kDirect;
  store.load(ckpt, reload);
  const api::ForwardOutput again = api::forward(api::Backend::kCpu, store.to_host(layer), x.data(), T);
  bool ok = true;
  ok &= expect(store.base(layer) == base, "reload in place: the store's address is unchanged");
  ok &= expect(again.y == first.y && again.ids == first.ids, "the forward after the reload: the same bytes");
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR [TOKENS]\n", argv[0]);
    return 2;
  }
  try {
    const std::string dir = argv[1];
    const int T = argc > 2 ? std::atoi(argv[2]) : 16;
    if (T < 1) throw std::invalid_argument("TOKENS must be >= 1");
    // 1. The model's description and the checkpoint's tensors (memory-mapped).
    const ModelDesc desc = load_config(dir);
    const io::Checkpoint ckpt(dir);
    const int layer = desc.moe_layers.front();
    const MoeShape& s = desc.shape;
    std::printf("%s: %s, MoE layer %d: H=%d I=%d E=%d top-%d, %d tokens\n", dir.c_str(), desc.family.c_str(),
                layer, s.hidden, s.inter, s.experts, s.topk, T);
    std::vector<num::bf16_t> x(size_t(T) * s.hidden);
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& v : x) v = num::bf16_encode(normal(rng));

    std::string why;
    const bool gpu = api::cuda_available(&why);
    std::printf("backend: %s\n", gpu ? "cuda" : ("cpu (" + why + ")").c_str());
    bool ok = false;
#if MEGAMOE_HAVE_CUDA
    if (gpu) ok = run_on_gpu(ckpt, desc, layer, x, T);
#endif
    if (!gpu) ok = run_on_cpu(ckpt, desc, layer, x, T);
    std::printf("embed_layer: %s\n", ok ? "OK" : "FAILED");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "embed_layer: %s\n", e.what());
    return 1;
  }
}
