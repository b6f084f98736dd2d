#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "heuristics.h"

namespace megamoe::kernels {

FusedMoeConfig choose_config(const MoeShape& s, int tokens, int num_sms) {
  FusedMoeConfig c;
  // Twice the average: most experts then fit one token block, so a weight tile is
  // streamed once; while the layer is bound by reading weights a wider N is free.
  const double avg_rows = double(tokens) * s.topk / s.experts;
  c.block_n = 128;
  for (int bn : {8, 16, 32, 64, 128}) {
    if (bn >= 2.0 * avg_rows) {
      c.block_n = bn;
      break;
    }
  }
  if (const char* env = std::getenv("MEGAMOE_BLOCK_N")) c.block_n = std::atoi(env);
  c.stages = stages_for(c.block_n);
  c.num_sms = num_sms;
  return c;
}

std::string describe(const FusedMoeConfig& c) {
  return fmt::format("block_m={} block_n={} block_k={} stages={} smem={}B sms={} router_ksplit={}", kBlockM,
                     c.block_n, kBlockK, c.stages, smem_bytes(c.block_n), c.num_sms, c.router_ksplit);
}

void maybe_print_config(const MoeShape& s, int tokens, const FusedMoeConfig& c) {
  const char* env = std::getenv("MEGAMOE_PRINT_CONFIG");
  if (env && env[0] == '1')
    std::fprintf(stderr, "megamoe: T=%d %s: %s\n", tokens, s.describe().c_str(), describe(c).c_str());
}

}  // namespace megamoe::kernels
