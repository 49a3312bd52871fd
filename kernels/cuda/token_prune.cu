// CUDA kernels of vlmprune: TopK selection, gather + summary, [CLS]-row scorer,
// DivPrune greedy selection.
// Same semantics as kernels/cpu (shared/DESIGN.md "Pruning semantics"). Every entry
// point only enqueues on the caller's stream: no allocation, no host synchronisation.
//
// Portability: plain C++14/17 CUDA that CUDA 11.4 (Xavier, sm_72) accepts as well as
// CUDA 12/13 (Orin sm_87, Hopper sm_90): no cooperative groups, clusters or cuda::std.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "vlmprune/kernels.h"

namespace {

constexpr int kWarp = 32;
constexpr int kMaxN = 4096;           // patch tokens per image: TopK row and slot-table size
constexpr int kMaxT = kMaxN + 1;      // plus [CLS]
constexpr int kMaxHeadDim = 1024;     // scorer: q row kept in shared memory
constexpr int kMaxGridY = 65535;      // batch runs over gridDim.y

// ------------------------------------------------------------------ helpers

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename E>
__device__ __forceinline__ E from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

// VEC consecutive elements moved as one aligned load/store (up to 16 bytes).
template <typename E, int VEC>
struct alignas(sizeof(E) * VEC) Pack {
  E v[VEC];
};

__device__ __forceinline__ float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ int warp_sum(int v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide reductions; every thread gets the result. red: >= 32 floats of shared memory.
template <bool kMax>
__device__ float block_reduce(float v, float* red) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = (blockDim.x + kWarp - 1) / kWarp;
  v = kMax ? warp_max(v) : warp_sum(v);
  __syncthreads();  // red may still be read by the previous reduction
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = lane < warps ? red[lane] : (kMax ? -INFINITY : 0.0f);
  r = kMax ? warp_max(r) : warp_sum(r);
  return r;
}

vlmp_status launch_status() {
  // Peek, not Get: the header promises that cudaGetLastError() still has the reason.
  return cudaPeekAtLastError() == cudaSuccess ? VLMP_OK : VLMP_ERR_CUDA;
}

bool valid_dtype(vlmp_dtype dt) { return dt == VLMP_FLOAT32 || dt == VLMP_FLOAT16; }

// ---------------------------------------------------------------- selection

// Same total order as the CPU kernel: score descending (NaN above +inf, -0 == +0),
// then index ascending, packed so that a larger 64-bit key ranks first.
__device__ __forceinline__ unsigned long long rank_key(float s, int i) {
  unsigned u = __float_as_uint(s);
  if ((u & 0x7fffffffu) > 0x7f800000u) u = 0x7fc00000u;
  if (u == 0x80000000u) u = 0u;
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(u) << 32) | (0xffffffffu - static_cast<unsigned>(i));
}

// The score half of rank_key: larger ranks first. Every float maps to >= 0x007fffff
// (-inf), so 0 is free to mean "no candidate".
__device__ __forceinline__ unsigned order_key(float s) { return static_cast<unsigned>(rank_key(s, 0) >> 32); }

constexpr unsigned kFull = 0xffffffffu;

// Block-wide exclusive prefix sum of v in thread order; *total gets the sum of all.
// blockDim.x is a multiple of 32. scan: 32 ints of shared memory, free again after
// the caller's next __syncthreads.
__device__ int block_exclusive_scan(int v, int* scan, int* total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  int x = v;
  for (int o = 1; o < kWarp; o <<= 1) {
    const int y = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += y;
  }
  if (lane == kWarp - 1) scan[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < warps ? scan[lane] : 0;
    for (int o = 1; o < kWarp; o <<= 1) {
      const int y = __shfl_up_sync(kFull, w, o);
      if (lane >= o) w += y;
    }
    if (lane < warps) scan[lane] = w;  // inclusive over warps; each lane rewrites only the slot it read
  }
  __syncthreads();
  *total = scan[warps - 1];
  return (warp ? scan[warp - 1] : 0) + x - v;
}

constexpr int kTopkThreads = 1024;
constexpr int kTopkPerThread = kMaxN / kTopkThreads;  // contiguous scores per thread: the N <= 4096 limit

// One block per row, no sort (the v1 kernel bitonic-sorted the padded row twice: ~110
// barriers whatever K). Radix select on the 32-bit order key, 8 bits a pass: each pass
// histograms the candidates that still match the selected prefix (integer shared-memory
// atomics: the counts, hence the result, do not depend on their order) and one warp
// finds the bin holding the K-th largest. After 4 passes v* is the K-th largest key and
// `need` says how many of the keys equal to v* are kept: the lowest-indexed ones, which is
// the CPU's (score desc, index asc) order. One packed block scan in index order (thread t
// owns scores [4t, 4t + 4)) then gives each kept index its output slot, so the list
// comes out ascending without a second sort. 4 * 3 + 2 barriers in all.
__global__ void __launch_bounds__(kTopkThreads)
    select_topk_kernel(const float* __restrict__ scores, int N, int K, int64_t* __restrict__ kept) {
  __shared__ int hist[256];
  __shared__ int scan[kWarp];
  __shared__ unsigned sel_prefix;
  __shared__ int sel_need;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const float* row = scores + static_cast<int64_t>(blockIdx.x) * N;
  const int c0 = threadIdx.x * kTopkPerThread;
  unsigned u[kTopkPerThread];
#pragma unroll
  for (int j = 0; j < kTopkPerThread; ++j) u[j] = c0 + j < N ? order_key(row[c0 + j]) : 0u;

  unsigned prefix = 0, mask = 0;
  int need = K;  // invariant: 1 <= need <= number of keys matching prefix under mask
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kTopkPerThread; ++j) {
      if (c0 + j < N && (u[j] & mask) == prefix) atomicAdd(&hist[(u[j] >> shift) & 255u], 1);
    }
    __syncthreads();
    if (warp == 0) {  // lane owns bins [8 lane, 8 lane + 8); find the bin b with count(>b) < need <= count(>=b)
      int cnt[8], tot = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        cnt[e] = hist[8 * lane + e];
        tot += cnt[e];
      }
      int suffix = tot;  // bins >= 8 lane
      for (int o = 1; o < kWarp; o <<= 1) {
        const int y = __shfl_down_sync(kFull, suffix, o);
        if (lane + o < kWarp) suffix += y;
      }
      int above = suffix - tot;  // bins >= 8 (lane + 1)
#pragma unroll
      for (int e = 7; e >= 0; --e) {
        if (above < need && above + cnt[e] >= need) {  // exactly one (lane, e) of the warp
          sel_prefix = prefix | (static_cast<unsigned>(8 * lane + e) << shift);
          sel_need = need - above;
        }
        above += cnt[e];
      }
    }
    __syncthreads();
    prefix = sel_prefix;  // rewritten next pass only after that pass's first barrier
    need = sel_need;
    mask |= 255u << shift;
  }

  // prefix is v*: keep every key > v* and the `need` lowest-indexed keys == v*.
  int gt = 0, eq = 0;
#pragma unroll
  for (int j = 0; j < kTopkPerThread; ++j) {
    if (c0 + j < N) {
      gt += u[j] > prefix;
      eq += u[j] == prefix;
    }
  }
  int total;  // both counts < 2^16 (N <= 4096): one scan carries the pair
  const int ex = block_exclusive_scan((gt << 16) | eq, scan, &total);
  int gt_before = ex >> 16, eq_before = ex & 0xffff;
  int64_t* out = kept + static_cast<int64_t>(blockIdx.x) * K;
#pragma unroll
  for (int j = 0; j < kTopkPerThread; ++j) {
    const int c = c0 + j;
    if (c >= N) break;
    if (u[j] > prefix) {  // kept rows before c: every greater key, and the ties up to `need`
      out[gt_before + min(eq_before, need)] = c;
      ++gt_before;
    } else if (u[j] == prefix) {
      if (eq_before < need) out[gt_before + eq_before] = c;
      ++eq_before;
    }
  }
}

// ------------------------------------------------------------ gather/summary

constexpr int kGatherWarps = 16;  // warps per block, each walking every kGatherWarps-th token
constexpr int kGatherUnroll = 16; // token rows each warp has in flight

// Block (column slice x, image y). Each lane owns VEC columns; every input token is
// read once: a kept token is stored to its output row, a pruned one is added to
// the lane's fp32 running sum. The token -> output-row map is rebuilt per block in
// shared memory from the ascending kept list (no global workspace).
template <typename E, int VEC>
__global__ void __launch_bounds__(kGatherWarps* kWarp)
    gather_summary_kernel(const E* __restrict__ hidden, int T, int D, int has_cls, const int64_t* __restrict__ kept,
                          int K, E* __restrict__ out) {
  __shared__ short slot[kMaxT];  // output row of input token t, or -1 when pruned
  __shared__ float partial[kGatherWarps][kWarp * VEC];
  typedef Pack<E, VEC> P;
  const int N = T - has_cls, lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t b = blockIdx.y;

  for (int t = threadIdx.x; t < T; t += blockDim.x) slot[t] = (has_cls && t == 0) ? 0 : -1;
  __syncthreads();
  const int64_t* kb = kept + b * K;
  for (int j = threadIdx.x; j < K; j += blockDim.x) {
    const int64_t i = kb[j];
    if (i >= 0 && i < N) slot[has_cls + i] = static_cast<short>(has_cls + j);  // out-of-range ids are ignored
  }
  __syncthreads();

  const int col = (blockIdx.x * kWarp + lane) * VEC;
  const bool active = col < D;  // the host picks VEC dividing D
  const E* src = hidden + b * T * D + col;
  E* dst = out + b * (has_cls + K + 1) * D + col;
  float acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = 0.0f;

  if (active) {
    for (int t0 = warp; t0 < T; t0 += kGatherWarps * kGatherUnroll) {
      P v[kGatherUnroll];
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) {  // issue all loads first: memory-level parallelism
        const int t = t0 + u * kGatherWarps;
        if (t < T) v[u] = *reinterpret_cast<const P*>(src + static_cast<int64_t>(t) * D);
      }
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) {
        const int t = t0 + u * kGatherWarps;
        if (t >= T) break;
        const int s = slot[t];  // uniform across the warp: no divergence
        if (s >= 0) {
          *reinterpret_cast<P*>(dst + static_cast<int64_t>(s) * D) = v[u];
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[e] += to_f32(v[u].v[e]);
        }
      }
    }
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) partial[warp][lane * VEC + e] = acc[e];
  __syncthreads();
  if (warp == 0 && active) {
    const float count = static_cast<float>(N - K);
    P r;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      float sum = 0.0f;
      for (int w = 0; w < kGatherWarps; ++w) sum += partial[w][lane * VEC + e];
      r.v[e] = from_f32<E>(sum / count);
    }
    *reinterpret_cast<P*>(dst + static_cast<int64_t>(has_cls + K) * D) = r;
  }
}

// Widest lane width (16, 8, 4, 2 bytes...) that D and the pointers allow, narrowed
// while the grid would leave SMs idle: more column slices = more blocks.
int gather_vec(size_t es, int64_t B, int64_t D, const void* hidden, const void* out) {
  int sms = 0, dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    sms = 80;
  const uintptr_t align = reinterpret_cast<uintptr_t>(hidden) | reinterpret_cast<uintptr_t>(out);
  int vec = static_cast<int>(16 / es);
  while (vec > 1 && (D % vec != 0 || align % (vec * es) != 0)) vec >>= 1;
  const int min_vec = es == 2 ? 2 : 1;  // keep >= 4-byte lanes
  while (vec > min_vec && B * ((D + kWarp * vec - 1) / (kWarp * vec)) < 2 * sms) vec >>= 1;
  return vec;
}

template <typename E>
vlmp_status launch_gather(const void* hidden, int64_t B, int64_t T, int64_t D, int has_cls, const int64_t* kept,
                          int64_t K, void* out, cudaStream_t stream) {
  const int vec = gather_vec(sizeof(E), B, D, hidden, out);
  const dim3 grid(static_cast<unsigned>((D + kWarp * vec - 1) / (kWarp * vec)), static_cast<unsigned>(B));
  const dim3 block(kGatherWarps * kWarp);
  const E* h = static_cast<const E*>(hidden);
  E* o = static_cast<E*>(out);
  const int t = static_cast<int>(T), d = static_cast<int>(D), k = static_cast<int>(K);
  switch (vec) {
    case 8: gather_summary_kernel<E, (sizeof(E) == 2 ? 8 : 4)><<<grid, block, 0, stream>>>(h, t, d, has_cls, kept, k, o); break;
    case 4: gather_summary_kernel<E, 4><<<grid, block, 0, stream>>>(h, t, d, has_cls, kept, k, o); break;
    case 2: gather_summary_kernel<E, 2><<<grid, block, 0, stream>>>(h, t, d, has_cls, kept, k, o); break;
    default: gather_summary_kernel<E, 1><<<grid, block, 0, stream>>>(h, t, d, has_cls, kept, k, o); break;
  }
  return launch_status();
}

// ------------------------------------------------------------------ scorer

constexpr int kScoreThreads = 1024;

// Symmetric per-vector int8 quantisation, bit-identical to the CPU kernel.
__device__ __forceinline__ float quant_scale(float max_abs) { return max_abs > 0.0f ? max_abs / 127.0f : 1.0f; }
__device__ __forceinline__ int quantize(float x, float s) {
  return static_cast<int>(fminf(127.0f, fmaxf(-127.0f, rintf(x / s))));
}

constexpr int kMaxRotationBlock = 64;  // the int8 scorer's Hadamard block: largest power of two dividing dh, <= 64

// Unnormalised Walsh-Hadamard transform of x[0, n), in the CPU kernel's butterfly order.
// Adds and subtracts only (nothing for nvcc to contract), so every step rounds alike.
__device__ __forceinline__ void hadamard(float* x, int n) {
  for (int len = 1; len < n; len <<= 1) {
    for (int i = 0; i < n; i += len << 1) {
      for (int j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = __fadd_rn(a, b);
        x[j + len] = __fsub_rn(a, b);
      }
    }
  }
}

// logits[t] = scale * q . k_t for k laid out [dh, T]: one thread per key.
template <typename E>
__device__ void logits_transposed(const float* qf, const E* k, int T, int dh, float scale, float* logits) {
  for (int t = threadIdx.x; t < T; t += blockDim.x) {
    float s = 0.0f;
    for (int d = 0; d < dh; ++d) s += qf[d] * to_f32(k[static_cast<int64_t>(d) * T + t]);
    logits[t] = s * scale;
  }
}

// Same for k laid out [T, dh]: one warp per key, lanes across dh.
template <typename E>
__device__ void logits_rows(const float* qf, const E* k, int T, int dh, float scale, float* logits) {
  const int lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  for (int t = threadIdx.x / kWarp; t < T; t += warps) {
    const E* kt = k + static_cast<int64_t>(t) * dh;
    float s = 0.0f;
    for (int d = lane; d < dh; d += kWarp) s += qf[d] * to_f32(kt[d]);
    s = warp_sum(s);
    if (lane == 0) logits[t] = scale * s;
  }
}

// The int8 logits (kernels.h), either layout: one thread per key. Each rotation block of
// the centred key is transformed in registers twice, once for the key's max |x| (its
// scale) and once for the int32 dot with the two-limb query qc, so no dh-wide scratch.
template <typename E>
__device__ void logits_int8(const int* qc, float step, const float* mu, const E* k, int T, int dh, int blk,
                            int k_transposed, float scale_blk, float* logits) {
  float x[kMaxRotationBlock];
  for (int t = threadIdx.x; t < T; t += blockDim.x) {
    float m = 0.0f;
    int dot = 0;
    for (int pass = 0; pass < 2; ++pass) {
      const float sk = quant_scale(m);
      for (int d0 = 0; d0 < dh; d0 += blk) {
        for (int j = 0; j < blk; ++j) {
          const int d = d0 + j;
          const int64_t at = k_transposed ? static_cast<int64_t>(d) * T + t : static_cast<int64_t>(t) * dh + d;
          x[j] = __fsub_rn(to_f32(k[at]), mu[d]);
        }
        hadamard(x, blk);
        for (int j = 0; j < blk; ++j) {
          if (pass == 0) {
            m = fmaxf(m, fabsf(x[j]));
          } else {
            dot += qc[d0 + j] * quantize(x[j], sk);
          }
        }
      }
      if (pass == 1) logits[t] = scale_blk * __fmul_rn(__fmul_rn(step, sk), static_cast<float>(dot));
    }
  }
}

// One block per image; heads in sequence so the mean over heads needs no atomics
// (deterministic, and the same summation order on every run).
template <typename E>
__global__ void __launch_bounds__(kScoreThreads)
    cls_scores_kernel(const E* __restrict__ q, const E* __restrict__ k, int H, int T, int dh, int k_transposed,
                      float scale, int has_cls, int int8, float* __restrict__ scores) {
  __shared__ float logits[kMaxT];
  __shared__ float acc[kMaxT];
  __shared__ float qf[kMaxHeadDim];
  __shared__ int qc[kMaxHeadDim];    // int8: the rotated query's two int8 limbs, 127 * hi + lo
  __shared__ float mu[kMaxHeadDim];  // int8: the mean key, subtracted before quantising (exact for softmax)
  __shared__ float red[kWarp];
  const int64_t b = blockIdx.x;
  const int N = T - has_cls;
  const int blk = (dh & -dh) < kMaxRotationBlock ? (dh & -dh) : kMaxRotationBlock;
  const float scale_blk = scale / static_cast<float>(blk);
  for (int i = threadIdx.x; i < N; i += blockDim.x) acc[i] = 0.0f;

  for (int h = 0; h < H; ++h) {
    const int64_t head = (b * H + h) * static_cast<int64_t>(T) * dh;
    for (int d = threadIdx.x; d < dh; d += blockDim.x) qf[d] = to_f32(q[head + d]);  // row 0: the [CLS] query
    float step = 0.0f;
    if (int8) {
      __syncthreads();
      for (int d0 = threadIdx.x * blk; d0 < dh; d0 += blockDim.x * blk) hadamard(qf + d0, blk);
      __syncthreads();
      float q_max = 0.0f;
      for (int d = threadIdx.x; d < dh; d += blockDim.x) q_max = fmaxf(q_max, fabsf(qf[d]));
      const float sq = quant_scale(block_reduce<true>(q_max, red));
      step = sq / 127.0f;
      for (int d = threadIdx.x; d < dh; d += blockDim.x) {
        const int hi = quantize(qf[d], sq);
        qc[d] = 127 * hi + quantize(__fmaf_rn(-static_cast<float>(hi), sq, qf[d]), step);  // the CPU's std::fma
        double s = 0.0;  // double, as on the CPU: both round the mean to the same float
        for (int t = 0; t < T; ++t) {
          s += to_f32(k[head + (k_transposed ? static_cast<int64_t>(d) * T + t : static_cast<int64_t>(t) * dh + d)]);
        }
        mu[d] = static_cast<float>(s / static_cast<double>(T));
      }
    }
    __syncthreads();
    if (int8) {
      logits_int8(qc, step, mu, k + head, T, dh, blk, k_transposed, scale_blk, logits);
    } else if (k_transposed) {
      logits_transposed(qf, k + head, T, dh, scale, logits);
    } else {
      logits_rows(qf, k + head, T, dh, scale, logits);
    }
    __syncthreads();

    float m = -INFINITY;
    for (int t = threadIdx.x; t < T; t += blockDim.x) m = fmaxf(m, logits[t]);
    m = block_reduce<true>(m, red);
    float sum = 0.0f;
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
      logits[t] = expf(logits[t] - m);
      sum += logits[t];
    }
    sum = block_reduce<false>(sum, red);
    for (int i = threadIdx.x; i < N; i += blockDim.x) acc[i] += logits[has_cls + i] / sum;
    __syncthreads();  // qf, qc, mu and logits are rewritten by the next head
  }
  const float heads = static_cast<float>(H);
  for (int i = threadIdx.x; i < N; i += blockDim.x) scores[b * N + i] = acc[i] / heads;
}

// ---------------------------------------------------------------- DivPrune

constexpr int kDivPruneThreads = 1024;

__device__ __forceinline__ unsigned warp_umax(unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(kFull, v);  // one instruction on Ampere and later
#else
  for (int o = kWarp / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFull, v, o));
  return v;
#endif
}

// Block-wide argmax: (u, c) is each thread's best (order key, lowest column among its
// equal keys; u == 0 for a thread without columns). Threads own ascending contiguous
// column ranges, so among equal keys the lowest lane, then the lowest warp, holds the
// lowest column: a max plus a ballot per level, ties to the lowest index as on the CPU.
// red_u / red_c: 32 entries of shared memory that nobody reads until the next
// __syncthreads but one (callers alternate two buffers: one barrier per pick).
__device__ __forceinline__ int block_argmax(unsigned u, int c, unsigned* red_u, int* red_c) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  unsigned m = warp_umax(u);
  c = __shfl_sync(kFull, c, __ffs(__ballot_sync(kFull, u == m)) - 1);
  if (lane == 0) {
    red_u[warp] = m;
    red_c[warp] = c;
  }
  __syncthreads();
  u = lane < warps ? red_u[lane] : 0u;
  c = lane < warps ? red_c[lane] : 0;
  m = warp_umax(u);
  return __shfl_sync(kFull, c, __ffs(__ballot_sync(kFull, u == m)) - 1);
}

// One block per image; thread t owns columns [COLS t, COLS t + COLS), blockDim.x a
// multiple of 32 with blockDim.x * COLS >= N. The running minimum lives in registers (a
// thread only ever touches its own columns, so updates need no barrier); a picked column
// holds -inf, which min() keeps, exactly the contract's "-inf if picked". fp32 compares
// and selects only: bitwise the CPU's (and the v1 kernel's) picks. Per pick: one row
// load, a register argmax, one barrier; the v1 kernel's 64-bit shuffle tree is gone.
template <int COLS>
__global__ void __launch_bounds__(kDivPruneThreads)
    divprune_select_kernel(const float* __restrict__ dist, int N, int K, int64_t* __restrict__ picks) {
  __shared__ unsigned red_u[2][kWarp];
  __shared__ int red_c[2][kWarp];
  const float* d = dist + static_cast<int64_t>(blockIdx.x) * N * N;
  int64_t* out = picks + static_cast<int64_t>(blockIdx.x) * K;
  const int c0 = threadIdx.x * COLS;
  float run[COLS];

  // Pick 0: column minima off the diagonal; consecutive threads read consecutive columns,
  // 32 loads in flight per thread (the whole N x N matrix passes through one SM here).
#pragma unroll
  for (int j = 0; j < COLS; ++j) run[j] = INFINITY;
#pragma unroll(32 / COLS)
  for (int r = 0; r < N; ++r) {
    const float* row = d + static_cast<int64_t>(r) * N;
#pragma unroll
    for (int j = 0; j < COLS; ++j) {
      // Unconditional loads (the column clamped into the row) so that the unrolled rows'
      // loads can all be issued before the first min; the diagonal and padding drop out here.
      const int c = c0 + j;
      const float v = __ldg(row + min(c, N - 1));
      run[j] = (c < N && c != r && v < run[j]) ? v : run[j];
    }
  }

  for (int step = 0;; ++step) {
    unsigned best_u = 0;
    int best_c = 0;
#pragma unroll
    for (int j = 0; j < COLS; ++j) {
      if (c0 + j < N) {
        const unsigned k = order_key(run[j]);
        if (k > best_u) {  // strict: the lower column keeps a tie
          best_u = k;
          best_c = c0 + j;
        }
      }
    }
    const int p = block_argmax(best_u, best_c, red_u[step & 1], red_c[step & 1]);
    if (threadIdx.x == 0) out[step] = p;
    if (step + 1 == K) break;
    const float* row = d + static_cast<int64_t>(p) * N;
#pragma unroll
    for (int j = 0; j < COLS; ++j) {
      const int c = c0 + j;
      if (c < N) {
        const float v = __ldg(row + c);
        // After pick 0 the running minimum starts as the picked row itself.
        const float m = step == 0 ? v : (v < run[j] ? v : run[j]);
        run[j] = c == p ? -INFINITY : m;
      }
    }
  }
}

}  // namespace

// ------------------------------------------------------------------ C ABI

extern "C" {

vlmp_status vlmp_select_topk_cuda(const float* scores, int64_t B, int64_t N, int64_t K, int64_t* kept, void* stream) {
  if (B < 0 || K < 1 || K >= N) return VLMP_ERR_INVALID_ARGUMENT;
  if (B > 0 && (scores == nullptr || kept == nullptr)) return VLMP_ERR_INVALID_ARGUMENT;
  if (N > kMaxN || B > 0x7fffffff) return VLMP_ERR_UNSUPPORTED;
  if (B == 0) return VLMP_OK;
  // kTopkPerThread contiguous scores per thread, whole warps: fewer threads, cheaper barriers.
  const int threads = static_cast<int>(((N + kTopkPerThread - 1) / kTopkPerThread + kWarp - 1) / kWarp * kWarp);
  select_topk_kernel<<<static_cast<unsigned>(B), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      scores, static_cast<int>(N), static_cast<int>(K), kept);
  return launch_status();
}

vlmp_status vlmp_gather_summary_cuda(vlmp_dtype dt, const void* hidden, int64_t B, int64_t T, int64_t D, int has_cls,
                                     const int64_t* kept, int64_t K, void* out, void* stream) {
  if (!valid_dtype(dt)) return VLMP_ERR_UNSUPPORTED;
  if (B < 0 || D < 1 || (has_cls != 0 && has_cls != 1)) return VLMP_ERR_INVALID_ARGUMENT;
  const int64_t N = T - has_cls;
  if (K < 1 || K >= N) return VLMP_ERR_INVALID_ARGUMENT;
  if (B > 0 && (hidden == nullptr || kept == nullptr || out == nullptr)) return VLMP_ERR_INVALID_ARGUMENT;
  if (N > kMaxN || B > kMaxGridY || D > 0x7fffffff) return VLMP_ERR_UNSUPPORTED;
  if (B == 0) return VLMP_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dt == VLMP_FLOAT16 ? launch_gather<__half>(hidden, B, T, D, has_cls, kept, K, out, s)
                            : launch_gather<float>(hidden, B, T, D, has_cls, kept, K, out, s);
}

vlmp_status vlmp_cls_scores_cuda(vlmp_dtype dt, const void* q, const void* k, int64_t B, int64_t H, int64_t T,
                                 int64_t dh, int k_transposed, float scale, int has_cls, int int8, float* scores,
                                 void* stream) {
  if (!valid_dtype(dt)) return VLMP_ERR_UNSUPPORTED;
  if (B < 0 || H < 1 || dh < 1 || (has_cls != 0 && has_cls != 1) || T - has_cls < 1) return VLMP_ERR_INVALID_ARGUMENT;
  if (B > 0 && (q == nullptr || k == nullptr || scores == nullptr)) return VLMP_ERR_INVALID_ARGUMENT;
  if (T > kMaxT || dh > kMaxHeadDim || B > 0x7fffffff || H > 0x7fffffff) return VLMP_ERR_UNSUPPORTED;
  if (B == 0) return VLMP_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const unsigned grid = static_cast<unsigned>(B);
  const int h = static_cast<int>(H), t = static_cast<int>(T), d = static_cast<int>(dh);
  if (dt == VLMP_FLOAT16) {
    cls_scores_kernel<__half><<<grid, kScoreThreads, 0, s>>>(static_cast<const __half*>(q),
                                                             static_cast<const __half*>(k), h, t, d, k_transposed,
                                                             scale, has_cls, int8, scores);
  } else {
    cls_scores_kernel<float><<<grid, kScoreThreads, 0, s>>>(static_cast<const float*>(q), static_cast<const float*>(k),
                                                            h, t, d, k_transposed, scale, has_cls, int8, scores);
  }
  return launch_status();
}

vlmp_status vlmp_divprune_select_cuda(const float* dist, int64_t B, int64_t N, int64_t K, int64_t* picks,
                                      void* stream) {
  if (B < 1 || K < 1 || K > N || dist == nullptr || picks == nullptr) return VLMP_ERR_INVALID_ARGUMENT;
  if (N > kMaxN || B > 0x7fffffff) return VLMP_ERR_UNSUPPORTED;
  // One column per thread up to 1024 columns, then 2 or 4 contiguous columns each; whole warps.
  const int n = static_cast<int>(N), k = static_cast<int>(K);
  const int cols = n <= kDivPruneThreads ? 1 : n <= 2 * kDivPruneThreads ? 2 : 4;
  const int threads = ((n + cols - 1) / cols + kWarp - 1) / kWarp * kWarp;
  const dim3 grid(static_cast<unsigned>(B));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (cols) {
    case 1: divprune_select_kernel<1><<<grid, threads, 0, s>>>(dist, n, k, picks); break;
    case 2: divprune_select_kernel<2><<<grid, threads, 0, s>>>(dist, n, k, picks); break;
    default: divprune_select_kernel<4><<<grid, threads, 0, s>>>(dist, n, k, picks); break;
  }
  return launch_status();
}

}  // extern "C"
