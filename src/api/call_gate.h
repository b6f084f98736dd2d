// CallGate: detects overlapping calls into state that admits one caller at a time.
//
// A CUDA layer's forward, route and check() use host state of its plan (the launch
// parameters, the records check() reads) and the device scratch of its workspace, which
// layers sharing the workspace share too. Two such calls from two threads at once would
// interleave their launches and corrupt each other's tokens; the library does not wait for
// the other call (that would hide the missing ordering of the device work, which only the
// caller can provide), it refuses the second call with std::logic_error naming both.
#pragma once

#include <atomic>
#include <memory>

namespace megamoe::api::detail {

class CallGate {
 public:
  // Held for one call; releases the gate when it goes out of scope.
  class Entry {
   public:
    explicit Entry(CallGate& g) : gate_(&g) {}
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;
    ~Entry() { gate_->holder_.store(nullptr, std::memory_order_release); }

   private:
    CallGate* gate_;
  };

  // `what` names the layer type ("CudaMoeLayer"), `op` the call ("forward"); both outlive
  // the call (string literals). Throws std::logic_error if another call holds the gate.
  [[nodiscard]] Entry enter(const char* what, const char* op);

 private:
  std::atomic<const char*> holder_{nullptr};  // the op inside, or null
};

// The gate of the layers that run in `workspace` (one per workspace, alive while any of
// them holds it); null: a gate of its own (a layer that allocates its workspace).
std::shared_ptr<CallGate> gate_for_workspace(const void* workspace);

}  // namespace megamoe::api::detail
