// Tuning choices of the Hopper MoE kernels, in one place. Set
// MEGAMOE_PRINT_CONFIG=1 to print the chosen configuration; benchmarks record it.
#pragma once

#include <string>

#include "megamoe/kernels/fused_moe.h"

namespace megamoe::kernels {

// Weight rows per GEMM tile (two consumer warpgroups x wgmma M=64) and K depth
// per pipeline stage (= the 128-wide block of the checkpoint's scales).
constexpr int kBlockM = 128;
constexpr int kBlockK = 128;
constexpr int kThreads = 384;  // warpgroup 0: TMA producer; 1-2: wgmma consumers
constexpr int kConsumerThreads = 256;
constexpr int kMaxExpertsTotal = 512;  // routed + shared, bounded by shared-memory tables
constexpr int kSmemBudget = 227 * 1024;
// Expert row segments start on multiples of 8 rows: the scale tensor maps put the
// row index innermost and a TMA box must start 16-byte aligned in global memory.
constexpr int kRowAlign = 8;
// Tile schedule: false = static round-robin (CTA c takes tiles c, c + grid, ...);
// true = an atomic tile counter. Measured on the H200 (bench/results/NOTES.md, v2
// vs v4): the dynamic one was ~5 % slower at T >= 64 and no faster below.
constexpr bool kDynamicTileSchedule = false;

// Pipeline depth for a token block: as many stages as fit the budget, at most 12.
constexpr int stage_bytes(int block_n) {
  return ((kBlockM * kBlockK + block_n * kBlockK + 2 * block_n * 4) + 1023) / 1024 * 1024;
}
constexpr int fixed_smem_bytes(int block_n) {
  // 1 KB alignment slack + barriers + tile id per stage + expert tables (3 x 513 ints)
  // + amax table (8 warps x block_n)
  return 1024 + 2 * 16 * 8 + 16 * 4 + 3 * (kMaxExpertsTotal + 1) * 4 + 8 * block_n * 4;
}
constexpr int stages_for(int block_n) {
  const int s = (kSmemBudget - fixed_smem_bytes(block_n)) / stage_bytes(block_n);
  return s > 12 ? 12 : s;
}
constexpr int smem_bytes(int block_n) {
  return fixed_smem_bytes(block_n) + stages_for(block_n) * stage_bytes(block_n);
}

// Token block (wgmma N): the smallest of 8..128 that holds twice the average
// rows per routed expert, so decode tiles waste few columns, most experts take
// one block, and prefill tiles reuse each weight tile over up to 128 tokens.
FusedMoeConfig choose_config(const MoeShape& s, int tokens, int num_sms);

std::string describe(const FusedMoeConfig& c);
void maybe_print_config(const MoeShape& s, int tokens, const FusedMoeConfig& c);

}  // namespace megamoe::kernels
