// Expert-parallel dispatch over R ranks (include/megamoe/kernels/ep_dispatch.h).
// One block a rank; the ranks of a launch are co-resident (they wait on each other).
#include <cuda_runtime.h>

#include <string>

#include "cuda_check.h"
#include "megamoe/kernels/ep_dispatch.h"
#include "sm90_ptx.cuh"

namespace megamoe::kernels {
namespace {

constexpr int kDispatchThreads = 256;
constexpr int kMaxExperts = 512;

struct Tables {
  transport::PeerTable t[transport::kMaxRanks];
};

template <typename T>
__device__ __forceinline__ T* region(uint8_t* base, const Region& r) {
  return reinterpret_cast<T*>(base + r.offset);
}

__global__ void __launch_bounds__(kDispatchThreads)
    ep_dispatch_kernel(const __grid_constant__ EpLayout l, const __grid_constant__ Tables tables,
                       const int* num_tokens, uint64_t epoch) {
  __shared__ int cnt[kMaxExperts], fill[kMaxExperts];
  __shared__ int seg[kMaxExperts];  // local expert segment starts
  const transport::PeerTable& pt = tables.t[blockIdx.x];
  const int r = pt.rank, R = l.ranks, El = l.local_experts, E = R * El, K = l.topk;
  const int tid = threadIdx.x;
  uint8_t* me = pt.base[r];
  const int T = num_tokens[blockIdx.x];
  const int32_t* ids = region<int32_t>(me, l.topk_ids);
  int32_t* send = region<int32_t>(me, l.send_list);

  // ---- 1. this rank's slots by global expert (so by owner, then local expert) ----
  for (int e = tid; e < E; e += kDispatchThreads) cnt[e] = 0;
  __syncthreads();
  for (int i = tid; i < T * K; i += kDispatchThreads) atomicAdd(&cnt[ids[i]], 1);
  __syncthreads();
  if (tid == 0) {
    int run = 0;
    for (int e = 0; e < E; ++e) fill[e] = run, run += cnt[e];
  }
  __syncthreads();
  // (order inside an expert depends on the atomics: no output byte does, see ep_layout.h)
  for (int i = tid; i < T * K; i += kDispatchThreads)
    send[atomicAdd(&fill[ids[i]], 1)] = EpLayout::pack_src(r, i / K, i % K);
  __syncthreads();
  // ---- 2. counts (and where each owner's part of send_list starts) to every owner ----
  for (int i = tid; i < R * (El + 1); i += kDispatchThreads) {
    const int q = i / (El + 1), j = i % (El + 1);
    int start = 0;
    if (j == El)
      for (int e = 0; e < q * El; ++e) start += cnt[e];
    region<int32_t>(pt.base[q], l.counts)[r * (El + 1) + j] = j < El ? cnt[q * El + j] : start;
  }
  __threadfence();
  __syncthreads();
  if (tid < R)
    sm90::st_release_gpu(region<uint64_t>(pt.base[tid], l.signals) + EpLayout::kCounts * R + r, epoch);
  // ---- 3. wait for every source's counts ----
  if (tid < R)
    sm90::wait_geq_acquire_gpu(region<uint64_t>(me, l.signals) + EpLayout::kCounts * R + tid, epoch);
  __syncthreads();
  const int32_t* counts = region<int32_t>(me, l.counts);  // [R][El + 1]
  for (int el = tid; el < El; el += kDispatchThreads) seg[el] = ep_segment_start(l, counts, el);
  __syncthreads();
  // ---- 4. pull: warp w takes (source, local expert) pairs; a lane copies 16 bytes ----
  const int warp = tid / 32, lane = tid % 32, H = l.hidden, hb = H / 128;
  uint8_t* recv_x = region<uint8_t>(me, l.recv_x);
  float* recv_scale = region<float>(me, l.recv_scale);
  float* recv_weight = region<float>(me, l.recv_weight);
  int32_t* recv_src = region<int32_t>(me, l.recv_src);
  for (int p = warp; p < R * El; p += kDispatchThreads / 32) {
    const int src = p / El, el = p % El;
    const int32_t* c = counts + src * (El + 1);
    int so = c[El], row0 = seg[el];
    for (int e = 0; e < el; ++e) so += c[e];
    for (int s = 0; s < src; ++s) row0 += counts[s * (El + 1) + el];
    uint8_t* sb = pt.base[src];
    const int32_t* s_send = region<int32_t>(sb, l.send_list);
    const uint8_t* s_x = region<uint8_t>(sb, l.x_q);
    const float* s_scale = region<float>(sb, l.x_scale);
    const float* s_w = region<float>(sb, l.topk_weights);
    for (int i = 0; i < c[el]; ++i) {
      const int32_t v = s_send[so + i];
      const int token = EpLayout::src_token(v), slot = EpLayout::src_slot(v), row = row0 + i;
      const uint4* from = reinterpret_cast<const uint4*>(s_x + size_t(token) * H);
      uint4* to = reinterpret_cast<uint4*>(recv_x + size_t(row) * H);
      for (int j = lane; j < H / 16; j += 32) to[j] = from[j];
      for (int g = lane; g < hb; g += 32)
        recv_scale[size_t(g) * l.recv_rows_cap + row] = s_scale[token * hb + g];
      if (lane == 0) {
        recv_weight[row] = s_w[token * K + slot];
        recv_src[row] = v;
      }
    }
  }
}

}  // namespace

void ep_dispatch(const EpLayout& l, const transport::PeerTable* tables, int ranks_here, const int* num_tokens,
                 uint64_t epoch, cudaStream_t stream) {
  MEGAMOE_CHECK(ranks_here >= 1 && ranks_here <= transport::kMaxRanks,
                "ep_dispatch: ranks_here out of range");
  MEGAMOE_CHECK(l.ranks * l.local_experts <= kMaxExperts, "ep_dispatch supports at most 512 experts");
  MEGAMOE_CHECK(l.hidden % 128 == 0, "ep_dispatch needs H % 128 == 0");
  MEGAMOE_CHECK(epoch > 0, "ep_dispatch: epochs start at 1 (signals start at 0)");
  Tables t{};
  for (int i = 0; i < ranks_here; ++i) t.t[i] = tables[i];
  ep_dispatch_kernel<<<ranks_here, kDispatchThreads, 0, stream>>>(l, t, num_tokens, epoch);
  MEGAMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace megamoe::kernels
