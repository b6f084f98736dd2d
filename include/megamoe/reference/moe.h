// CPU reference of the whole MoE layer (docs/numerics.md §6, §7) and of expert
// parallelism over R simulated ranks (docs/numerics.md §8): the oracle for every kernel
// and the CPU backend of the tools.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "megamoe/model/shape.h"
#include "megamoe/numerics/fp8.h"
#include "megamoe/weights/layout.h"

namespace megamoe::ref {

// Routing for T tokens: ids [T][K] (int32, -1 = padding) and weights [T][K]
// (unbiased scores of the chosen experts, renormalized if norm_topk_prob, then
// times routed_scaling). Logits are accumulated in double and rounded to the
// router dtype's arithmetic (float). Ties go to the lower expert id.
// If `logits` is non-null it receives the float logits [T][E].
void route(const MoeShape& s, const MoeWeightsView& w, const num::bf16_t* x, int T, int32_t* ids,
           float* weights, float* logits = nullptr);

enum class Mode {
  // float64 throughout, activations unquantized (x and the SwiGLU output).
  kExact,
  // Mirrors the Hopper kernel: x -> E4M3 per 1x128 (act_scale), each 128-deep
  // block (num::kGemm1FoldK) accumulated as the tensor cores accumulate it (a chain of
  // num::fp8_mma_step, fitted to and tested against the H200) and folded in float32
  // with scale_x * scale_w of its 128-block; SwiGLU in float32; the SwiGLU output (times the routing
  // weight) -> E4M3 per 1x128 (num::kInterGroup); second GEMM folded per 128-deep
  // block; each slot's output rounded to BF16; slots summed in ascending order
  // (routed 0..K-1, then shared) in float32 and rounded to BF16.
  kKernelFaithful,
};

struct LayerOptions {
  int threads = 0;  // 0 = hardware concurrency
};

// y [T][H] as float. In kKernelFaithful mode every value is exactly a BF16.
// ids/weights as produced by route() (or any valid routing, -1 = padding).
void moe_layer(const MoeShape& s, const MoeWeightsView& w, const num::bf16_t* x, int T, const int32_t* ids,
               const float* weights, Mode mode, float* y, const LayerOptions& opt = {});

// One rank's batch for the expert-parallel reference.
struct RankBatch {
  const num::bf16_t* x = nullptr;  // [T][H]
  int T = 0;
};

// Expert parallelism over R simulated ranks (R divides E): each rank routes
// its own tokens, dispatches each token's FP8 row and scales to the ranks
// owning its experts (rank of expert e = e / (E/R)), every rank runs its local
// experts on what it received and the shared expert on its own tokens, sends
// each slot result back, and the source rank reduces in slot order.
// y[r] receives [T_r][H]; ids[r]/weights[r] ([T_r][K]) may be null.
struct EpStats {
  std::vector<int64_t> rows_received;  // per rank: (token, expert) rows computed
  std::vector<int64_t> tokens_sent;    // per rank: token copies sent (one per destination rank)
};
EpStats moe_layer_ep(const MoeShape& s, const MoeWeightsView& w, int R, std::span<const RankBatch> ranks,
                     std::span<float* const> y, std::span<int32_t* const> ids = {},
                     std::span<float* const> weights = {}, const LayerOptions& opt = {});
// The same with rank-local weights, as expert-parallel ranks hold them: R =
// rank_weights.size(), and rank r's view holds experts [r*E/R, (r+1)*E/R) from its
// expert 0 (a layout of MoeWeightLayout::compute(s, ExpertRange{r*E/R, E/R})), the
// shared expert and the whole router. Same bytes as the whole-layer form.
EpStats moe_layer_ep(const MoeShape& s, std::span<const MoeWeightsView> rank_weights,
                     std::span<const RankBatch> ranks, std::span<float* const> y,
                     std::span<int32_t* const> ids = {}, std::span<float* const> weights = {},
                     const LayerOptions& opt = {});

}  // namespace megamoe::ref
