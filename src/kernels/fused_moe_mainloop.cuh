// fused_moe's device side, part 3 (included by fused_moe.cu only): the consumers' K
// loops over the stage ring (tokens as wgmma N in decode tiles, as M in 128-token tiles,
// two output blocks a stage in wide tiles) and the fold of each 128-deep wgmma chain.
#pragma once

#include "fused_moe_device.cuh"

namespace megamoe::kernels {
namespace {  // (this header belongs to fused_moe.cu, its one includer)

// ---------------------------------------------------------------------------
// K loops of a consumer warpgroup. A chain of four wgmma (128 deep, one stage of
// one block: num::kGemm1FoldK = num::kInterGroup) into a register buffer
// (scale_d = 0 first) is folded into the float32 accumulator as
// acc += part * (scale_x * scale_w), once a K block and output block in both GEMMs.
// NOTE: the products scale_x * scale_w are formed exactly as ref::moe_layer
// forms them, and each fragment element sees the same sequence of folds in every
// layout below, so the bytes do not depend on which layout (or block_n) ran.
// NOTE: ptxas (nvcc 13.0) serializes the wgmma chains (C7514) when a group stays in
// flight across a loop back-edge, so the next stage cannot be queued before this
// stage's fold inside a one-stage loop; and (C7518) when a wgmma sits on a path
// it cannot prove uniform. Check the build log for both after changing these loops.
// The decode loop therefore takes two stages an iteration. A stage handed back
// (release_stage: one lane's arrive) while a group is in flight made ptxas give the
// next chain a third register buffer and spill the accumulator, so both stages of an
// iteration are released after its last wait. The prefill loop keeps one K block an
// iteration: two (same structure, 6 stages in the ring) measured slower at
// T = 16384 (see docs/performance-history.md).
// ---------------------------------------------------------------------------

// A chain of kSteps wgmma k-steps into buf, from zero, starting at k-step k0 of a stage:
// da / db are the low descriptor words of the stage's A and B tiles (a k-step is 32 bytes
// further along the 128-byte rows: 2 in the >> 4 units).
template <int N, int kSteps>
__device__ __forceinline__ void issue_chain(float (&buf)[N / 2], uint32_t da, uint32_t db, int k0) {
  sm90::wgmma_fence();
#pragma unroll
  for (int k = 0; k < kSteps; ++k)
    sm90::Wgmma<N>::mma(buf, sm90::smem_desc_sw128_at(da + 2 * (k0 + k)),
                        sm90::smem_desc_sw128_at(db + 2 * (k0 + k)), k);
  sm90::wgmma_commit();
}

// The M accumulators of part h of an accumulator array (a GEMM1 tile's 64-column halves).
template <int M, int h, int N>
__device__ __forceinline__ float (&acc_part(float (&acc)[N]))[M] {
  static_assert(M * (h + 1) <= N, "accumulator part");
  return *reinterpret_cast<float(*)[M]>(acc + M * h);
}
// Block h's 64 accumulators of a tokens-in-M tile's array (two blocks: a GEMM1 tile's
// halves, or a wide GEMM2 tile's output blocks).
template <int h, int N>
__device__ __forceinline__ float (&acc_block(float (&acc)[N]))[64] {
  return acc_part<64, h>(acc);
}

// Swap AB (decode, BN <= 64 tokens): A = 64 weight rows of the warpgroup, B = the
// BN tokens. Fragment rows lrow / lrow + 8 (gate / up in GEMM1), columns = tokens.
// Two K blocks an iteration, one stage each, into acc[0 .. BN / 2) with scale_x per token
// and K block (GEMM2: one act2 group) times scale_w: GEMM1 gate (lo) / up (hi) of the
// tile's 128-row scale blocks, GEMM2 one. A GEMM1 tile (kHalves) then runs its half 1 into
// acc[BN / 2 ..] from the next stages (the producer's order: half 0's K blocks, then half
// 1's, so a weight row's 128-byte pieces stream in order: the halves a K block in turn
// measured slower at 8-256 tokens, see docs/performance-history.md); without
// kHalves (decode pairs) the CTA's one half.
template <int BN, int kGemm, bool kHalves = true>
__device__ __forceinline__ void mainloop_swap_ab(float (&acc)[BN], int kblocks, RingPos<stages_for(BN)>& rp,
                                                 uint8_t* smem, uint64_t* full_bar, uint64_t* empty_bar,
                                                 int wg, int lcol, const float* lo_scale,
                                                 const float* hi_scale, int skip, Prof& pf) {
  constexpr int kStages = stages_for(BN);
  constexpr int kStageBytes = stage_bytes(BN);
  constexpr int kWBytes = kBlockM * kBlockK;
  constexpr int kXBytes = BN * kBlockK;
  float ba[BN / 2], bb[BN / 2];
  // Scale products per column pair j: (c0, c1) x (lo, hi) (GEMM2: lo == hi).
  float pa[BN / 8][4];
  const uint32_t t_loop = pf.now();
  // Descriptors of stage 0's tiles; a stage and a K step add their offset >> 4.
  const uint32_t dw0 = sm90::smem_desc_sw128_lo(smem + wg * 64 * 128);
  const uint32_t dx0 = sm90::smem_desc_sw128_lo(smem + kWBytes);
  auto fold = [&](float(&dst)[BN / 2], const float(&buf)[BN / 2]) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) dst[j * 4 + q] = fmaf(buf[j * 4 + q], pa[j][q], dst[j * 4 + q]);
  };
  auto products = [&](const uint8_t* st, float lo, float hi) {
    const float* s_s = reinterpret_cast<const float*>(st + kWBytes + kXBytes);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const float c0 = s_s[j * 8 + lcol], c1 = s_s[j * 8 + lcol + 1];
      pa[j][0] = c0 * lo, pa[j][1] = c1 * lo;
      pa[j][2] = kGemm == 1 ? c0 * hi : pa[j][0];
      pa[j][3] = kGemm == 1 ? c1 * hi : pa[j][1];
    }
  };
  auto wait_full = [&](const RingPos<kStages>& r) {
    const uint32_t t0 = pf.now();
    sm90::mbar_wait(&full_bar[r.stage], r.phase);
    pf.add(kPfFullWait, t0);
  };
  auto stage_ptr = [&](const RingPos<kStages>& r) { return smem + r.stage * kStageBytes; };
  auto stage_off = [&](const RingPos<kStages>& r) { return uint32_t(r.stage) * (kStageBytes >> 4); };
  // Until at most one group (or none) is in flight; the profile counts the wait.
  auto mma_wait_one = [&] {
    const uint32_t t0 = pf.now();
    sm90::wgmma_wait<1>();
    pf.add(kPfMmaWait, t0);
  };
  auto mma_wait_all = [&] {
    const uint32_t t0 = pf.now();
    sm90::wgmma_wait<0>();
    pf.add(kPfMmaWait, t0);
  };
  // A stage's chain of four wgmma (128 deep), folded once.
  auto issue_full = [&](float(&buf)[BN / 2], const RingPos<kStages>& r) {
    const uint32_t t0 = pf.now();
    issue_chain<BN, kBlockK / num::kMmaStepK>(buf, dw0 + stage_off(r), dx0 + stage_off(r), 0);
    pf.add(kPfIssue, t0);
  };
  float(&acc0)[BN / 2] = acc_part<BN / 2, 0>(acc);
  if (skip & kSkipMma) {
    for (int s = 0; s < (kGemm == 1 && kHalves ? 2 : 1) * kblocks; ++s, rp.advance()) {
      wait_full(rp);
      release_stage(&empty_bar[rp.stage]);
    }
    pf.add(kPfLoop, t_loop);
    return;
  }
  // NOTE: ncu shows the weight-scale loads as the decode tiles' largest stall, but the
  // wait overlaps the weight stream: holding the tile's scale rows in registers measured
  // slower at 256 and 16384 tokens (see docs/performance-history.md).
  // Two stages an iteration: the second's chain is queued while the first's is
  // folded, so the warpgroup's tensor work drains once per two stages, not per stage.
  // Both stages are waited for before the first issue: no wgmma is in flight across the
  // mbarrier's retry loop (see the NOTE above the K loops).
  // K blocks kb (in `ba`) and kb + 1 (in `bb`) into one accumulator half.
  // The weight scales of an iteration's two K blocks are loaded an iteration ahead (kb past
  // the row's end reads its last entry, unused): loaded at the iteration's top, their L2
  // latency stood between the issue and the fold whenever both stages were already full.
  auto scale_at = [&](const float* row, int k) { return __ldg(row + min(k, kblocks - 1)); };
  auto run = [&](float(&dst)[BN / 2]) {
    int kb = 0;
    float lo0 = scale_at(lo_scale, 0), lo1 = scale_at(lo_scale, 1);
    float hi0 = kGemm == 1 ? scale_at(hi_scale, 0) : lo0, hi1 = kGemm == 1 ? scale_at(hi_scale, 1) : lo1;
    for (; kb + 2 <= kblocks; kb += 2) {
      const float nlo0 = scale_at(lo_scale, kb + 2), nlo1 = scale_at(lo_scale, kb + 3);
      const float nhi0 = kGemm == 1 ? scale_at(hi_scale, kb + 2) : nlo0;
      const float nhi1 = kGemm == 1 ? scale_at(hi_scale, kb + 3) : nlo1;
      RingPos<kStages> r1 = rp;
      r1.advance();
      wait_full(rp);
      wait_full(r1);
      issue_full(ba, rp);
      issue_full(bb, r1);
      products(stage_ptr(rp), lo0, hi0);
      mma_wait_one();  // K block kb done
      fold(dst, ba);
      products(stage_ptr(r1), lo1, hi1);
      mma_wait_all();
      release_stage(&empty_bar[rp.stage]);
      release_stage(&empty_bar[r1.stage]);
      fold(dst, bb);
      rp = r1;
      rp.advance();
      pf.count(kPfStages);
      pf.count(kPfStages);
      lo0 = nlo0, lo1 = nlo1, hi0 = nhi0, hi1 = nhi1;
    }
    if (kb < kblocks) {  // an odd last K block
      const float lo = lo0, hi = hi0;
      wait_full(rp);
      issue_full(ba, rp);
      products(stage_ptr(rp), lo, hi);
      mma_wait_all();
      release_stage(&empty_bar[rp.stage]);
      fold(dst, ba);
      rp.advance();
      pf.count(kPfStages);
    }
  };
  run(acc0);
  if constexpr (kGemm == 1 && kHalves) run(acc_part<BN / 2, 1>(acc));  // half 1's stages
  pf.add(kPfLoop, t_loop);
}

// Tokens in M (prefill, BN = 128 tokens): A = the warpgroup's 64 token rows, B =
// the 128 weight rows of an output block (GEMM1: a tile's half). Fragment rows = tokens
// lrow / lrow + 8, columns = weight rows 8j + lcol (+1): in GEMM1 j even = gate, j odd =
// its up partner (the 8-row interleave). Only four scale products per thread and K
// block (two tokens x gate / up), so the fold is one FFMA per accumulator.
// The tokens-in-M fold: acc += buf * product; fragment columns 8j..: j even = gate (pg),
// j odd = up (pu); rows r0 (pg0, pu0) / r1 (pg1, pu1).
__device__ __forceinline__ void fold_tokens_m(float (&acc)[64], const float (&buf)[64], float pg0, float pu0,
                                              float pg1, float pu1) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float q0 = (j % 2 == 0) ? pg0 : pu0, q1 = (j % 2 == 0) ? pg1 : pu1;
    acc[j * 4 + 0] = fmaf(buf[j * 4 + 0], q0, acc[j * 4 + 0]);
    acc[j * 4 + 1] = fmaf(buf[j * 4 + 1], q0, acc[j * 4 + 1]);
    acc[j * 4 + 2] = fmaf(buf[j * 4 + 2], q1, acc[j * 4 + 2]);
    acc[j * 4 + 3] = fmaf(buf[j * 4 + 3], q1, acc[j * 4 + 3]);
  }
}

// A tokens-in-M stage handed back; a pair tile's goes back to both CTAs (release_stage_pair).
template <bool kClusterPairs>
__device__ __forceinline__ void release_ring_stage(uint64_t* empty_bar, int stage, uint32_t peer_empty) {
  if constexpr (kClusterPairs)
    release_stage_pair(&empty_bar[stage], peer_empty + stage * 8);
  else
    release_stage(&empty_bar[stage]);
}

// `stages` stages handed back unread (kSkipMma: a half tile's idle warpgroup).
template <bool kClusterPairs, int kStages>
__device__ __forceinline__ void skip_stages(int stages, RingPos<kStages>& rp, uint64_t* full_bar,
                                            uint64_t* empty_bar, uint32_t peer_empty) {
  for (int s = 0; s < stages; ++s, rp.advance()) {
    sm90::mbar_wait(&full_bar[rp.stage], rp.phase);
    release_ring_stage<kClusterPairs>(empty_bar, rp.stage, peer_empty);
  }
}

// One output block a stage: a GEMM2 tile of a one-block ring (pair tiles release each
// stage to both CTAs), or (kWide) one block `wblk` of a wide tile's stage on token rows
// xrow0 = 0 in each warpgroup (a split wide tile of at most 64 rows: GEMM1 half wblk or
// GEMM2 output block wblk). Otherwise xrow0 = 64 wg, wblk = 0: the warpgroup's own 64 token
// rows of the one block.
template <int kGemm, bool kClusterPairs, bool kWide = false>
__device__ __forceinline__ void mainloop_tokens_m(float (&acc)[64], int kblocks,
                                                  RingPos<stages_for(128, kWide)>& rp, uint8_t* smem,
                                                  uint64_t* full_bar, uint64_t* empty_bar,
                                                  uint32_t peer_empty, int xrow0, int wblk, int lrow,
                                                  const float* gate_scale, const float* up_scale, int skip,
                                                  Prof& pf) {
  constexpr int kStageBytes = stage_bytes(128, kWide);
  constexpr int kWBytes = (kWide ? 2 : 1) * kBlockM * kBlockK;
  constexpr int kXBytes = 128 * kBlockK;
  auto release = [&](int stage) { release_ring_stage<kClusterPairs>(empty_bar, stage, peer_empty); };
  if (skip & kSkipMma) return skip_stages<kClusterPairs>(kblocks, rp, full_bar, empty_bar, peer_empty);
  const uint32_t t_loop = pf.now();
  const int r0 = xrow0 + lrow, r1 = r0 + 8;
  float ba[64];
  // Descriptors of stage 0's tiles; a stage and a K step add their offset >> 4.
  const uint32_t dx0 = sm90::smem_desc_sw128_lo(smem + kWBytes + xrow0 * 128);
  const uint32_t dw0 = sm90::smem_desc_sw128_lo(smem + wblk * (kBlockM * kBlockK));
  auto issue_stage = [&](uint32_t so) {
    issue_chain<128, kBlockK / num::kMmaStepK>(ba, dx0 + so, dw0 + so, 0);
  };
  if (skip & kSkipFold) {  // measurement: the loop's wgmma and stage handling, no fold
    for (int kb = 0; kb < kblocks; ++kb, rp.advance()) {
      sm90::mbar_wait(&full_bar[rp.stage], rp.phase);
      issue_stage(uint32_t(rp.stage) * (kStageBytes >> 4));
      sm90::wgmma_wait<0>();
      release(rp.stage);
    }
    return;
  }
  // (Nothing is in flight at the back-edge: see the NOTE above the K loops.)
  // NOTE: the weight scales' loads stay in the stage, here and in mainloop_tokens_m_blocks.
  // ncu puts some of the wide kernel's stall samples on the products' wait for them, but
  // the stage's first chain runs meanwhile: loaded a stage ahead into registers (the copy
  // at the back-edge then waited, with no chain in flight) or carried in the stage by the
  // producer's cp.async (its refill slower, the consumers' data waits up), the layer
  // measured slower. Written before the stage's wait, they are issued (ptxas keeps them
  // after the wait) ahead of the first chain instead of behind it (see docs/performance-history.md).
  for (int kb = 0; kb < kblocks; ++kb, rp.advance()) {
    // (before the stage's wait in the source, ahead of the chain in the SASS: see the NOTE)
    const float sg = __ldg(gate_scale + kb), su = kGemm == 1 ? __ldg(up_scale + kb) : sg;
    uint32_t t0 = pf.now();
    sm90::mbar_wait(&full_bar[rp.stage], rp.phase);
    pf.add(kPfFullWait, t0);
    const float* s_s = reinterpret_cast<const float*>(smem + rp.stage * kStageBytes + kWBytes + kXBytes);
    t0 = pf.now();
    issue_stage(uint32_t(rp.stage) * (kStageBytes >> 4));
    pf.add(kPfIssue, t0);
    const float x0 = s_s[r0], x1 = s_s[r1];
    const float pg0 = x0 * sg, pu0 = kGemm == 1 ? x0 * su : pg0;
    const float pg1 = x1 * sg, pu1 = kGemm == 1 ? x1 * su : pg1;
    t0 = pf.now();
    sm90::wgmma_wait<0>();
    pf.add(kPfMmaWait, t0);
    release(rp.stage);
    fold_tokens_m(acc, ba, pg0, pu0, pg1, pu1);
    pf.count(kPfStages);
  }
  pf.add(kPfLoop, t_loop);
}

// Two output blocks: acc[0..63] accumulates block 0 and acc[64..127] block 1, each in
// mainloop_tokens_m's fragment layout, on the warpgroup's token rows from xrow0. kWide: a
// stage holds both blocks' weight rows (block 1's at 16 KB) and the token rows once (a
// GEMM1 tile's halves, or a wide GEMM2 tile's output blocks nblk and nblk + 1, block 1's
// weight scales at scale1). Otherwise (GEMM1 on one-block stages) K block kb's half h is
// stage 2 kb + h (the producer's order), both with the same token rows and scales. A
// warpgroup runs block 0's chain, folds it, then block 1's, through the one buffer `ba`
// (acc and buffer are 192 registers; a second buffer would not fit), so its tensor work
// drains between the chains and the other warpgroup's chains fill the gap. The fold order
// of each accumulator is mainloop_tokens_m's, so the bytes do not depend on the tile
// shape. GEMM1's halves share their 128-row scale blocks, so one set of products serves
// both. (kSkipFold is not taken here: that branch moved ptxas's schedule of the wide loop;
// see docs/performance-history.md for the measurement build.)
template <int kGemm, bool kWide, bool kClusterPairs>
__device__ __forceinline__ void mainloop_tokens_m_blocks(float (&acc)[128], int kblocks,
                                                         RingPos<stages_for(128, kWide)>& rp, uint8_t* smem,
                                                         uint64_t* full_bar, uint64_t* empty_bar,
                                                         uint32_t peer_empty, int xrow0, int lrow,
                                                         const float* gate_scale, const float* up_scale,
                                                         const float* scale1, int skip, Prof& pf) {
  static_assert(kWide || kGemm == 1, "one-block stages hold two output blocks only as a GEMM1 tile's halves");
  constexpr int kStageBytes = stage_bytes(128, kWide);
  constexpr int kWBytes = (kWide ? 2 : 1) * kBlockM * kBlockK;
  constexpr int kXBytes = 128 * kBlockK;
  constexpr uint32_t kBlock1 = kWide ? (kBlockM * kBlockK) >> 4 : 0;  // block 1's weight rows in a stage
  auto release = [&](int stage) { release_ring_stage<kClusterPairs>(empty_bar, stage, peer_empty); };
  if (skip & kSkipMma)
    return skip_stages<kClusterPairs>((kWide ? 1 : 2) * kblocks, rp, full_bar, empty_bar, peer_empty);
  const uint32_t t_loop = pf.now();
  const int r0 = xrow0 + lrow, r1 = r0 + 8;
  float ba[64];
  const uint32_t dx0 = sm90::smem_desc_sw128_lo(smem + kWBytes + xrow0 * 128);
  const uint32_t dw0 = sm90::smem_desc_sw128_lo(smem);
  auto mma_wait = [&] {
    const uint32_t t0 = pf.now();
    sm90::wgmma_wait<0>();
    pf.add(kPfMmaWait, t0);
  };
  auto wait_full = [&] {
    const uint32_t t0 = pf.now();
    sm90::mbar_wait(&full_bar[rp.stage], rp.phase);
    pf.add(kPfFullWait, t0);
  };
  for (int kb = 0; kb < kblocks; ++kb, rp.advance()) {
    // (before the stage's wait in the source, ahead of the chain in the SASS: see the NOTE in
    // mainloop_tokens_m)
    const float sg = __ldg(gate_scale + kb);
    const float su = kGemm == 1 ? __ldg(up_scale + kb) : __ldg(scale1 + kb);  // GEMM2: block 1's
    wait_full();
    const float* s_s = reinterpret_cast<const float*>(smem + rp.stage * kStageBytes + kWBytes + kXBytes);
    uint32_t so = uint32_t(rp.stage) * (kStageBytes >> 4);
    issue_chain<128, kBlockK / num::kMmaStepK>(ba, dx0 + so, dw0 + so, 0);
    const float x0 = s_s[r0], x1 = s_s[r1];
    const float pg0 = x0 * sg, pg1 = x1 * sg, pu0 = x0 * su, pu1 = x1 * su;
    mma_wait();
    if constexpr (!kWide) release(rp.stage);  // (half 0's stage; block 1 comes from the next)
    if constexpr (kGemm == 1)
      fold_tokens_m(acc_block<0>(acc), ba, pg0, pu0, pg1, pu1);
    else
      fold_tokens_m(acc_block<0>(acc), ba, pg0, pg0, pg1, pg1);
    if constexpr (!kWide) {
      rp.advance();
      wait_full();
      so = uint32_t(rp.stage) * (kStageBytes >> 4);
      pf.count(kPfStages);
    }
    issue_chain<128, kBlockK / num::kMmaStepK>(ba, dx0 + so, dw0 + so + kBlock1, 0);
    mma_wait();
    release(rp.stage);
    if constexpr (kGemm == 1)
      fold_tokens_m(acc_block<1>(acc), ba, pg0, pu0, pg1, pu1);
    else
      fold_tokens_m(acc_block<1>(acc), ba, pu0, pu0, pu1, pu1);
    pf.count(kPfStages);
    if constexpr (kWide) pf.count(kPfStages);
  }
  pf.add(kPfLoop, t_loop);
}

}  // namespace
}  // namespace megamoe::kernels
