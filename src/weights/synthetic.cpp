// Synthetic block-FP8 weights (make_random_weights): statistically like a real
// checkpoint, generated fast enough for a full GLM-5 layer set (~10 GB) in
// seconds.
//
// - E4M3 codes: 16 random bits index a 65536-entry table holding the inverse
//   CDF of N(0, kCodeSigma) rounded to E4M3, so codes are a quantized normal
//   whose block amax (16384 draws per 128x128 block) sits near 448.
// - Scales: one float32 per 128x128 block, log-normal around
//   1 / (kCodeSigma * sqrt(fan_in)), so dequantized weights have a standard
//   deviation near 1/sqrt(fan_in) and activations keep O(1) magnitude.
// - Router: N(0, 1/sqrt(H)) so logits are O(1) for O(1) inputs; bias small.
// Determinism: every fixed-size chunk of every region draws from its own
// generator seeded by (seed, region, chunk); threads only pick chunks.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "megamoe/numerics/fp8.h"
#include "megamoe/weights/host_weights.h"

namespace megamoe {
namespace {

constexpr double kCodeSigma = 100.0;        // std of the code values; 4.4 sigma ~ 448
constexpr double kScaleLogSigma = 0.25;     // spread of the block scales (natural log)
constexpr size_t kChunk = size_t(1) << 20;  // bytes of codes per generator

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t stream_seed(uint64_t seed, uint64_t region, uint64_t chunk) {
  uint64_t s = seed ^ (region * 0xD1B54A32D192ED03ull);
  s = splitmix64(s) ^ (chunk * 0x8CB92BA72F3D8DD7ull);
  return splitmix64(s);
}

struct Rng {
  uint64_t state;
  uint64_t next() { return splitmix64(state); }
  double uniform() { return (double(next() >> 11) + 0.5) * 0x1p-53; }  // (0, 1)
  double normal() {
    // Box-Muller; one value per call keeps the stream simple.
    const double u1 = uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

// 16 bits -> E4M3 code with P(code) = the N(0, sigma) mass of the values that
// round to it. Built from the CDF at the midpoints between adjacent codes.
std::vector<uint8_t> code_table(double sigma) {
  // All finite E4M3 values but -0, in increasing order.
  std::vector<std::pair<float, uint8_t>> vals;
  for (int b = 0; b < 256; ++b) {
    const float v = num::e4m3_decode(uint8_t(b));
    if (std::isnan(v) || b == 0x80) continue;
    vals.push_back({v, uint8_t(b)});
  }
  std::sort(vals.begin(), vals.end());
  std::vector<uint8_t> table(65536);
  size_t k = 0;
  for (int i = 0; i < 65536; ++i) {
    const double p = (i + 0.5) / 65536.0;
    // Advance to the code whose interval [mid(k-1,k), mid(k,k+1)) holds p.
    while (k + 1 < vals.size()) {
      const double mid = 0.5 * (double(vals[k].first) + double(vals[k + 1].first));
      if (0.5 * std::erfc(-mid / (sigma * std::sqrt(2.0))) > p) break;
      ++k;
    }
    table[i] = vals[k].second;
  }
  return table;
}

float block_scale(Rng& rng, int fan_in, bool pow2) {
  const double base = 1.0 / (kCodeSigma * std::sqrt(double(fan_in)));
  const double v = base * std::exp(kScaleLogSigma * rng.normal());
  if (pow2) return float(std::exp2(std::round(std::log2(v))));
  return float(v);
}

template <class F>
void parallel_chunks(size_t n, F&& f) {
  const unsigned hc = std::max(1u, std::thread::hardware_concurrency());
  const unsigned threads = unsigned(std::min<size_t>(hc, n));
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) f(i);
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

void fill_codes(uint8_t* dst, size_t bytes, uint64_t seed, uint64_t region,
                const std::vector<uint8_t>& table) {
  const size_t chunks = (bytes + kChunk - 1) / kChunk;
  parallel_chunks(chunks, [&](size_t c) {
    Rng rng{stream_seed(seed, region, c)};
    uint8_t* p = dst + c * kChunk;
    const size_t n = std::min(kChunk, bytes - c * kChunk);
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
      const uint64_t r = rng.next();
      p[i] = table[r & 0xFFFF];
      p[i + 1] = table[(r >> 16) & 0xFFFF];
      p[i + 2] = table[(r >> 32) & 0xFFFF];
      p[i + 3] = table[r >> 48];
    }
    for (; i < n; ++i) p[i] = table[rng.next() & 0xFFFF];
  });
}

void fill_scales(float* dst, size_t count, int fan_in, uint64_t seed, uint64_t region, bool pow2) {
  Rng rng{stream_seed(seed, region, 0)};
  for (size_t i = 0; i < count; ++i) dst[i] = block_scale(rng, fan_in, pow2);
}

}  // namespace

HostMoeWeights make_random_weights(const MoeShape& s, uint64_t seed, bool pow2_scales) {
  HostMoeWeights w(s);
  const MoeWeightLayout& l = w.layout;
  // Zero the alignment gaps between regions so the whole buffer is defined.
  {
    std::vector<Region> regions{
        l.w13,       l.w13_scale,       l.w2,     l.w2_scale, l.shared_w13, l.shared_w13_scale,
        l.shared_w2, l.shared_w2_scale, l.router, l.bias};
    std::sort(regions.begin(), regions.end(),
              [](const Region& a, const Region& b) { return a.offset < b.offset; });
    size_t cursor = 0;
    for (const Region& r : regions) {
      if (r.bytes == 0) continue;
      if (r.offset > cursor) std::memset(w.data() + cursor, 0, r.offset - cursor);
      cursor = std::max(cursor, r.offset + r.bytes);
    }
    if (l.total_bytes > cursor) std::memset(w.data() + cursor, 0, l.total_bytes - cursor);
  }

  const std::vector<uint8_t> table = code_table(kCodeSigma);
  enum : uint64_t { kW13 = 1, kW13S, kW2, kW2S, kSW13, kSW13S, kSW2, kSW2S, kRouter, kBias };
  fill_codes(w.region(l.w13), l.w13.bytes, seed, kW13, table);
  fill_codes(w.region(l.w2), l.w2.bytes, seed, kW2, table);
  fill_scales(reinterpret_cast<float*>(w.region(l.w13_scale)), l.w13_scale.bytes / 4, s.hidden, seed, kW13S,
              pow2_scales);
  fill_scales(reinterpret_cast<float*>(w.region(l.w2_scale)), l.w2_scale.bytes / 4, s.inter, seed, kW2S,
              pow2_scales);
  if (s.has_shared()) {
    fill_codes(w.region(l.shared_w13), l.shared_w13.bytes, seed, kSW13, table);
    fill_codes(w.region(l.shared_w2), l.shared_w2.bytes, seed, kSW2, table);
    fill_scales(reinterpret_cast<float*>(w.region(l.shared_w13_scale)), l.shared_w13_scale.bytes / 4,
                s.hidden, seed, kSW13S, pow2_scales);
    fill_scales(reinterpret_cast<float*>(w.region(l.shared_w2_scale)), l.shared_w2_scale.bytes / 4,
                s.shared_inter(), seed, kSW2S, pow2_scales);
  }
  {
    Rng rng{stream_seed(seed, kRouter, 0)};
    const size_t n = size_t(s.experts) * s.hidden;
    const double sd = 1.0 / std::sqrt(double(s.hidden));
    if (s.router_dtype == RouterDtype::kBF16) {
      auto* r = reinterpret_cast<num::bf16_t*>(w.region(l.router));
      for (size_t i = 0; i < n; ++i) r[i] = num::bf16_encode(float(sd * rng.normal()));
    } else {
      auto* r = reinterpret_cast<float*>(w.region(l.router));
      for (size_t i = 0; i < n; ++i) r[i] = float(sd * rng.normal());
    }
  }
  if (l.bias.bytes) {
    Rng rng{stream_seed(seed, kBias, 0)};
    auto* b = reinterpret_cast<float*>(w.region(l.bias));
    for (int e = 0; e < s.experts; ++e) b[e] = float(0.01 * rng.normal());
  }
  return w;
}

std::vector<num::bf16_t> make_random_tokens(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<num::bf16_t> x(n);
  for (auto& v : x) v = num::bf16_encode(nd(rng));
  return x;
}

}  // namespace megamoe
