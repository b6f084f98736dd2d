// Expert-parallel dispatch (issue 5, steps 2-3 of ep_layout.h's flow) as its own
// kernel over R ranks: every rank sorts its token slots by destination, publishes
// its counts to the owners, and each owner pulls the rows of its local experts
// from the sources' symmetric buffers into its receive ring. It is the first piece
// of the fused kernel's expert-parallel phase 0, tested on its own first.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "megamoe/kernels/ep_layout.h"
#include "megamoe/transport/transport.h"

namespace megamoe::kernels {

// One launch runs `ranks_here` ranks of this process (virtual ranks: all R on one
// GPU, co-resident; one block each). Rank r's tokens are in its x_q / x_scale /
// topk_* regions; num_tokens[i] is the token count of the i-th rank launched.
// `epoch` must grow by one per forward (signals compare against it).
// Writes, per owner, recv_x / recv_scale / recv_weight / recv_src: local expert el's
// segment starts at ep_segment_start(counts, el) and holds the rows of source 0,
// then source 1, ...
void ep_dispatch(const EpLayout& l, const transport::PeerTable* tables, int ranks_here, const int* num_tokens,
                 uint64_t epoch, cudaStream_t stream);

// Start row of local expert el's segment in an owner's receive ring, from the
// owner's counts region ([R][E/R + 1]): segments padded to EpLayout::kRowAlign.
MEGAMOE_HD int ep_segment_start(const EpLayout& l, const int32_t* counts, int el) {
  int row = 0;
  for (int e = 0; e < el; ++e) {
    int n = 0;
    for (int src = 0; src < l.ranks; ++src) n += counts[src * (l.local_experts + 1) + e];
    row += EpLayout::pad_rows(n);
  }
  return row;
}

}  // namespace megamoe::kernels
