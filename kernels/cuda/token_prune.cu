// CUDA kernels of vlmprune: TopK selection, gather + summary, [CLS]-row scorer,
// DivPrune greedy selection.
// Same semantics as kernels/cpu (shared/DESIGN.md "Pruning semantics"). Every entry
// point only enqueues on the caller's stream: no allocation, no host synchronisation.
//
// Portability: plain C++14/17 CUDA that CUDA 11.4 (Xavier, sm_72) accepts as well as
// CUDA 12/13 (Orin sm_87, Hopper sm_90): no cooperative groups or cuda::std. The scorer
// uses thread-block clusters on sm_90+ only, through three PTX instructions behind
// __CUDA_ARCH__ >= 900 and a CUDA 12 launch behind CUDART_VERSION, so older toolkits and
// architectures compile (and run) its one-block-per-image form.
//
// Design notes and the figures' status: kernels/README.md. The previous kernels live on in
// cuda/token_prune_v1.cu, the check harness's baseline.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

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
//
// Layout of the work: a grid of (image, token chunk) blocks, the C chunks of one image
// forming a thread-block cluster on sm_90+ (C = 1, one block per image, elsewhere). A
// block computes the logits of its chunk for a group of G heads at once (every head's keys
// in flight together, not head after head), reduces each head's chunk to a local
// (max, sum of exp) pair, and reads the C pairs of its cluster from distributed shared
// memory in rank order: every block of the image combines them in the same fixed order
// into the same softmax normaliser, so the scores are deterministic and no atomics, no
// workspace and no second launch are involved (the entry point has no workspace argument
// and must not allocate). Then each block adds its tokens' probabilities head by head in
// ascending head order, the v1 kernel's order, and writes its slice of scores.
// The int8 mean key is reduced the same way: per-block partial sums in double, in a fixed
// order, then the C partials in rank order.

constexpr int kScoreThreads = 512;
constexpr int kMaxCluster = 16;    // Hopper's non-portable maximum (8 is portable)
constexpr int kMinChunk = 32;      // keys per block at least
constexpr int kKeysInFlight = 4;   // [T, dh] layout: keys a lane group loads before it reduces
constexpr int kMaxDevices = 64;
constexpr size_t kDefaultSmem = 48 * 1024;  // dynamic shared memory without the opt-in

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

// The same butterflies for a compile-time n, fully unrolled, so x stays in registers
// (the runtime-n form indexes x dynamically: local memory).
template <int kN>
__device__ __forceinline__ void hadamard_fixed(float* x) {
#pragma unroll
  for (int len = 1; len < kN; len <<= 1) {
#pragma unroll
    for (int p = 0; p < kN / 2; ++p) {  // constant trip count: unrolls; pair p is (j, j + len)
      const int j = (p / len) * 2 * len + p % len;
      const float a = x[j], b = x[j + len];
      x[j] = __fadd_rn(a, b);
      x[j + len] = __fsub_rn(a, b);
    }
  }
}

// Cluster barrier (all threads of all C blocks; release/acquire, so shared-memory writes
// before it are visible to every rank after it), or __syncthreads when C == 1. The host
// launches C > 1 only for code compiled for sm_90+ (see max_cluster).
__device__ __forceinline__ void cluster_barrier(int C) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (C > 1) {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    return;
  }
#endif
  (void)C;
  __syncthreads();
}

// *local as seen in the shared memory of cluster rank `rank` (rank 0 when C == 1).
__device__ __forceinline__ float load_rank(const float* local, int rank, int C) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (C > 1) {
    unsigned remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote)
                 : "r"(static_cast<unsigned>(__cvta_generic_to_shared(local))), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
  }
#endif
  (void)rank;
  (void)C;
  return *local;
}

__device__ __forceinline__ double load_rank(const double* local, int rank, int C) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (C > 1) {
    unsigned remote;
    double v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote)
                 : "r"(static_cast<unsigned>(__cvta_generic_to_shared(local))), "r"(rank));
    asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(remote) : "memory");
    return v;
  }
#endif
  (void)rank;
  (void)C;
  return *local;
}

// Shared memory of one scorer block, in bytes; the kernel carves it in the same order.
__host__ __device__ inline size_t score_smem_bytes(int G, int chunk, int dh, bool int8) {
  const size_t g = static_cast<size_t>(G), c = static_cast<size_t>(chunk), d = static_cast<size_t>(dh);
  return (int8 ? 8 * g * d : 0) + 4 * (c + g * c + g * d + 7 * g + (int8 ? 2 * g * d : 0));
}

// Partial sums over this block's keys [t0, t0 + n) of each channel of g heads (k points at
// the group's first head), in double as on the CPU, each in a fixed order.
template <typename E, bool KT>
__device__ void key_sums(const E* k, int T, int dh, int g, int t0, int n, double* part) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  if (KT) {  // [dh, T]: a warp per channel row, lanes along the tokens (coalesced), then a fixed shuffle tree
    for (int row = warp; row < g * dh; row += warps) {  // row = head * dh + d: its keys start at row * T
      const E* r = k + static_cast<int64_t>(row) * T + t0;
      double s = 0.0;
      for (int i = lane; i < n; i += kWarp) s += to_f32(r[i]);
      for (int o = kWarp / 2; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
      if (lane == 0) part[row] = s;
    }
  } else {  // [T, dh]: a thread per channel (coalesced across threads), tokens in order
    for (int i = threadIdx.x; i < g * dh; i += blockDim.x) {
      const int hl = i / dh, d = i - hl * dh;
      const E* c = k + (static_cast<int64_t>(hl) * T + t0) * dh + d;
      double s = 0.0;
      for (int t = 0; t < n; ++t) s += to_f32(c[static_cast<int64_t>(t) * dh]);
      part[i] = s;
    }
  }
}

// logits[hl * chunk + i] = scale * q_hl . k_hl,t0+i for k laid out [T, dh]: a group of L
// lanes per key (L = dh / VEC rounded up to a power of two, at most 32), VEC elements per
// load, kKeysInFlight keys per group before the shuffle reductions, so a warp keeps
// 4 * 32 * 16 bytes of keys in flight. VEC divides dh; k is VEC-aligned (host).
template <typename E, int VEC>
__device__ void logits_rows(const float* qf, const E* k, int T, int dh, int g, int t0, int n, int chunk, float scale,
                            float* logits) {
  typedef Pack<E, VEC> P;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const int nv = dh / VEC;
  int L = 1;
  while (L < nv && L < kWarp) L <<= 1;
  const int per_warp = kWarp / L, sub = lane / L, j = lane % L;
  const int keys = g * n, stride = warps * per_warp;
  for (int base = warp * per_warp; base < keys; base += stride * kKeysInFlight) {  // warp-uniform bounds
    P x[kKeysInFlight];
    const P* row[kKeysInFlight];
    int key[kKeysInFlight];
#pragma unroll
    for (int u = 0; u < kKeysInFlight; ++u) {  // all loads first: memory-level parallelism
      key[u] = base + u * stride + sub;
      row[u] = nullptr;
      if (key[u] < keys) {
        const int hl = key[u] / n, i = key[u] - hl * n;
        row[u] = reinterpret_cast<const P*>(k + (static_cast<int64_t>(hl) * T + t0 + i) * dh);
        if (j < nv) x[u] = row[u][j];
      }
    }
    float s[kKeysInFlight];
#pragma unroll
    for (int u = 0; u < kKeysInFlight; ++u) {
      s[u] = 0.0f;
      if (row[u] != nullptr) {
        const float* qh = qf + (key[u] / n) * dh;
        if (j < nv) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) s[u] = fmaf(qh[j * VEC + e], to_f32(x[u].v[e]), s[u]);
        }
        for (int v = j + L; v < nv; v += L) {  // dh > 32 VEC only
          const P y = row[u][v];
#pragma unroll
          for (int e = 0; e < VEC; ++e) s[u] = fmaf(qh[v * VEC + e], to_f32(y.v[e]), s[u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kKeysInFlight; ++u) {
      for (int o = L / 2; o > 0; o >>= 1) s[u] += __shfl_xor_sync(kFull, s[u], o);
      if (j == 0 && key[u] < keys) {
        const int hl = key[u] / n;
        logits[hl * chunk + key[u] - hl * n] = scale * s[u];
      }
    }
  }
}

// Same for k laid out [dh, T]: a thread per (head, key), consecutive threads on
// consecutive keys (coalesced whatever T's alignment), channels unrolled for loads in flight.
template <typename E>
__device__ void logits_cols(const float* qf, const E* k, int T, int dh, int g, int t0, int n, int chunk, float scale,
                            float* logits) {
  for (int item = threadIdx.x; item < g * n; item += blockDim.x) {
    const int hl = item / n, i = item - hl * n;
    const E* kc = k + static_cast<int64_t>(hl) * dh * T + t0 + i;
    const float* qh = qf + hl * dh;
    float s = 0.0f;
#pragma unroll 16
    for (int d = 0; d < dh; ++d) s += qh[d] * to_f32(kc[static_cast<int64_t>(d) * T]);
    logits[hl * chunk + i] = s * scale;
  }
}

// The int8 logits (kernels.h), either layout: a thread per (head, key). Each rotation block
// of the centred key is transformed in registers twice, once for the key's max |x| (its
// scale) and once for the int32 dot with the two-limb query qc, so no dh-wide scratch.
// BLK > 0: the rotation block is BLK (64 whenever 64 divides dh), unrolled into registers;
// BLK == 0: blk at run time, as the v1 kernel. Bitwise the v1 kernel's and the CPU's logits
// for the same mean key.
template <typename E, bool KT, int BLK>
__device__ void logits_int8(const int* qc, const float* sq, const float* mu, const E* k, int T, int dh, int g, int t0,
                            int n, int chunk, int blk, float scale_blk, float* logits) {
  float x[BLK > 0 ? BLK : kMaxRotationBlock];
  const int bs = BLK > 0 ? BLK : blk;
  for (int item = threadIdx.x; item < g * n; item += blockDim.x) {
    const int hl = item / n, i = item - hl * n, t = t0 + i;
    const E* kh = k + static_cast<int64_t>(hl) * T * dh;
    const float* muh = mu + hl * dh;
    const int* qch = qc + hl * dh;
    const float step = sq[hl] / 127.0f;
    float m = 0.0f;
    int dot = 0;
    for (int pass = 0; pass < 2; ++pass) {
      const float sk = quant_scale(m);
      for (int d0 = 0; d0 < dh; d0 += bs) {
        // dh == BLK (one rotation block, e.g. dh = 64): pass 1 reuses pass 0's rotated key.
        if (!(BLK > 0 && pass == 1 && dh == BLK)) {
#pragma unroll
          for (int jj = 0; jj < (BLK > 0 ? BLK : kMaxRotationBlock); ++jj) {
            if (BLK > 0 || jj < bs) {
              const int d = d0 + jj;
              const int64_t at = KT ? static_cast<int64_t>(d) * T + t : static_cast<int64_t>(t) * dh + d;
              x[jj] = __fsub_rn(to_f32(kh[at]), muh[d]);
            }
          }
          if (BLK > 0) {
            hadamard_fixed<(BLK > 0 ? BLK : 1)>(x);
          } else {
            hadamard(x, bs);
          }
        }
#pragma unroll
        for (int jj = 0; jj < (BLK > 0 ? BLK : kMaxRotationBlock); ++jj) {
          if (BLK > 0 || jj < bs) {
            if (pass == 0) {
              m = fmaxf(m, fabsf(x[jj]));
            } else {
              dot += qch[d0 + jj] * quantize(x[jj], sk);
            }
          }
        }
      }
      if (pass == 1) logits[hl * chunk + i] = scale_blk * __fmul_rn(__fmul_rn(step, sk), static_cast<float>(dot));
    }
  }
}

// Block (rank, image) = blockIdx.x (% C, / C); see the section comment. G heads per group,
// chunk keys per rank; shared memory laid out as score_smem_bytes counts it.
template <typename E, int VEC, bool KT, bool INT8, int BLK>
__global__ void __launch_bounds__(kScoreThreads)
    cls_scores_kernel(const E* __restrict__ q, const E* __restrict__ k, int H, int T, int dh, float scale, int has_cls,
                      int C, int G, int chunk, float* __restrict__ scores) {
  extern __shared__ double smem[];
  double* mu_part = smem;                                                   // INT8: G * dh partial key sums
  float* acc = reinterpret_cast<float*>(smem + (INT8 ? G * dh : 0));        // chunk: sum over heads so far
  float* logits = acc + chunk;                                              // G * chunk
  float* qf = logits + G * chunk;                                           // G * dh: the [CLS] query rows
  float* stats = qf + G * dh;                                               // 2 buffers x G x (max, sum)
  float* head_max = stats + 4 * G;                                          // G: the image's softmax max
  float* head_sum = head_max + G;                                           // G: and normaliser
  float* sq = head_sum + G;                                                 // G: INT8 q scale
  float* mu = sq + G;                                                       // INT8: G * dh mean key
  int* qc = reinterpret_cast<int*>(mu + (INT8 ? G * dh : 0));               // INT8: G * dh two-limb query

  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const int rank = static_cast<int>(blockIdx.x % static_cast<unsigned>(C));  // 1-D clusters of C consecutive blocks
  const int64_t b = blockIdx.x / static_cast<unsigned>(C);
  const int t0 = rank * chunk;
  const int n = max(0, min(T, t0 + chunk) - t0);
  const int N = T - has_cls;
  const int blk = (dh & -dh) < kMaxRotationBlock ? (dh & -dh) : kMaxRotationBlock;
  const float scale_blk = scale / static_cast<float>(blk);
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc[i] = 0.0f;

  int par = 0;
  for (int h0 = 0; h0 < H; h0 += G, par ^= 1) {
    const int g = min(G, H - h0);
    const int64_t head0 = (b * H + h0) * static_cast<int64_t>(T) * dh;  // first head of the group, both layouts
    for (int i = threadIdx.x; i < g * dh; i += blockDim.x) {
      const int hl = i / dh;
      qf[i] = to_f32(q[head0 + static_cast<int64_t>(hl) * T * dh + (i - hl * dh)]);  // row 0: the [CLS] query
    }
    if (INT8) {
      key_sums<E, KT>(k + head0, T, dh, g, t0, n, mu_part);
      __syncthreads();
      for (int i = threadIdx.x; i < g * (dh / blk); i += blockDim.x) hadamard(qf + i * blk, blk);
      __syncthreads();
      for (int hl = warp; hl < g; hl += warps) {
        float m = 0.0f;
        for (int d = lane; d < dh; d += kWarp) m = fmaxf(m, fabsf(qf[hl * dh + d]));
        m = warp_max(m);
        if (lane == 0) sq[hl] = quant_scale(m);
      }
      cluster_barrier(C);  // every rank's mu_part is complete (and this block's sq)
      for (int i = threadIdx.x; i < g * dh; i += blockDim.x) {
        double s = 0.0;
        for (int r = 0; r < C; ++r) s += load_rank(mu_part + i, r, C);  // rank order: the same sum in every rank
        mu[i] = static_cast<float>(s / static_cast<double>(T));
        const float sqh = sq[i / dh];
        const int hi = quantize(qf[i], sqh);
        qc[i] = 127 * hi + quantize(__fmaf_rn(-static_cast<float>(hi), sqh, qf[i]), sqh / 127.0f);  // the CPU's std::fma
      }
    }
    __syncthreads();
    if (INT8) {
      logits_int8<E, KT, BLK>(qc, sq, mu, k + head0, T, dh, g, t0, n, chunk, blk, scale_blk, logits);
    } else if (KT) {
      logits_cols<E>(qf, k + head0, T, dh, g, t0, n, chunk, scale, logits);
    } else {
      logits_rows<E, VEC>(qf, k + head0, T, dh, g, t0, n, chunk, scale, logits);
    }
    __syncthreads();

    float* st = stats + par * 2 * G;  // alternate buffers: a rank may still read the last group's pairs
    for (int hl = warp; hl < g; hl += warps) {
      const float* l = logits + hl * chunk;
      float m = -INFINITY;
      for (int i = lane; i < n; i += kWarp) m = fmaxf(m, l[i]);
      m = warp_max(m);
      float s = 0.0f;
      for (int i = lane; i < n; i += kWarp) s += expf(l[i] - m);
      s = warp_sum(s);
      if (lane == 0) {
        st[2 * hl] = m;
        st[2 * hl + 1] = s;
      }
    }
    cluster_barrier(C);
    for (int hl = warp; hl < g; hl += warps) {  // lane r reads rank r's pair: a fixed tree over ranks
      float mr = -INFINITY, sr = 0.0f;
      if (lane < C) {
        mr = load_rank(st + 2 * hl, lane, C);
        sr = load_rank(st + 2 * hl + 1, lane, C);
      }
      const float m = warp_max(mr);
      const float s = warp_sum(sr > 0.0f ? sr * expf(mr - m) : 0.0f);
      if (lane == 0) {
        head_max[hl] = m;
        head_sum[hl] = s;
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      float a = acc[i];
      for (int hl = 0; hl < g; ++hl) a += expf(logits[hl * chunk + i] - head_max[hl]) / head_sum[hl];
      acc[i] = a;
    }
    // No barrier needed here: the next group rewrites qf/logits/head_* only after barriers.
  }
  const float heads = static_cast<float>(H);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    if (t0 + i >= has_cls) scores[b * N + t0 + i - has_cls] = acc[i] / heads;
  }
  if (C > 1) cluster_barrier(C);  // keep this block's shared memory alive until every rank has read it
}

// Largest cluster size (16, 8, ..., 1) that `kern` runs with on the current device, cached
// per device. > 1 only where the kernel's code was compiled for sm_90+ (ptxVersion: a
// binary JIT-compiled from older PTX has no cluster code) on a device of compute
// capability 9+, with a CUDA 12 runtime.
template <typename E, int VEC, bool KT, bool INT8, int BLK>
int max_cluster() {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12000
  static std::atomic<int> cache[kMaxDevices];  // 0: not probed yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    cudaGetLastError();
    return 1;
  }
  const int known = cache[dev].load(std::memory_order_relaxed);
  if (known > 0) return known;
  void (*kern)(const E*, const E*, int, int, int, float, int, int, int, int, float*) = cls_scores_kernel<E, VEC, KT, INT8, BLK>;
  int major = 0, C = 1;
  cudaFuncAttributes fa;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9 &&
      cudaFuncGetAttributes(&fa, kern) == cudaSuccess && fa.ptxVersion >= 90) {
    C = cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess ? kMaxCluster : 8;
    for (; C > 1; C >>= 1) {
      cudaLaunchConfig_t cfg = {};
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = static_cast<unsigned>(C);
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.gridDim = dim3(static_cast<unsigned>(C));
      cfg.blockDim = dim3(kScoreThreads);
      cfg.dynamicSmemBytes = kDefaultSmem;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, kern, &cfg) == cudaSuccess && clusters > 0) break;
    }
  }
  cudaGetLastError();  // a refused probe is not this call's launch error
  cache[dev].store(C, std::memory_order_relaxed);
  return C;
#else
  return 1;
#endif
}

int device_sms() {
  int sms = 0, dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    cudaGetLastError();
    sms = 80;
  }
  return sms;
}

template <typename E, int VEC, bool KT, bool INT8, int BLK = 0>
vlmp_status launch_scores(const void* q, const void* k, int64_t B, int H, int T, int dh, float scale, int has_cls,
                          float* scores, cudaStream_t stream) {
  void (*kern)(const E*, const E*, int, int, int, float, int, int, int, int, float*) = cls_scores_kernel<E, VEC, KT, INT8, BLK>;
  // Cluster size: enough blocks to cover the SMs, >= kMinChunk keys per block.
  const int max_c = max_cluster<E, VEC, KT, INT8, BLK>();
  const int sms = device_sms();
  int C = 1;
  while (C < max_c && B * C < sms && 2 * C * kMinChunk <= T && B * 2 * C <= 0x7fffffff) C <<= 1;
  const int chunk = (T + C - 1) / C;
  // Heads per group: as many as fit the default 48 KiB (one group at the shapes that
  // matter); a single head past that, with the opt-in (<= 54 KiB at the limits).
  int G = 1;
  while (G < H && score_smem_bytes(G + 1, chunk, dh, INT8) <= kDefaultSmem) ++G;
  const size_t smem = score_smem_bytes(G, chunk, dh, INT8);
  if (smem > kDefaultSmem &&
      cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) != cudaSuccess) {
    cudaGetLastError();
    return VLMP_ERR_UNSUPPORTED;
  }
  const E* qe = static_cast<const E*>(q);
  const E* ke = static_cast<const E*>(k);
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12000
  if (C > 1) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(C);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(static_cast<unsigned>(B * C));
    cfg.blockDim = dim3(kScoreThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (cudaLaunchKernelEx(&cfg, kern, qe, ke, H, T, dh, scale, has_cls, C, G, chunk, scores) != cudaSuccess)
      return VLMP_ERR_CUDA;
    return launch_status();
  }
#endif
  kern<<<static_cast<unsigned>(B), kScoreThreads, smem, stream>>>(qe, ke, H, T, dh, scale, has_cls, 1, G, chunk, scores);
  return launch_status();
}

// Float [T, dh]: the widest load (16 bytes) that dh and k's alignment allow, else scalar.
// int8: the rotation block unrolled at compile time when it is 64 (any dh multiple of 64).
template <typename E>
vlmp_status dispatch_scores(const void* q, const void* k, int64_t B, int H, int T, int dh, int k_transposed,
                            float scale, int has_cls, int int8, float* scores, cudaStream_t s) {
  constexpr int kVec = static_cast<int>(16 / sizeof(E));
  if (int8 && dh % kMaxRotationBlock == 0) {  // 64-channel rotation blocks, in registers
    return k_transposed ? launch_scores<E, 1, true, true, kMaxRotationBlock>(q, k, B, H, T, dh, scale, has_cls, scores, s)
                        : launch_scores<E, 1, false, true, kMaxRotationBlock>(q, k, B, H, T, dh, scale, has_cls, scores, s);
  }
  if (int8) {
    return k_transposed ? launch_scores<E, 1, true, true>(q, k, B, H, T, dh, scale, has_cls, scores, s)
                        : launch_scores<E, 1, false, true>(q, k, B, H, T, dh, scale, has_cls, scores, s);
  }
  if (k_transposed) return launch_scores<E, 1, true, false>(q, k, B, H, T, dh, scale, has_cls, scores, s);
  if (dh % kVec == 0 && reinterpret_cast<uintptr_t>(k) % 16 == 0)
    return launch_scores<E, kVec, false, false>(q, k, B, H, T, dh, scale, has_cls, scores, s);
  return launch_scores<E, 1, false, false>(q, k, B, H, T, dh, scale, has_cls, scores, s);
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
  const int h = static_cast<int>(H), t = static_cast<int>(T), d = static_cast<int>(dh);
  return dt == VLMP_FLOAT16 ? dispatch_scores<__half>(q, k, B, h, t, d, k_transposed, scale, has_cls, int8, scores, s)
                            : dispatch_scores<float>(q, k, B, h, t, d, k_transposed, scale, has_cls, int8, scores, s);
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
