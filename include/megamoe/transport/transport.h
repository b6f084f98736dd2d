// Transports of expert parallelism (issue 5): they allocate every rank's symmetric
// buffer (kernels::EpLayout) and hand each rank's kernel the table of peer base
// addresses, through which it reads and writes the other ranks' regions with plain
// loads and stores. Nothing here knows the MoE math.
//   - virtual ranks: R ranks in one process on one GPU (each its own buffer); the
//     whole protocol runs and is tested where there is a single GPU;
//   - NCCL symmetric windows (NCCL >= 2.28, LSA pointers): R GPUs in one NVLink
//     domain (not built yet; issue 5).
#pragma once

#include <cstdint>
#include <memory>

#include "megamoe/kernels/ep_layout.h"

namespace megamoe::transport {

constexpr int kMaxRanks = 1 << kernels::EpLayout::kRankBits;

// Passed by value to a rank's kernel: base[q] is rank q's symmetric buffer as this
// rank addresses it (its own at base[rank]).
struct PeerTable {
  int ranks = 0;
  int rank = 0;
  uint8_t* base[kMaxRanks] = {};
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int ranks() const = 0;
  virtual const kernels::EpLayout& layout() const = 0;
  // The table of `rank` (a rank this process drives).
  virtual PeerTable peers(int rank) const = 0;
};

// R = layout.ranks virtual ranks on the current CUDA device: one zeroed device
// allocation of layout.total_bytes per rank. Throws with the CUDA error if memory
// runs out (the message names the rank and the bytes).
std::unique_ptr<Transport> make_virtual_ranks(const kernels::EpLayout& layout);

}  // namespace megamoe::transport
