// Virtual ranks: R symmetric buffers on one device, one process (transport.h).
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "../kernels/cuda_check.h"
#include "megamoe/transport/transport.h"

namespace megamoe::transport {
namespace {

class VirtualRanks final : public Transport {
 public:
  explicit VirtualRanks(const kernels::EpLayout& l) : layout_(l) {
    MEGAMOE_CUDA_CHECK(cudaGetDevice(&device_));
    MEGAMOE_CHECK(l.ranks >= 1 && l.ranks <= kMaxRanks, "virtual ranks: " + std::to_string(l.ranks) +
                                                            " ranks (1.." + std::to_string(kMaxRanks) + ")");
    try {
      for (int r = 0; r < l.ranks; ++r) {
        void* p = nullptr;
        const cudaError_t e = cudaMalloc(&p, l.total_bytes);
        if (e != cudaSuccess)
          throw std::runtime_error("virtual rank " + std::to_string(r) + ": cudaMalloc of " +
                                   std::to_string(l.total_bytes) + " bytes failed: " + cudaGetErrorString(e));
        buffers_.push_back(static_cast<uint8_t*>(p));
        // Zeroed once: signals start below any epoch, counts at zero.
        MEGAMOE_CUDA_CHECK(cudaMemset(p, 0, l.total_bytes));
      }
    } catch (...) {
      release();
      throw;
    }
  }
  ~VirtualRanks() override { release(); }
  int ranks() const override { return layout_.ranks; }
  const kernels::EpLayout& layout() const override { return layout_; }
  std::vector<int> local_ranks() const override {
    std::vector<int> r(layout_.ranks);
    for (int q = 0; q < layout_.ranks; ++q) r[q] = q;
    return r;
  }
  int device(int) const override { return device_; }
  PeerTable peers(int rank) const override {
    MEGAMOE_CHECK(rank >= 0 && rank < layout_.ranks, "virtual ranks: no rank " + std::to_string(rank));
    PeerTable t;
    t.ranks = layout_.ranks;
    t.rank = rank;
    for (int q = 0; q < layout_.ranks; ++q) t.base[q] = buffers_[q];
    return t;
  }

 private:
  void release() {
    for (uint8_t* p : buffers_) cudaFree(p);
    buffers_.clear();
  }
  kernels::EpLayout layout_;
  int device_ = 0;
  std::vector<uint8_t*> buffers_;
};

}  // namespace

std::unique_ptr<Transport> make_virtual_ranks(const kernels::EpLayout& layout) {
  return std::make_unique<VirtualRanks>(layout);
}

}  // namespace megamoe::transport
