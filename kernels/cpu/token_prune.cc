// CPU kernels of vlmprune: TopK selection, gather + summary, [CLS]-row scorer.
// Semantics: shared/DESIGN.md "Pruning semantics" and include/vlmprune/kernels.h.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#endif

#include "half.h"
#include "token_prune_cpu.h"

namespace vlmp {
namespace cpu {
namespace {

// Per-thread scratch, grown on demand: repeated calls (one per inference) do not
// touch the heap once the largest shape has been seen.
struct Scratch {
  std::vector<uint64_t> keys;
  std::vector<float> f0, f1, f2;
  std::vector<uint16_t> h0;
  std::vector<int32_t> i0;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

template <typename V>
typename V::value_type* grow(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

template <typename V>
typename V::value_type* zeros(V& v, size_t n) {
  typename V::value_type* z = grow(v, n);
  std::fill(z, z + n, typename V::value_type(0));
  return z;
}

// An all-zero row of n elements of E.
template <typename E>
const E* zero_row(Scratch& sc, size_t n);
template <>
const float* zero_row<float>(Scratch& sc, size_t n) { return zeros(sc.f1, n); }
template <>
const uint16_t* zero_row<uint16_t>(Scratch& sc, size_t n) { return zeros(sc.h0, n); }

// ---------------------------------------------------------------- selection

// Maps a score to an unsigned key with the same order. NaN ranks above +inf (as
// torch.topk does) and -0 equals +0, so the order is total and ties go to the index.
inline uint32_t sortable_score(float s) {
  uint32_t u = float_to_bits(s);
  if ((u & 0x7fffffffu) > 0x7f800000u) u = 0x7fc00000u;
  if (u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Higher key = selected first: score descending, then index ascending.
inline uint64_t rank_key(float s, int64_t i) {
  return (static_cast<uint64_t>(sortable_score(s)) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
}

// ------------------------------------------------------------ gather/summary

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) { return half_to_float(x); }

// Pruned rows are summed four at a time, so the fp32 accumulator row is loaded and
// stored once per four input rows instead of once per row.
constexpr int kRowBatch = 4;

void accumulate(float* __restrict acc, const float* const* rows, int64_t n) {
  const float *a = rows[0], *b = rows[1], *c = rows[2], *d = rows[3];
  for (int64_t i = 0; i < n; ++i) acc[i] += (a[i] + b[i]) + (c[i] + d[i]);
}

void accumulate_portable(float* __restrict acc, const uint16_t* const* rows, int64_t c0, int64_t n) {
  const uint16_t *a = rows[0], *b = rows[1], *c = rows[2], *d = rows[3];
  for (int64_t i = c0; i < n; ++i) {
    acc[i] += (half_to_float(a[i]) + half_to_float(b[i])) + (half_to_float(c[i]) + half_to_float(d[i]));
  }
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define VLMP_HAVE_F16C_DISPATCH 1
// The build targets plain x86-64-v2, whose portable fp16 decode costs ~10 ops per
// 4 values and makes the fp16 summary compute-bound. Where the CPU has F16C (every
// x86-64 since 2013) one vcvtph2ps decodes 8: picked once at run time.
__attribute__((target("avx,f16c"))) inline __m256 load8_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

__attribute__((target("avx,f16c"))) void accumulate_f16c(float* __restrict acc, const uint16_t* const* rows,
                                                           int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 ab = _mm256_add_ps(load8_f16(rows[0] + i), load8_f16(rows[1] + i));
    const __m256 cd = _mm256_add_ps(load8_f16(rows[2] + i), load8_f16(rows[3] + i));
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_add_ps(ab, cd)));
  }
  accumulate_portable(acc, rows, i, n);
}

// VLMPRUNE_DISABLE_F16C=1 forces the portable path (tests cover both).
bool cpu_has_f16c() {
  static const bool has = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c") &&
                          std::getenv("VLMPRUNE_DISABLE_F16C") == nullptr;
  return has;
}
#endif

void accumulate(float* __restrict acc, const uint16_t* const* rows, int64_t n) {
#ifdef VLMP_HAVE_F16C_DISPATCH
  if (cpu_has_f16c()) {
    accumulate_f16c(acc, rows, n);
    return;
  }
#endif
  accumulate_portable(acc, rows, 0, n);
}

void write_mean(const float* acc, int64_t n, float count, float* out) {
  for (int64_t c = 0; c < n; ++c) out[c] = acc[c] / count;
}

void write_mean(const float* acc, int64_t n, float count, uint16_t* out) {
  for (int64_t c = 0; c < n; ++c) out[c] = float_to_half(acc[c] / count);
}

// Chunk c of one image: the patch rows [c * kGatherChunkRows, ...). Kept rows go to their
// output slots (and chunk 0 copies [CLS]); the pruned ones are summed into partial[D].
// Whole rows per task, read front to back: a task streams one contiguous stretch of the
// input, which the hardware prefetcher follows, and the sum's order is fixed by the chunk
// size alone, so the result does not depend on the thread count or the batch.
template <typename E>
void gather_chunk_typed(const E* hidden, int64_t T, int64_t D, int has_cls, const int64_t* kept, int64_t K, E* out,
                        int64_t chunk, float* partial) {
  const int64_t N = T - has_cls;
  const int64_t r0 = chunk * kGatherChunkRows, r1 = std::min(N, r0 + kGatherChunkRows);
  const size_t row_bytes = static_cast<size_t>(D) * sizeof(E);
  Scratch& sc = scratch();
  std::fill(partial, partial + D, 0.0f);
  const E* pending[kRowBatch];
  int n_pending = 0;

  if (has_cls && chunk == 0) std::memcpy(out, hidden, row_bytes);
  const E* patches = hidden + has_cls * D;
  E* kept_out = out + has_cls * D;
  // kept is ascending, so one forward walk from the first kept index >= r0 pairs every row with its slot.
  int64_t j = std::lower_bound(kept, kept + K, r0) - kept;
  for (int64_t i = r0; i < r1; ++i) {
    const E* row = patches + i * D;
    if (j < K && kept[j] == i) {
      std::memcpy(kept_out + j * D, row, row_bytes);
      ++j;
    } else {
      pending[n_pending++] = row;
      if (n_pending == kRowBatch) {
        accumulate(partial, pending, D);
        n_pending = 0;
      }
    }
  }
  if (n_pending > 0) {  // zero rows pad the last, partial batch
    const E* zero = zero_row<E>(sc, static_cast<size_t>(D));
    for (int r = n_pending; r < kRowBatch; ++r) pending[r] = zero;
    accumulate(partial, pending, D);
  }
}

// The summary row's columns [c0, c1): the chunks' partial sums added in chunk order, over N - K.
template <typename E>
void write_summary_typed(const float* partials, int64_t chunks, int64_t D, int64_t pruned, E* row, int64_t c0,
                         int64_t c1) {
  float* acc = zeros(scratch().f0, static_cast<size_t>(c1 - c0));
  for (int64_t c = 0; c < chunks; ++c) {
    const float* p = partials + c * D + c0;
    for (int64_t i = 0; i < c1 - c0; ++i) acc[i] += p[i];
  }
  write_mean(acc, c1 - c0, static_cast<float>(pruned), row + c0);
}

// ------------------------------------------------------------------ scorer

// Symmetric per-vector int8 quantisation: x ~= s * qx, qx in [-127, 127].
// Division (not multiplication by 127 / max) is the contract the CUDA twin follows.
inline float quant_scale(float max_abs) { return max_abs > 0.0f ? max_abs / 127.0f : 1.0f; }

inline int32_t quantize(float x, float s) {
  const float r = std::nearbyint(x / s);
  return static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, r)));
}

// The rotation block of the int8 scorer: the largest power of two dividing dh, at most 64.
inline int64_t rotation_block(int64_t dh) { return std::min<int64_t>(dh & -dh, 64); }

// Unnormalised Walsh-Hadamard transform of x[0, n), n a power of two, in place. Adds and
// subtracts only, in this fixed butterfly order: the CUDA twin rounds every step alike.
inline void hadamard(float* x, int64_t n) {
  for (int64_t len = 1; len < n; len <<= 1) {
    for (int64_t i = 0; i < n; i += len << 1) {
      for (int64_t j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
}

// x[0, dh) -> every rotation block of x transformed; returns max |x|.
inline float rotate(float* x, int64_t dh, int64_t blk) {
  float m = 0.0f;
  for (int64_t d0 = 0; d0 < dh; d0 += blk) hadamard(x + d0, blk);
  for (int64_t d = 0; d < dh; ++d) m = std::max(m, std::fabs(x[d]));
  return m;
}

template <typename E>
void load_row(const E* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
}

// logits[t] = scale * q . k_t in fp32.
template <typename E>
void logits_fp(const float* q, const E* k, int64_t T, int64_t dh, int k_transposed, float scale, float* logits) {
  if (k_transposed) {  // k is [dh, T]: axpy over contiguous rows of T keys
    std::fill(logits, logits + T, 0.0f);
    for (int64_t d = 0; d < dh; ++d) {
      const E* kd = k + d * T;
      const float qd = q[d];
      for (int64_t t = 0; t < T; ++t) logits[t] += qd * to_f32(kd[t]);
    }
    for (int64_t t = 0; t < T; ++t) logits[t] *= scale;
  } else {  // k is [T, dh]: one dot product per key
    for (int64_t t = 0; t < T; ++t) {
      const E* kt = k + t * dh;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < dh; ++d) s += q[d] * to_f32(kt[d]);
      logits[t] = scale * s;
    }
  }
}

// Mean key vector over the T keys, accumulated in double so that every
// implementation (CPU, CUDA, the numpy model) rounds it to the same float.
template <typename E>
void key_mean(const E* k, int64_t T, int64_t dh, int k_transposed, float* mu) {
  for (int64_t d = 0; d < dh; ++d) {
    double s = 0.0;
    for (int64_t t = 0; t < T; ++t) s += to_f32(k_transposed ? k[d * T + t] : k[t * dh + d]);
    mu[d] = static_cast<float>(s / static_cast<double>(T));
  }
}

// The [CLS] query in two int8 limbs: q ~= s_q * hi + (s_q / 127) * lo, hi = round(q / s_q),
// lo = round((q - s_q * hi) / (s_q / 127)) (the residual by one fused multiply-add, so that
// no compiler's contraction choice changes it). qc = 127 * hi + lo, with |qc| <= 16193, so
// qc . k_int is 127 * (hi . k_int) + lo . k_int: two int8 dot products, exact in int32 for
// dh <= 1024. Returns s_q / 127, the step of qc.
inline float quantize_query(const float* q, int64_t dh, float q_max, int32_t* qc) {
  const float sq = quant_scale(q_max);
  const float step = sq / 127.0f;
  for (int64_t d = 0; d < dh; ++d) {
    const int32_t hi = quantize(q[d], sq);
    const float r = std::fma(-static_cast<float>(hi), sq, q[d]);
    qc[d] = 127 * hi + quantize(r, step);
  }
  return step;
}

// logits[t] = (scale / blk) * ((step_q * s_t) * (int32 dot of qc and the int8 rotated, centred k_t)).
// Centring the keys is exact for the softmax (q . mean_k shifts every logit of the row alike)
// and removes per-channel offsets; the Hadamard rotation (orthogonal up to blk, folded into
// the scale) spreads DINOv2's outlier channels over the block, so one per-key scale no longer
// spends its range on them; the query's second limb removes its rounding. On the pretrained
// DINOv2-S/14 this lifts the worst cell of tools/check_int8_scorer.py from 0.987 to >= 0.99.
template <typename E>
void logits_int8(const float* q, const E* k, int64_t T, int64_t dh, int k_transposed, float scale, float* logits) {
  Scratch& sc = scratch();
  const int64_t blk = rotation_block(dh);
  int32_t* qc = grow(sc.i0, static_cast<size_t>(dh));
  float* buf = grow(sc.f2, 3 * static_cast<size_t>(dh));
  float* qr = buf;
  float* mu = buf + dh;
  float* x = buf + 2 * dh;
  std::copy(q, q + dh, qr);
  const float step = quantize_query(qr, dh, rotate(qr, dh, blk), qc);
  const float scale_blk = scale / static_cast<float>(blk);
  key_mean(k, T, dh, k_transposed, mu);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t d = 0; d < dh; ++d) x[d] = to_f32(k_transposed ? k[d * T + t] : k[t * dh + d]) - mu[d];
    const float sk = quant_scale(rotate(x, dh, blk));
    int32_t dot = 0;
    for (int64_t d = 0; d < dh; ++d) dot += qc[d] * quantize(x[d], sk);
    logits[t] = scale_blk * ((step * sk) * static_cast<float>(dot));
  }
}

// scores[i] += softmax(logits)[has_cls + i], with the max subtracted for range.
void add_softmax(float* logits, int64_t T, int has_cls, float* scores) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < T; ++t) m = std::max(m, logits[t]);
  float sum = 0.0f;
  for (int64_t t = 0; t < T; ++t) {
    logits[t] = std::exp(logits[t] - m);
    sum += logits[t];
  }
  const float* p = logits + has_cls;
  for (int64_t i = 0; i < T - has_cls; ++i) scores[i] += p[i] / sum;
}

template <typename E>
void cls_scores_typed(const E* q, int64_t q_rows, const E* k, int64_t H, int64_t T, int64_t dh, int k_transposed,
                      float scale, int has_cls, int int8, float* scores) {
  Scratch& sc = scratch();
  float* qf = grow(sc.f0, static_cast<size_t>(dh));
  float* logits = grow(sc.f1, static_cast<size_t>(T));
  const int64_t N = T - has_cls;
  std::fill(scores, scores + N, 0.0f);
  for (int64_t h = 0; h < H; ++h) {
    load_row(q + h * q_rows * dh, dh, qf);  // row 0 of q[h]: the [CLS] query
    const E* kh = k + h * T * dh;
    if (int8) {
      logits_int8(qf, kh, T, dh, k_transposed, scale, logits);
    } else {
      logits_fp(qf, kh, T, dh, k_transposed, scale, logits);
    }
    add_softmax(logits, T, has_cls, scores);
  }
  const float heads = static_cast<float>(H);
  for (int64_t i = 0; i < N; ++i) scores[i] /= heads;
}

bool valid_dtype(vlmp_dtype dt) { return dt == VLMP_FLOAT32 || dt == VLMP_FLOAT16; }

}  // namespace

size_t dtype_size(vlmp_dtype dt) { return dt == VLMP_FLOAT16 ? 2u : 4u; }

vlmp_status check_select_args(const float* scores, int64_t B, int64_t N, int64_t K, const int64_t* kept) {
  if (B < 0 || K < 1 || K >= N) return VLMP_ERR_INVALID_ARGUMENT;
  if (B > 0 && (scores == nullptr || kept == nullptr)) return VLMP_ERR_INVALID_ARGUMENT;
  if (N > std::numeric_limits<int32_t>::max()) return VLMP_ERR_UNSUPPORTED;  // index packs into 32 bits
  return VLMP_OK;
}

vlmp_status check_gather_args(vlmp_dtype dt, const void* hidden, int64_t B, int64_t T, int64_t D, int has_cls,
                              const int64_t* kept, int64_t K, const void* out) {
  if (!valid_dtype(dt)) return VLMP_ERR_UNSUPPORTED;
  if (B < 0 || D < 1 || (has_cls != 0 && has_cls != 1)) return VLMP_ERR_INVALID_ARGUMENT;
  const int64_t N = T - has_cls;
  if (K < 1 || K >= N) return VLMP_ERR_INVALID_ARGUMENT;
  if (B > 0 && (hidden == nullptr || kept == nullptr || out == nullptr)) return VLMP_ERR_INVALID_ARGUMENT;
  // The single-pass walk needs every row of kept strictly ascending and in range.
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* row = kept + b * K;
    int64_t prev = -1;
    for (int64_t j = 0; j < K; ++j) {
      if (row[j] <= prev || row[j] >= N) return VLMP_ERR_INVALID_ARGUMENT;
      prev = row[j];
    }
  }
  return VLMP_OK;
}

vlmp_status check_scores_args(vlmp_dtype dt, const void* q, const void* k, int64_t B, int64_t H, int64_t T,
                              int64_t dh, int has_cls, const float* scores) {
  if (!valid_dtype(dt)) return VLMP_ERR_UNSUPPORTED;
  if (B < 0 || H < 1 || dh < 1 || (has_cls != 0 && has_cls != 1) || T - has_cls < 1) return VLMP_ERR_INVALID_ARGUMENT;
  if (B > 0 && (q == nullptr || k == nullptr || scores == nullptr)) return VLMP_ERR_INVALID_ARGUMENT;
  return VLMP_OK;
}

void select_topk_row(const float* scores, int64_t N, int64_t K, int64_t* kept) {
  uint64_t* keys = grow(scratch().keys, static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) keys[i] = rank_key(scores[i], i);
  std::nth_element(keys, keys + (K - 1), keys + N, std::greater<uint64_t>());
  // Keys are unique (they embed the index), so exactly K scores reach the K-th
  // key; a scan in index order emits them ascending without a second sort.
  const uint64_t kth = keys[K - 1];
  int64_t j = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (rank_key(scores[i], i) >= kth) kept[j++] = i;
  }
}

int64_t gather_chunks(int64_t N) { return (N + kGatherChunkRows - 1) / kGatherChunkRows; }

void gather_chunk(vlmp_dtype dt, const void* hidden, int64_t T, int64_t D, int has_cls, const int64_t* kept, int64_t K,
                  void* out, int64_t chunk, float* partial) {
  if (dt == VLMP_FLOAT16) {
    gather_chunk_typed(static_cast<const uint16_t*>(hidden), T, D, has_cls, kept, K, static_cast<uint16_t*>(out), chunk,
                       partial);
  } else {
    gather_chunk_typed(static_cast<const float*>(hidden), T, D, has_cls, kept, K, static_cast<float*>(out), chunk,
                       partial);
  }
}

void write_summary(vlmp_dtype dt, const float* partials, int64_t T, int64_t D, int has_cls, int64_t K, void* out,
                   int64_t c0, int64_t c1) {
  const int64_t N = T - has_cls, chunks = gather_chunks(N);
  const size_t row = static_cast<size_t>((has_cls + K) * D);
  if (dt == VLMP_FLOAT16) {
    write_summary_typed(partials, chunks, D, N - K, static_cast<uint16_t*>(out) + row, c0, c1);
  } else {
    write_summary_typed(partials, chunks, D, N - K, static_cast<float*>(out) + row, c0, c1);
  }
}

void cls_scores_image(vlmp_dtype dt, const void* q, int64_t q_rows, const void* k, int64_t H, int64_t T, int64_t dh,
                      int k_transposed, float scale, int has_cls, int int8, float* scores) {
  if (dt == VLMP_FLOAT16) {
    cls_scores_typed(static_cast<const uint16_t*>(q), q_rows, static_cast<const uint16_t*>(k), H, T, dh, k_transposed,
                     scale, has_cls, int8, scores);
  } else {
    cls_scores_typed(static_cast<const float*>(q), q_rows, static_cast<const float*>(k), H, T, dh, k_transposed, scale,
                     has_cls, int8, scores);
  }
}

}  // namespace cpu
}  // namespace vlmp

// ------------------------------------------------------------------ C ABI

extern "C" {

vlmp_status vlmp_select_topk_cpu(const float* scores, int64_t B, int64_t N, int64_t K, int64_t* kept) {
  const vlmp_status st = vlmp::cpu::check_select_args(scores, B, N, K, kept);
  if (st != VLMP_OK) return st;
  for (int64_t b = 0; b < B; ++b) vlmp::cpu::select_topk_row(scores + b * N, N, K, kept + b * K);
  return VLMP_OK;
}

vlmp_status vlmp_gather_summary_cpu(vlmp_dtype dt, const void* hidden, int64_t B, int64_t T, int64_t D, int has_cls,
                                    const int64_t* kept, int64_t K, void* out) {
  const vlmp_status st = vlmp::cpu::check_gather_args(dt, hidden, B, T, D, has_cls, kept, K, out);
  if (st != VLMP_OK) return st;
  const size_t es = vlmp::cpu::dtype_size(dt);
  const int64_t out_rows = has_cls + K + 1;
  const int64_t chunks = vlmp::cpu::gather_chunks(T - has_cls);
  std::vector<float> partials(static_cast<size_t>(chunks * D));
  for (int64_t b = 0; b < B; ++b) {
    const char* src = static_cast<const char*>(hidden) + static_cast<size_t>(b * T * D) * es;
    char* dst = static_cast<char*>(out) + static_cast<size_t>(b * out_rows * D) * es;
    for (int64_t c = 0; c < chunks; ++c) {
      vlmp::cpu::gather_chunk(dt, src, T, D, has_cls, kept + b * K, K, dst, c, partials.data() + c * D);
    }
    vlmp::cpu::write_summary(dt, partials.data(), T, D, has_cls, K, dst, 0, D);
  }
  return VLMP_OK;
}

vlmp_status vlmp_cls_scores_cpu(vlmp_dtype dt, const void* q, const void* k, int64_t B, int64_t H, int64_t T,
                                int64_t dh, int k_transposed, float scale, int has_cls, int int8, float* scores) {
  const vlmp_status st = vlmp::cpu::check_scores_args(dt, q, k, B, H, T, dh, has_cls, scores);
  if (st != VLMP_OK) return st;
  if (int8 && dh > 1024) return VLMP_ERR_UNSUPPORTED;  // the int32 dot of the two-limb query is exact up to 1024
  const size_t es = vlmp::cpu::dtype_size(dt);
  const size_t image = static_cast<size_t>(H * T * dh) * es;
  for (int64_t b = 0; b < B; ++b) {
    vlmp::cpu::cls_scores_image(dt, static_cast<const char*>(q) + b * image, T, static_cast<const char*>(k) + b * image,
                                H, T, dh, k_transposed, scale, has_cls, int8, scores + b * (T - has_cls));
  }
  return VLMP_OK;
}

}  // extern "C"
