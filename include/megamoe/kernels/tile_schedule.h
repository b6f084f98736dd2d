// The fused kernel's static tile schedule: which tiles CTA c of G processes, in
// which order. Plain C++ (host and device) so the CPU tests check it exactly.
//
// GEMM1 tiles [0, t1) go round-robin (CTA c: c, c + G, ...). The CTAs left with
// one GEMM1 tile fewer (c >= t1 % G) then take `extra` GEMM2 tiles each,
// round-robin among themselves, where extra = the cost of a GEMM1 tile in GEMM2
// tiles (weight stages, rounded); the other GEMM2 tiles [t1, t1 + t2) go
// round-robin over all CTAs. So every CTA streams about the same number of
// weight bytes: at T = 1 on GLM-5 (288 GEMM1 tiles of 48 stages, 432 GEMM2
// tiles of 16, 132 CTAs) at most 2.62 MB a CTA against a 2.57 MB mean, where
// plain round-robin put 3.15 MB on 24 of them.
// The last `pool` GEMM2 tiles are no CTA's: a CTA whose list is done claims them
// one at a time from a counter in the order of their ids (pool_begin() + k for
// the k-th claim), so the CTAs that streamed faster take more of the tail and the
// grid finishes together (a static tail left CTAs idle 2-7 % of a decode layer
// waiting for the slowest; docs/performance-history.md, "Schedule and placement").
// NOTE: deadlock-free: each CTA takes its tiles in increasing order and every
// GEMM1 tile precedes every GEMM2 tile (the pool holds GEMM2 tiles only, claimed
// after a CTA's own list), so a GEMM2 tile only waits for GEMM1 tiles that
// running CTAs take before any GEMM2 tile, and GEMM1 tiles never wait.
#pragma once

#include <algorithm>
#include <cstdint>

#include "megamoe/numerics/fp8.h"  // MEGAMOE_HD

namespace megamoe::kernels {

struct TileSchedule {
  int c, G, t1, t2, r1, light, extra, p1, j2, phase, m;

  // cost1, cost2: weight stages of a GEMM1 and of a (routed) GEMM2 tile;
  // balanced = false: plain round-robin over all tiles (for comparison);
  // pool: GEMM2 tiles at the end left to claims (at most tiles2).
  MEGAMOE_HD void init(int cta, int grid, int tiles1, int tiles2, int cost1, int cost2, bool balanced = true,
                       int pool = 0) {
    c = cta, G = grid, t1 = tiles1, t2 = tiles2 - pool;
    r1 = t1 % G;
    light = r1 ? G - r1 : 0;
    extra = r1 && balanced ? (cost1 + cost2 / 2) / cost2 : 0;
    p1 = extra * light < t2 ? extra * light : t2;
    // Phase 2 starts at GEMM2 tile j2: round-robin after phase 1, or (not balanced) where
    // one round-robin over all t1 + t2 tiles reaches GEMM2 for this CTA.
    j2 = balanced ? p1 + c : (c - r1 + G) % G;
    phase = 0, m = 0;
  }

  // The first tile of the pool (= the end of the tiles when the pool is empty).
  MEGAMOE_HD int pool_begin() const { return t1 + t2; }

  // The next tile id of this CTA's own list; pool_begin() once there is none.
  MEGAMOE_HD int next() {
    if (phase == 0) {
      const int t = c + m * G;
      if (t < t1) return ++m, t;
      phase = 1, m = 0;
    }
    if (phase == 1) {
      const int j = (c - r1) + m * light;
      if (c >= r1 && m < extra && j < p1) return ++m, t1 + j;
      phase = 2, m = 0;
    }
    const int j = j2 + m * G;
    ++m;
    return j < t2 ? t1 + j : t1 + t2;
  }
};

// The largest e in [lo, hi] with mul * off[e] <= v (off non-decreasing, mul * off[lo] <= v).
MEGAMOE_HD int largest_le(const int* off, int lo, int hi, int mul, int v) {
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (mul * off[mid] <= v)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Where a tile id sits (plain C++ as well, so the CPU tests check the decode exactly).
// Tile ids run GEMM1 then GEMM2, expert by expert (the shared expert, E, last); inside
// an expert by chunks of `chunk` token blocks (the last one shorter), output block major
// inside a chunk (the token blocks of one weight tile are neighbours, so concurrently
// running CTAs share it in L2, and a chunk's tokens stay there). Pair tiles (sh1 = sh2 = 1):
// an id names two tiles, one a cluster rank, and every count below counts pairs; wide tiles
// (sh2 = 1 only) count GEMM2's output blocks in pairs, both in one CTA. Either the
// pair shares its token block (output blocks 2j, 2j + 1; rank `rank` takes 2j + rank), or,
// with pair_weights, it shares its weight tile: token blocks 2p, 2p + 1 of a chunk against one
// output block, and only a chunk's odd last token block shares its tokens. In a chunk of
// c token blocks the n / 2 output-block pairs jj take c ids each, in this order: the
// c / 2 weight pairs of output block 2jj, those of 2jj + 1, then (c odd) the last token
// block against 2jj and 2jj + 1; so the ids a weight tile serves stay neighbours.
struct TileCoord {
  int gemm;           // 1 or 2
  int e;              // expert (E: the shared one)
  int nblk;           // output block: GEMM1 128 columns of the intermediate (one num::kInterGroup), GEMM2
                      // 128 rows of H
  int block;          // token block inside the expert
  bool pair_weights;  // pair tiles: the pair shares this tile's weights (else its tokens)
};

struct TileIds {
  int n1, n1s, n2;    // output blocks of a routed expert's GEMM1, the shared one's (>> sh1), a GEMM2 (>> sh2)
  int E, E_total;     // routed experts; + 1 with a shared expert
  int t1_routed, t1;  // the first shared GEMM1 id and the first GEMM2 id
  int t2;             // GEMM2 ids
  int chunk;          // token blocks a chunk
  int sh1, sh2;       // 1: a GEMM1 / GEMM2 id names a pair of output blocks (pair tiles: both)
  const int* unit_off;  // [E_total + 1] token blocks before expert e
  int pair_weights;     // pair tiles: pairs of token blocks share a weight tile (above)

  // The ids of one forward, from the experts' token blocks (unit_off) and the output
  // blocks of a routed GEMM1 (I / 128), the shared one's (Is / 128) and a GEMM2 (H / 128);
  // a count shifted by sh1 / sh2 = 1 is even (the plan's condition for pair and wide tiles).
  // pair_weights needs sh1 = sh2 = 1.
  MEGAMOE_HD static TileIds count(int n1, int n1s, int n2, int E, int E_total, int chunk, int sh1, int sh2,
                                  const int* unit_off, int pair_weights = 0) {
    const int t1_routed = n1 * unit_off[E];
    const int t1 = t1_routed + n1s * (unit_off[E_total] - unit_off[E]);
    return {n1 >> sh1,
            n1s >> sh1,
            n2 >> sh2,
            E,
            E_total,
            t1_routed >> sh1,
            t1 >> sh1,
            (n2 * unit_off[E_total]) >> sh2,
            chunk,
            sh1,
            sh2,
            unit_off,
            sh1 && sh2 ? pair_weights : 0};
  }
  MEGAMOE_HD int tiles() const { return t1 + t2; }

  MEGAMOE_HD TileCoord decode(int tile, int rank) const {
    TileCoord t;
    int local;
    if (tile < t1) {
      t.gemm = 1;
      if (tile < t1_routed) {
        t.e = largest_le(unit_off, 0, E - 1, n1, tile);
        local = tile - n1 * unit_off[t.e];
      } else {
        t.e = E;
        local = tile - t1_routed;
      }
    } else {
      t.gemm = 2;
      const int tile2 = tile - t1;
      t.e = largest_le(unit_off, 0, E_total - 1, n2, tile2);
      local = tile2 - n2 * unit_off[t.e];
    }
    const int nb = unit_off[t.e + 1] - unit_off[t.e];
    const int n = t.gemm == 1 ? (t.e < E ? n1 : n1s) : n2;  // this expert's output blocks
    const int per_chunk = chunk * n;
    const int q = local / per_chunk, b0 = q * chunk;
    const int csize = (nb - b0 < chunk ? nb - b0 : chunk), in_chunk = local - q * per_chunk;
    const int j = in_chunk / csize;  // the output block (pair tiles: the pair)
    const int v = in_chunk - j * csize;
    const int weight_pairs = pair_weights ? csize >> 1 : 0;  // weight pairs of each output block
    t.pair_weights = v < 2 * weight_pairs;
    if (t.pair_weights) {
      const int second = v >= weight_pairs ? 1 : 0;
      t.nblk = 2 * j + second;
      t.block = b0 + 2 * (v - second * weight_pairs) + rank;
    } else {
      t.block = b0 + (weight_pairs ? csize - 1 : v);
      const int sh = t.gemm == 1 ? sh1 : sh2;
      t.nblk = (j << sh) + (rank & sh);  // (an id of one tile: every rank's)
    }
    return t;
  }
};

// The schedule unit of each SM (KernelArgs::sm_unit, fused_moe.cu's probe_sm_units): given
// the SM a plain launch of `grid` CTAs, one an SM, put blockIdx b on (sm[b]), table[sm[b]] = b,
// the SM's place in the order the launch filled them, so a CTA takes the unit of the SM it
// landed on; every other entry `none`. It holds only where every CTA sat on its own SM below
// `slots` and blockIdx 2k, 2k + 1 on the two SMs of one TPC (ids 2j, 2j + 1: the placement the
// schedule's neighbouring units are laid out for). Returns -1, or the first blockIdx
// that breaks it (or grid itself for a grid the table cannot hold) with table all `none`.
// A grid the table can hold: TPC pairs of CTAs, every unit below `none`.
inline bool sm_unit_grid_ok(int grid, uint8_t none) { return grid > 0 && grid < int(none) && grid % 2 == 0; }
inline int sm_unit_table(const uint32_t* sm, int grid, uint8_t* table, int slots, uint8_t none) {
  std::fill(table, table + slots, none);
  if (!sm_unit_grid_ok(grid, none)) return grid;
  for (int b = 0; b < grid; ++b) {
    const bool own = sm[b] < uint32_t(slots) && table[sm[b]] == none;
    if (!own || (b % 2 && sm[b] / 2 != sm[b - 1] / 2)) {
      std::fill(table, table + slots, none);
      return b;
    }
    table[sm[b]] = uint8_t(b);
  }
  return -1;
}

}  // namespace megamoe::kernels
