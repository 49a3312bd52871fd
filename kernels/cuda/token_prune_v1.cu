// The previous CUDA kernels (as of 30d0380), kept as they were (less an unused helper) as the timing and bit-for-bit
// baseline of kernels/cuda/check_main.cu. Compiled only into that harness (build.py's
// nvcc_build_harness, CMake's vlmp_check), never into the library: the entry points carry
// a _v1 suffix and are declared in check_main.cu, not in include/vlmprune/kernels.h.
//
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

__host__ __device__ __forceinline__ int next_pow2(int n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Sorts keys[0, n) into descending order; n is a power of two.
__device__ void bitonic_sort_desc(unsigned long long* keys, int n) {
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int partner = i ^ j;
        if (partner > i) {
          const unsigned long long a = keys[i], b = keys[partner];
          const bool descending = (i & k) == 0;
          if (descending ? (a < b) : (a > b)) {
            keys[i] = b;
            keys[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

constexpr int kTopkThreads = 1024;

// One block per row. Padding keys are 0, below every real key (whose high word is > 0).
__global__ void __launch_bounds__(kTopkThreads)
    select_topk_kernel(const float* __restrict__ scores, int N, int K, int64_t* __restrict__ kept) {
  __shared__ unsigned long long keys[kMaxN];
  const float* row = scores + static_cast<int64_t>(blockIdx.x) * N;
  const int padded = next_pow2(N);
  for (int i = threadIdx.x; i < padded; i += blockDim.x) keys[i] = i < N ? rank_key(row[i], i) : 0ull;
  __syncthreads();
  bitonic_sort_desc(keys, padded);

  // The K winners' low words are 0xffffffff - index: sorting those descending
  // yields ascending indices.
  const int padded_k = next_pow2(K);
  for (int i = threadIdx.x; i < padded_k; i += blockDim.x) keys[i] = i < K ? (keys[i] & 0xffffffffull) : 0ull;
  __syncthreads();
  bitonic_sort_desc(keys, padded_k);
  int64_t* out = kept + static_cast<int64_t>(blockIdx.x) * K;
  for (int j = threadIdx.x; j < K; j += blockDim.x) out[j] = 0xffffffffu - static_cast<unsigned>(keys[j]);
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
constexpr int kDivPruneCols = kMaxN / kDivPruneThreads;  // columns per thread: the N <= 4096 limit

__device__ __forceinline__ unsigned long long warp_max(unsigned long long v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, v, o);
    v = other > v ? other : v;
  }
  return v;
}

// Block-wide argmax of run[] (thread t owns columns t, t + blockDim.x, ...), ties to the
// lowest index: the max of rank_key (value, then index ascending; -0 == +0, as IEEE
// compares). red: 32 keys of shared memory that no thread reads until the next
// __syncthreads but one (callers alternate two buffers, so one barrier per step suffices).
__device__ __forceinline__ int block_argmax(const float (&run)[kDivPruneCols], int N, unsigned long long* red) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  unsigned long long key = 0;  // below every real key
#pragma unroll
  for (int j = 0; j < kDivPruneCols; ++j) {
    const int c = threadIdx.x + j * blockDim.x;
    if (c < N) {
      const unsigned long long k = rank_key(run[j], c);
      key = k > key ? k : key;
    }
  }
  key = warp_max(key);
  if (lane == 0) red[warp] = key;
  __syncthreads();
  key = warp_max(lane < warps ? red[lane] : 0ull);
  return static_cast<int>(0xffffffffu - static_cast<unsigned>(key & 0xffffffffull));
}

// One block per image; blockDim.x is a multiple of 32 with blockDim.x * kDivPruneCols >= N.
// The running minimum lives in registers (each thread only ever touches its own columns,
// so updates need no barrier); a picked column holds -inf, which min() keeps, exactly the
// contract's "-inf if picked". fp32 compares and selects only: bitwise the CPU's picks.
__global__ void __launch_bounds__(kDivPruneThreads)
    divprune_select_kernel(const float* __restrict__ dist, int N, int K, int64_t* __restrict__ picks) {
  __shared__ unsigned long long red[2][kWarp];
  const float* d = dist + static_cast<int64_t>(blockIdx.x) * N * N;
  int64_t* out = picks + static_cast<int64_t>(blockIdx.x) * K;
  float run[kDivPruneCols];

  // Step 0: column minima off the diagonal; a warp reads 32 consecutive floats of a row.
#pragma unroll
  for (int j = 0; j < kDivPruneCols; ++j) run[j] = INFINITY;
#pragma unroll 4
  for (int r = 0; r < N; ++r) {
    const float* row = d + static_cast<int64_t>(r) * N;
#pragma unroll
    for (int j = 0; j < kDivPruneCols; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      if (c < N && c != r) {
        const float v = row[c];
        run[j] = v < run[j] ? v : run[j];
      }
    }
  }

  for (int step = 0;; ++step) {
    const int p = block_argmax(run, N, red[step & 1]);
    if (threadIdx.x == 0) out[step] = p;
    if (step + 1 == K) break;
    const float* row = d + static_cast<int64_t>(p) * N;
#pragma unroll
    for (int j = 0; j < kDivPruneCols; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      if (c < N) {
        const float v = row[c];
        // After step 0 the running minimum starts as the picked row itself.
        const float m = step == 0 ? v : (v < run[j] ? v : run[j]);
        run[j] = c == p ? -INFINITY : m;
      }
    }
  }
}

}  // namespace

// ------------------------------------------------------------------ C ABI

extern "C" {

vlmp_status vlmp_select_topk_cuda_v1(const float* scores, int64_t B, int64_t N, int64_t K, int64_t* kept, void* stream) {
  if (B < 0 || K < 1 || K >= N) return VLMP_ERR_INVALID_ARGUMENT;
  if (B > 0 && (scores == nullptr || kept == nullptr)) return VLMP_ERR_INVALID_ARGUMENT;
  if (N > kMaxN || B > 0x7fffffff) return VLMP_ERR_UNSUPPORTED;
  if (B == 0) return VLMP_OK;
  select_topk_kernel<<<static_cast<unsigned>(B), kTopkThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      scores, static_cast<int>(N), static_cast<int>(K), kept);
  return launch_status();
}

vlmp_status vlmp_gather_summary_cuda_v1(vlmp_dtype dt, const void* hidden, int64_t B, int64_t T, int64_t D, int has_cls,
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

vlmp_status vlmp_cls_scores_cuda_v1(vlmp_dtype dt, const void* q, const void* k, int64_t B, int64_t H, int64_t T,
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

vlmp_status vlmp_divprune_select_cuda_v1(const float* dist, int64_t B, int64_t N, int64_t K, int64_t* picks,
                                      void* stream) {
  if (B < 1 || K < 1 || K > N || dist == nullptr || picks == nullptr) return VLMP_ERR_INVALID_ARGUMENT;
  if (N > kMaxN || B > 0x7fffffff) return VLMP_ERR_UNSUPPORTED;
  // One thread per column up to 1024 (whole warps), then up to kDivPruneCols columns each.
  const int threads = static_cast<int>(N >= kDivPruneThreads ? kDivPruneThreads : (N + kWarp - 1) / kWarp * kWarp);
  divprune_select_kernel<<<static_cast<unsigned>(B), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      dist, static_cast<int>(N), static_cast<int>(K), picks);
  return launch_status();
}

}  // extern "C"
