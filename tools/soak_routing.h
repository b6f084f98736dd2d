// How the soak judges one token's routing against the reference's (docs/numerics.md §6):
// the same experts, or experts swapped where their selection scores tie to within 1e-5;
// where the experts agree, the same weights to within 1e-5. Header-only so that a test can
// hold the rule to cases (tests/cpu/test_cli_soak.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace megamoe::soak {

enum class RoutingVerdict { kSame, kTie, kWrong };

// got / gw: the layer's K ids and weights; want / ww: the reference's; c: the reference's
// selection scores [E] (what top-k ranks: the score plus the correction bias).
inline RoutingVerdict judge_routing(const int32_t* got, const float* gw, const int32_t* want, const float* ww,
                                    const float* c, int K, int E) {
  const auto near = [](float a, float b) { return std::fabs(a - b) <= 1e-5f * std::max(1.0f, std::fabs(b)); };
  float m_want = INFINITY, m_got = INFINITY;
  for (int k = 0; k < K; ++k) {
    m_want = std::min(m_want, c[want[k]]);
    if (got[k] >= 0 && got[k] < E) m_got = std::min(m_got, c[got[k]]);
  }
  bool tie = false;
  for (int k = 0; k < K; ++k) {  // each expert the reference did not pick scores as its last pick
    if (std::find(want, want + K, got[k]) != want + K) continue;
    if (got[k] < 0 || got[k] >= E || !near(c[got[k]], m_want)) return RoutingVerdict::kWrong;
    tie = true;
  }
  if (tie) {  // ... and each expert it picked that the layer did not scores as the layer's last
    for (int k = 0; k < K; ++k)
      if (std::find(got, got + K, want[k]) == got + K && !near(c[want[k]], m_got))
        return RoutingVerdict::kWrong;
    // (no weights compared: normalized, they all move with the swapped expert's score; the
    // output is compared with the reference on the layer's own routing)
    return RoutingVerdict::kTie;
  }
  for (int k = 0; k < K; ++k)
    if (!near(gw[k], ww[std::find(want, want + K, got[k]) - want])) return RoutingVerdict::kWrong;
  return RoutingVerdict::kSame;
}

}  // namespace megamoe::soak
