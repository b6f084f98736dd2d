#include "call_gate.h"

#include <fmt/format.h>

#include <iterator>
#include <map>
#include <mutex>
#include <stdexcept>

namespace megamoe::api::detail {

CallGate::Entry CallGate::enter(const char* what, const char* op) {
  const char* expected = nullptr;
  if (!holder_.compare_exchange_strong(expected, op, std::memory_order_acquire, std::memory_order_relaxed))
    throw std::logic_error(fmt::format(
        "{}::{}: another thread is inside {} of this layer or of a layer sharing its workspace; calls of "
        "one layer (and of the layers of one workspace) must not overlap: give each thread its own layer "
        "and workspace, or let one call return before the next begins",
        what, op, expected));
  return Entry(*this);
}

std::shared_ptr<CallGate> gate_for_workspace(const void* workspace) {
  if (!workspace) return std::make_shared<CallGate>();
  static std::mutex mu;
  static std::map<const void*, std::weak_ptr<CallGate>> gates;
  const std::lock_guard lock(mu);
  for (auto it = gates.begin(); it != gates.end();)
    it = it->second.expired() ? gates.erase(it) : std::next(it);
  std::weak_ptr<CallGate>& slot = gates[workspace];
  std::shared_ptr<CallGate> g = slot.lock();
  if (!g) slot = g = std::make_shared<CallGate>();
  return g;
}

}  // namespace megamoe::api::detail
