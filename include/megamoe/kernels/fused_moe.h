// Kernel-layer interface of the Hopper MoE path: plain structs and raw device
// pointers only (no framework types, no files, no configs). The api layer
// (src/api) owns allocation and validation and calls these launchers.
//
// One forward = 3 kernels, all CUDA-graph capturable:
//   1. route_logits: zeroes the workspace counters (epoch reset); router GEMM
//      on the tensor cores (BF16 x, the weight as three BF16 terms when it is
//      F32), float32 sums over 4 fixed K slices (the same float computation
//      whatever the tile shape, so routing is bit-stable),
//   2. route_topk: scores, bias, grouped top-k, weights; per-expert row counts
//      (with the caller's routing, route_external does 1 and 2: ExternalRouting),
//   3. fused_moe: ONE persistent kernel: quantize x (1x128 E4M3) and scatter
//      each token to its experts' row segments, grid barrier, then a
//      static byte-balanced tile schedule of GEMM1 tiles (w13, SwiGLU, x
//      routing weight, 1x128 E4M3) and GEMM2 tiles (w2 -> BF16 per slot) with
//      per-(expert, token block) completion counters between them, then the
//      ordered slot reduction.
// The token count is read from device memory, so one captured graph serves any
// count up to max_tokens.
// Expert parallelism (EpRank below, ep_layout.h's flow): the same kernels; the
// fused kernel's phase 0 also exchanges counts with the peers and pulls the rows
// of its local experts into its private ring, its GEMM2 epilogue stores routed
// rows into the source ranks' combine slots, and the combine waits for every
// owner before it reduces.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "megamoe/kernels/config.h"
#include "megamoe/kernels/ep_layout.h"
#include "megamoe/kernels/overrides.h"
#include "megamoe/model/shape.h"
#include "megamoe/weights/layout.h"

namespace megamoe::kernels {

// Workspace of one layer object, sized once from (shape, max_tokens). All
// regions live in one device allocation; `counters` is zeroed per forward.
struct MoeWorkspaceLayout {
  // counters (int32): [0] grid barrier, [1] GEMM2 tiles done, [2] pool tiles claimed,
  // [3, 3 + E_total) rows per expert (E_total = E + shared), then one GEMM1-done
  // counter per (expert, token block) unit.
  static constexpr int kCounterBarrier = 0;
  static constexpr int kCounterDone2 = 1;
  static constexpr int kCounterPool = 2;
  static constexpr int kCounterExperts = 3;

  int max_tokens = 0;       // per rank under expert parallelism
  int ep_ranks = 0;         // 0: all experts here; R >= 1: this rank owns E/R experts
  int experts_total = 0;    // routed (all E: routing counts every expert) + (1 if shared)
  int local_experts = 0;    // experts this rank computes (E, or E/R)
  int rows_cap = 0;         // sorted rows: max_tokens * slots, rounded up to 128
  int units_cap = 0;        // (expert, token block) units at the smallest block
  int inter_pitch = 0;      // max(I, Is): row pitch of the intermediate
  int router_partials = 0;  // partial router logits a token (kRouterGroups)

  Region counters;        // int32 [counter_count()]
  Region logits_partial;  // f32 [router_partials][max_tokens][E]
  Region topk_ids;        // i32 [max_tokens][K]
  Region topk_weights;    // f32 [max_tokens][K]
  Region topk_pos;        // i32 [max_tokens][K]   position inside the expert's row segment
  Region x_sorted;        // e4m3 [rows_cap][H]    expert-sorted token rows
  Region x_sorted_scale;  // f32 [H/128][rows_cap] (K-block-major: TMA loads a token block's scales)
  Region row_weight;      // f32 [rows_cap]        routing weight of each sorted row (shared: 1)
  Region act2;            // e4m3 [rows_cap][inter_pitch]  SwiGLU output
  Region act2_scale;      // f32 [inter_pitch/128][rows_cap] (num::kInterGroup)
  Region y_rows;          // bf16 [rows_cap][H]    per-slot outputs: single device [token][slot]
                          //   (slots routed 0..K-1, then shared), expert parallelism sorted rows
  Region row_src;         // i32 [rows_cap]        where a sorted row's output goes: single device
                          //   token * slots + slot, expert parallelism packed (source, token, slot)
  Region ep_state;        // u64 [2]               expert parallelism: epoch, status (EpStatus)
  Region token_status;    // i32 [TokenCountStatus::kWords]: device token counts out of range
                          //   (sticky until token_count_take; not zeroed per forward)
  size_t total_bytes = 0;

  int counter_count() const { return kCounterExperts + experts_total + units_cap; }
  // ep_ranks = 0: every expert on this device. ep_ranks = R: the rows of a rank
  // owning E/R experts that receives from R sources of max_tokens each.
  static MoeWorkspaceLayout compute(const MoeShape& s, int max_tokens, int ep_ranks = 0);
};

struct DeviceTensors {
  const uint16_t* x = nullptr;      // bf16 [T][H]
  const int* num_tokens = nullptr;  // device int: T in [0, tokens hint] (else clamped, TokenCountStatus)
  uint16_t* y = nullptr;            // bf16 [T][H]
  void* workspace = nullptr;        // MoeWorkspaceLayout::total_bytes
};

// One rank of an expert-parallel layer. The weights view handed to the plan holds
// only this rank's E/R routed experts (from its expert 0: MoeWeightLayout::compute(s,
// ExpertRange{rank * E/R, E/R})), the shared expert and the whole router.
struct EpRank {
  EpLayout layout;  // the symmetric buffer every rank holds
  int rank = 0;
  uint8_t* peer_base[1 << EpLayout::kRankBits] = {};  // rank q's buffer as this rank addresses it
  double timeout_s = 5.0;  // a peer that does not arrive within this is an error, not a hang
  // false: the workspace is in use by other layers' plans (CudaEpMoeLayer's shared group):
  // its epoch, status and token-count record stay as they are (the plan writes nothing there).
  bool init_state = true;
};

// What a rank's kernel reports (ep_state[1]); 0 = fine.
struct EpStatus {
  enum Phase { kNone = 0, kCounts = 1, kCombine = 2, kBarrier = 3 };
  Phase phase = kNone;
  int rank = -1;  // the rank that reported
  int peer = -1;  // the peer it waited for
  std::string message() const;
  // The status word (0 = fine) the kernel writes and the host reads.
  MEGAMOE_HD static uint64_t encode(Phase phase, int rank, int peer) {
    return (uint64_t(1) << 48) | (uint64_t(phase) << 32) | (uint64_t(uint16_t(rank)) << 16) |
           uint64_t(uint16_t(peer));
  }
  static EpStatus decode(uint64_t code) {
    EpStatus st;
    if (code == 0) return st;
    st.phase = Phase((code >> 32) & 0xFFFF);
    st.rank = int((code >> 16) & 0xFFFF);
    st.peer = int(code & 0xFFFF);
    return st;
  }
};

// What the kernels saw of the device token count. A count outside [0, tokens hint]
// is a caller's bug that would read past x and the routing outputs and write past y:
// every kernel of the forward clamps it into that range (one rule, device_token_count
// in route.cuh, so they agree on T) and route_logits records it here for the host.
struct TokenCountStatus {
  // Words of the workspace's status region (MoeWorkspaceLayout::token_status): this record's
  // first three (forwards that read a bad count, the last such count, its hint), then the
  // external routing's (RoutingIdStatus).
  static constexpr int kWords = 8;
  int bad_forwards = 0;
  int last_count = 0;
  int last_hint = 0;
  std::string message() const;  // empty when bad_forwards == 0
};

// What route_external saw of the caller's expert ids (words [kFirstWord, kFirstWord + 5) of
// the status region, sticky until routing_ids_take): ids outside [0, E), which it computed
// as expert 0 at weight 0, and the first of them (the lowest slot of the first forward that
// had any).
struct RoutingIdStatus {
  static constexpr int kFirstWord = 3;  // after TokenCountStatus's words
  int bad_ids = 0;                      // (saturates at INT_MAX)
  int first_token = 0;
  int first_slot = 0;
  int64_t first_value = 0;
  int experts = 0;              // E, for the message
  std::string message() const;  // empty when bad_ids == 0
};

// The caller's routing for fused_moe_forward (device memory, row-major [T][K]): expert ids
// int32 (id_bytes 4) or int64 (8), float32 weights used as given.
struct ExternalRouting {
  const void* ids = nullptr;
  int id_bytes = 4;
  const float* weights = nullptr;
};

// Opaque per-layer launch plan: tensor maps etc. (built once per layer object).
struct FusedMoePlan;

// `switches`: the environment's (Overrides), read once at the API edge; the plan keeps them and
// decides everything the layer's forwards share from them (src/kernels/config.h). cfg.num_sms > 0
// caps the persistent grid.
FusedMoePlan* fused_moe_plan_create(const MoeShape& s, const MoeWeightsView& device_weights,
                                    const MoeWorkspaceLayout& ws, void* workspace, const FusedMoeConfig& cfg,
                                    const Overrides& switches, const EpRank* ep = nullptr);
// Deprecated: the process's switches (overrides()); pass them instead.
[[deprecated("pass the switches: fused_moe_plan_create(..., cfg, overrides(), ep)")]] FusedMoePlan*
fused_moe_plan_create(const MoeShape& s, const MoeWeightsView& device_weights, const MoeWorkspaceLayout& ws,
                      void* workspace, const FusedMoeConfig& cfg, const EpRank* ep = nullptr);
void fused_moe_plan_destroy(FusedMoePlan* plan);

// Where the last fused_moe launch spent its cycles, per role, on stderr (a build with
// -DMEGAMOE_PROFILE=ON; otherwise nothing).
void fused_moe_print_profile(int tokens);

// Measurement hook for `megamoe bench --diagnostics`: the routing launches only the
// kernels in the mask (its outputs are then stale; never set around a forward).
// Every forward launches kRoutePartLogits | kRoutePartTopk.
constexpr int kRoutePartLogits = 1, kRoutePartTopk = 2;
void set_route_parts_for_timing(int parts);

// Enqueues the whole forward (route_logits, route_topk, fused_moe).
// host_tokens_hint: an upper bound of the device token count (<= max_tokens);
// it sizes the router grid and picks the tile configuration, so a graph
// captured at a hint serves every count up to it.
// The forward's tile switches (Overrides' "tile configuration" fields, and print_config) are
// `switches`' where given (the API edge's, read at the call), else the plan's.
void fused_moe_forward(const FusedMoePlan* plan, const DeviceTensors& t, int host_tokens_hint,
                       cudaStream_t stream);
void fused_moe_forward(const FusedMoePlan* plan, const DeviceTensors& t, int host_tokens_hint,
                       cudaStream_t stream, const Overrides& switches);
// The same forward on the caller's routing: route_external (one small kernel) replaces
// route_logits and route_topk and writes what they write, so the fused kernel runs as
// usual. Not under expert parallelism (the plan must be single-device).
void fused_moe_forward(const FusedMoePlan* plan, const DeviceTensors& t, int host_tokens_hint,
                       cudaStream_t stream, const ExternalRouting& routing);
void fused_moe_forward(const FusedMoePlan* plan, const DeviceTensors& t, int host_tokens_hint,
                       cudaStream_t stream, const ExternalRouting& routing, const Overrides& switches);

// Only the routing part (route_logits + route_topk), for tests/bench.
void route_forward(const FusedMoePlan* plan, const DeviceTensors& t, int host_tokens_hint,
                   cudaStream_t stream);
void route_forward(const FusedMoePlan* plan, const DeviceTensors& t, int host_tokens_hint,
                   cudaStream_t stream, const Overrides& switches);

// Device pointers of the routing outputs inside the workspace ([T][K] each).
struct RoutingOutputs {
  const int32_t* ids;
  const float* weights;
};
RoutingOutputs routing_outputs(const FusedMoePlan* plan);

// Expert parallelism: the rank's status after its forwards completed (reads device
// memory: synchronizes the device), and a reset of its epoch, status and signals
// (every rank of the group resets before the next forward after an error).
EpStatus ep_status(const FusedMoePlan* plan);
void ep_reset(const FusedMoePlan* plan);

// The token-count record of the forwards so far (synchronizes the device), cleared when
// it holds a bad count, so each one is reported once.
TokenCountStatus token_count_take(const FusedMoePlan* plan);
// The external routing's record of bad ids (synchronizes the device), cleared when it holds
// one, so each is reported once.
RoutingIdStatus routing_ids_take(const FusedMoePlan* plan);

// *p = v on the stream (a one-thread kernel, so it can be captured in a graph).
void set_device_int(int* p, int v, cudaStream_t stream);

// The tile configuration a forward at `tokens` would use (for reports; resolve_config on the
// plan's inputs).
FusedMoeConfig fused_moe_config(const FusedMoePlan* plan, int tokens);
FusedMoeConfig fused_moe_config(const FusedMoePlan* plan, int tokens, const Overrides& switches);

}  // namespace megamoe::kernels
