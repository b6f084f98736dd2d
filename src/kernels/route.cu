// Routing on the GPU. The router GEMM runs in float32 on CUDA cores from BF16
// activations and BF16/F32 router weights; split-K partials are summed in a
// fixed order by the top-k kernel, so the logits (and thus ids and weights)
// are bit-identical from run to run.
#include <algorithm>
#include <cfloat>

#include "cuda_check.h"
#include "route.cuh"

namespace megamoe::kernels {
namespace {

constexpr int kTileT = 64;           // tokens per router block
constexpr int kTileE = 64;           // experts per router block
constexpr int kTileH = 32;           // depth per shared-memory step
constexpr int kRouterThreads = 256;  // 16 x 16 threads, 4 tokens x 4 experts each
constexpr int kLanesMaxTokens = 256;  // up to this many tokens: the lane-per-token kernel

__device__ __forceinline__ float load_w(const uint16_t* w, size_t i) {
  return __uint_as_float(uint32_t(w[i]) << 16);
}
__device__ __forceinline__ float load_w(const float* w, size_t i) { return w[i]; }

// Four consecutive router weights as floats (16-byte or 8-byte load).
__device__ __forceinline__ float4 load_w4(const float* w, size_t i) {
  return *reinterpret_cast<const float4*>(w + i);
}
__device__ __forceinline__ float4 load_w4(const uint16_t* w, size_t i) {
  const uint2 r = *reinterpret_cast<const uint2*>(w + i);
  return make_float4(__uint_as_float(r.x << 16), __uint_as_float(r.x & 0xFFFF0000u),
                     __uint_as_float(r.y << 16), __uint_as_float(r.y & 0xFFFF0000u));
}

// Large T: a register-blocked float32 GEMM, logits[t][e] over one K slice.
template <typename WT>
__global__ void __launch_bounds__(kRouterThreads) route_logits_kernel(RouteArgs a, int H, int E) {
  const int T = *a.num_tokens;
  const int t0 = blockIdx.y * kTileT;
  if (t0 >= T) return;
  const int e0 = blockIdx.x * kTileE;
  const int hs = (H + a.ksplit - 1) / a.ksplit;
  const int h_begin = blockIdx.z * hs;
  const int h_end = min(H, h_begin + hs);
  const WT* W = static_cast<const WT*>(a.router);

  // K-major tiles, padded by one column so the transposing stores hit distinct banks.
  __shared__ float xs[kTileH][kTileT + 1];
  __shared__ float ws[kTileH][kTileE + 1];
  const int tid = threadIdx.x;
  const int tt = (tid / 16) * 4;
  const int te = (tid % 16) * 4;
  float acc[4][4] = {};
  for (int h0 = h_begin; h0 < h_end; h0 += kTileH) {
    for (int i = tid; i < kTileT * kTileH; i += kRouterThreads) {
      const int r = i / kTileH, c = i % kTileH;
      const int t = t0 + r, h = h0 + c;
      xs[c][r] = (t < T && h < h_end) ? __uint_as_float(uint32_t(a.x[size_t(t) * H + h]) << 16) : 0.0f;
    }
    for (int i = tid; i < kTileE * kTileH; i += kRouterThreads) {
      const int r = i / kTileH, c = i % kTileH;
      const int e = e0 + r, h = h0 + c;
      ws[c][r] = (e < E && h < h_end) ? load_w(W, size_t(e) * H + h) : 0.0f;
    }
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < kTileH; ++k) {
      const float xr[4] = {xs[k][tt], xs[k][tt + 1], xs[k][tt + 2], xs[k][tt + 3]};
      const float wr[4] = {ws[k][te], ws[k][te + 1], ws[k][te + 2], ws[k][te + 3]};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(xr[i], wr[j], acc[i][j]);
    }
    __syncthreads();
  }
  float* out = a.partial + size_t(blockIdx.z) * a.max_tokens * E;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int t = t0 + tt + i, e = e0 + te + j;
      if (t < T && e < E) out[size_t(t) * E + e] = acc[i][j];
    }
}

// Small T (decode): one warp per (expert, K slice, group of 32 tokens), a lane
// per token; the weights are read once per warp as broadcast 16-byte loads.
// NOTE: every logit is the same float computation in both router kernels: per
// K slice (kRouterSlices, fixed per shape) a sequential fmaf chain over the
// columns in ascending order, then the slices summed in order by route_topk. So
// the routing, and the layer's output bytes, do not depend on which kernel ran
// (the token hint) -- a graph captured at a large hint replays bit-identically.
template <typename WT>
__global__ void __launch_bounds__(256) route_logits_lanes_kernel(RouteArgs a, int H, int E, int groups) {
  const int T = *a.num_tokens;
  const int w = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = w % groups, rest = w / groups;
  const int split = rest % a.ksplit, e = rest / a.ksplit;
  if (e >= E || g * 32 >= T) return;
  const int t = g * 32 + lane;
  const bool active = t < T;
  const int hs = H / a.ksplit;
  const WT* W = static_cast<const WT*>(a.router) + size_t(e) * H;
  const uint16_t* x = a.x + size_t(active ? t : 0) * H;
  float acc = 0.0f;
  // NOTE: unrolled so the loads of 8 steps are in flight together (v4 measured one
  // step per memory latency: 82 us at T=1); the fmaf chain keeps its order.
#pragma unroll 8
  for (int h = split * hs; h < (split + 1) * hs; h += 4) {
    const float4 wv = load_w4(W, h);
    const uint2 r = *reinterpret_cast<const uint2*>(x + h);
    acc = fmaf(__uint_as_float(r.x << 16), wv.x, acc);
    acc = fmaf(__uint_as_float(r.x & 0xFFFF0000u), wv.y, acc);
    acc = fmaf(__uint_as_float(r.y << 16), wv.z, acc);
    acc = fmaf(__uint_as_float(r.y & 0xFFFF0000u), wv.w, acc);
  }
  if (active) a.partial[(size_t(split) * a.max_tokens + t) * E + e] = acc;
}

constexpr int kTopkWarps = 4;
constexpr int kMaxE = 512;

// (value, id) max with ties to the lower id.
__device__ __forceinline__ void argmax_merge(float& v, int& id, float ov, int oid) {
  if (ov > v || (ov == v && oid < id)) {
    v = ov;
    id = oid;
  }
}

__device__ __forceinline__ void warp_argmax(float& v, int& id) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oid = __shfl_xor_sync(0xffffffffu, id, o);
    argmax_merge(v, id, ov, oid);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One warp per token.
__global__ void __launch_bounds__(kTopkWarps * 32) route_topk_kernel(RouteArgs a, MoeShape s) {
  __shared__ float score_s[kTopkWarps][kMaxE];
  __shared__ float sel_s[kTopkWarps][kMaxE];
  __shared__ float group_s[kTopkWarps][32];
  const int T = *a.num_tokens;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int E = s.experts, K = s.topk;
  float* score = score_s[warp];
  float* sel = sel_s[warp];
  for (int t = blockIdx.x * kTopkWarps + warp; t < T; t += gridDim.x * kTopkWarps) {
    // Logits: sum the split-K partials in split order.
    float zmax = -FLT_MAX;
    for (int e = lane; e < E; e += 32) {
      float z = 0.0f;
      for (int k = 0; k < a.ksplit; ++k) z += a.partial[(size_t(k) * a.max_tokens + t) * E + e];
      score[e] = z;
      zmax = fmaxf(zmax, z);
    }
    __syncwarp();
    float denom = 1.0f;
    if (s.score == ScoreFunc::kSoftmax) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) zmax = fmaxf(zmax, __shfl_xor_sync(0xffffffffu, zmax, o));
      float sum = 0.0f;
      for (int e = lane; e < E; e += 32) sum += expf(score[e] - zmax);
      denom = warp_sum(sum);
    }
    for (int e = lane; e < E; e += 32) {
      const float z = score[e];
      float p;
      if (s.score == ScoreFunc::kSigmoid) {
        p = 1.0f / (1.0f + expf(-z));
      } else if (s.score == ScoreFunc::kSoftmax) {
        p = expf(z - zmax) / denom;
      } else {
        const float sp = z > 20.0f ? z : log1pf(expf(z));
        p = sqrtf(sp);
      }
      score[e] = p;
      sel[e] = p + (a.bias ? a.bias[e] : 0.0f);
    }
    __syncwarp();
    if (s.n_group > 1) {
      const int gsize = E / s.n_group;
      if (lane < s.n_group) {
        float b1 = -FLT_MAX, b2 = -FLT_MAX;
        for (int i = 0; i < gsize; ++i) {
          const float v = sel[lane * gsize + i];
          if (v > b1) {
            b2 = b1;
            b1 = v;
          } else if (v > b2) {
            b2 = v;
          }
        }
        group_s[warp][lane] = b1 + b2;
      }
      __syncwarp();
      // Keep the topk_group best groups (ties to the lower group id).
      float gv = lane < s.n_group ? group_s[warp][lane] : -FLT_MAX;
      bool keep = false;
      for (int r = 0; r < s.topk_group; ++r) {
        float v = keep ? -FLT_MAX : gv;
        int id = lane < s.n_group && !keep ? lane : 1 << 30;
        if (lane >= s.n_group) v = -FLT_MAX;
        warp_argmax(v, id);
        if (lane == id) keep = true;
      }
      const unsigned keep_mask = __ballot_sync(0xffffffffu, keep);
      for (int e = lane; e < E; e += 32)
        if (!((keep_mask >> (e / gsize)) & 1u)) sel[e] = -FLT_MAX;
      __syncwarp();
    }
    // Top-K by selection score, ties to the lower id.
    float wsum = 0.0f;
    int my_id = -1;
    float my_w = 0.0f;
    for (int k = 0; k < K; ++k) {
      float v = -INFINITY;
      int id = 1 << 30;
      for (int e = lane; e < E; e += 32) argmax_merge(v, id, sel[e], e);
      warp_argmax(v, id);
      const float w = score[id];
      wsum += w;
      if (lane == k) {
        my_id = id;
        my_w = w;
      }
      __syncwarp();
      if (lane == 0) sel[id] = -INFINITY;
      __syncwarp();
    }
    if (lane < K) {
      float w = my_w;
      if (s.norm_topk_prob) w = w / (wsum + 1e-20f);
      w *= s.routed_scaling;
      a.ids[size_t(t) * K + lane] = my_id;
      a.weights[size_t(t) * K + lane] = w;
      a.pos[size_t(t) * K + lane] = atomicAdd(&a.expert_counts[my_id], 1);
    }
    __syncwarp();
  }
}

}  // namespace

void route_topk(const MoeShape& s, const RouteArgs& a, int host_tokens_hint, int num_sms,
                cudaStream_t stream);

void launch_route(const MoeShape& s, const RouteArgs& a, int host_tokens_hint, int num_sms,
                  cudaStream_t stream) {
  MEGAMOE_CHECK(s.experts <= kMaxE, "route_topk supports at most 512 experts");
  MEGAMOE_CHECK(s.topk <= 32, "route_topk supports top-k <= 32");
  MEGAMOE_CHECK(s.n_group <= 32, "route_topk supports n_group <= 32");
  MEGAMOE_CHECK(host_tokens_hint >= 0 && host_tokens_hint <= a.max_tokens, "token hint out of range");
  MEGAMOE_CHECK(a.ksplit == kRouterSlices && s.hidden % (kRouterSlices * kTileH) == 0,
                "the router splits H into 4 slices of a multiple of 32 columns");
  if (host_tokens_hint <= kLanesMaxTokens) {
    const int groups = std::max(1, (host_tokens_hint + 31) / 32);  // the hint bounds the device count
    const int warps = s.experts * kRouterSlices * groups;
    const int blocks = (warps + 7) / 8;
    if (s.router_dtype == RouterDtype::kBF16)
      route_logits_lanes_kernel<uint16_t><<<blocks, 256, 0, stream>>>(a, s.hidden, s.experts, groups);
    else
      route_logits_lanes_kernel<float><<<blocks, 256, 0, stream>>>(a, s.hidden, s.experts, groups);
    MEGAMOE_CUDA_CHECK_LAUNCH();
    route_topk(s, a, host_tokens_hint, num_sms, stream);
    return;
  }
  const int t_tiles = std::max(1, (host_tokens_hint + kTileT - 1) / kTileT);
  // NOTE: the grid covers the host hint, an upper bound of the device token count: blocks
  // past the device count exit at once, so a graph captured at a hint serves any count below it.
  dim3 grid((s.experts + kTileE - 1) / kTileE, t_tiles, a.ksplit);
  if (s.router_dtype == RouterDtype::kBF16)
    route_logits_kernel<uint16_t><<<grid, kRouterThreads, 0, stream>>>(a, s.hidden, s.experts);
  else
    route_logits_kernel<float><<<grid, kRouterThreads, 0, stream>>>(a, s.hidden, s.experts);
  MEGAMOE_CUDA_CHECK_LAUNCH();
  route_topk(s, a, host_tokens_hint, num_sms, stream);
}

void route_topk(const MoeShape& s, const RouteArgs& a, int host_tokens_hint, int num_sms,
                cudaStream_t stream) {
  const int topk_blocks =
      std::max(1, std::min((host_tokens_hint + kTopkWarps - 1) / kTopkWarps, num_sms * 8));
  route_topk_kernel<<<topk_blocks, kTopkWarps * 32, 0, stream>>>(a, s);
  MEGAMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace megamoe::kernels
