// Routing kernels (docs/numerics.md §6): router GEMM with deterministic split-K, then
// per-token scores, correction bias, grouped top-k, weights and per-expert
// row positions. Raw pointers only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "heuristics.h"
#include "megamoe/kernels/overrides.h"
#include "megamoe/model/shape.h"

namespace megamoe::kernels {

struct RouteArgs {
  const uint16_t* x = nullptr;   // bf16 [T][H]
  const void* router = nullptr;  // bf16 or f32 [E][H]
  const float* bias = nullptr;   // [E] or null
  const int* num_tokens = nullptr;
  int tokens_cap = 0;            // the forward's host hint: T is clamped into [0, tokens_cap]
  int* token_status = nullptr;   // TokenCountStatus words (route_logits records a clamp)
  float* partial = nullptr;      // [kRouterGroups][max_tokens][E]
  int32_t* ids = nullptr;        // [T][K]
  float* weights = nullptr;      // [T][K]
  int32_t* pos = nullptr;        // [T][K]
  int* expert_counts = nullptr;  // [E], inside `zero` (zeroed by route_logits)
  int* zero = nullptr;           // the forward's counters: route_logits zeroes them first
  int zero_words = 0;
  int max_tokens = 0;
  // The forward count, bumped once per forward (expert parallelism's epoch, ep_layout.h;
  // DebugArgs::unit_turn).
  uint64_t* epoch = nullptr;
};

// T of a forward: the device count clamped into [0, cap] (cap = the host hint the launch
// was sized for). Every kernel of the forward reads T through this, so they agree on it
// even when a caller's count is out of range (route_logits reports that: TokenCountStatus).
__device__ __forceinline__ int device_token_count(const int* num_tokens, int cap) {
  return min(max(*num_tokens, 0), cap);
}

// The caller's routing (CudaMoeLayer::forward with a RoutingInput): route_external writes
// what route_logits + route_topk write for the fused kernel (counters zeroed, epoch bumped,
// token count recorded; ids, weights, positions and per-expert rows), from ids and weights
// the caller computed. An id outside [0, E) becomes expert 0 with weight 0 (no read or
// write out of bounds; the slot adds nothing) and is recorded in `id_status`.
struct RouteExternalArgs {
  const void* in_ids = nullptr;       // int32 or int64 [T][K], device memory
  bool in_ids_64 = false;             // in_ids holds int64
  const float* in_weights = nullptr;  // f32 [T][K]
  const int* num_tokens = nullptr;
  int tokens_cap = 0;            // the forward's host hint (device_token_count)
  int* token_status = nullptr;   // TokenCountStatus words [0, 3)
  int* id_status = nullptr;      // RoutingIdStatus words (kernels/fused_moe.h)
  int32_t* ids = nullptr;        // [T][K]
  float* weights = nullptr;      // [T][K]
  int32_t* pos = nullptr;        // [T][K]
  int* expert_counts = nullptr;  // [E], inside `zero`
  int* zero = nullptr;           // the forward's counters (MoeWorkspaceLayout::counters)
  int zero_words = 0;
  uint64_t* epoch = nullptr;  // bumped once, as route_logits does
};

// One block of kRouteExternalThreads (the per-expert positions come from shared-memory
// atomics, so the block needs no grid-wide ordering between zeroing and counting).
void launch_route_external(const MoeShape& s, const RouteExternalArgs& a, cudaStream_t stream);

// Raises the router kernels' shared-memory limits and finds route_topk's resident blocks an
// SM (at plan creation, before any launch).
void route_prepare();

// programmatic: route_topk starts while route_logits runs (FusedMoeConfig::programmatic_launch);
// route_tile: the router tile Overrides::route_tile forces (unset: by the token hint).
void launch_route(const MoeShape& s, const RouteArgs& a, int host_tokens_hint, int num_sms, bool programmatic,
                  std::optional<kernels::RouteTile> route_tile, cudaStream_t stream);

}  // namespace megamoe::kernels
