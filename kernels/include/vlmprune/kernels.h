/* vlmprune kernels: one C ABI shared by the ONNX Runtime custom op and the TensorRT plugins.
 *
 * Semantics are shared/DESIGN.md's "Pruning semantics"; the Python reference is
 * vlmprune.compiler.reference. All tensors are dense, row-major, contiguous.
 * Every function returns VLMP_OK or an error code; none allocates on the device
 * and none synchronises the host (CUDA entry points only enqueue on `stream`).
 */
#ifndef VLMPRUNE_KERNELS_H
#define VLMPRUNE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum vlmp_status {
  VLMP_OK = 0,
  VLMP_ERR_INVALID_ARGUMENT = 1, /* shapes or K out of range, null pointers */
  VLMP_ERR_UNSUPPORTED = 2,      /* dtype or size this build does not handle (e.g. N > 4096 on CUDA) */
  VLMP_ERR_CUDA = 3              /* a CUDA launch failed; cudaGetLastError() has the reason */
} vlmp_status;

typedef enum vlmp_dtype { VLMP_FLOAT32 = 0, VLMP_FLOAT16 = 1 } vlmp_dtype;

/* Selection. scores [B, N] fp32 -> kept [B, K] int64.
 * TopK(K) per row; equal scores are broken towards the lower index; the K kept
 * indices are then written in ascending order. Requires 1 <= K < N. */
vlmp_status vlmp_select_topk_cpu(const float* scores, int64_t B, int64_t N, int64_t K, int64_t* kept);

/* Gather + summary. hidden [B, T, D] with T = has_cls + N (dtype dt),
 * kept [B, K] int64 ascending and unique, each in [0, N).
 * out [B, has_cls + K + 1, D] (dtype dt): the [CLS] token if has_cls, the kept
 * patch tokens in the order of kept, then the unweighted mean of the N - K
 * patch tokens not kept (accumulated in fp32). Each input token is read once. */
vlmp_status vlmp_gather_summary_cpu(vlmp_dtype dt, const void* hidden, int64_t B, int64_t T, int64_t D,
                                    int has_cls, const int64_t* kept, int64_t K, void* out);

/* [CLS]-row attention score, averaged over heads.
 * q [B, H, T, dh] (only row 0 is read), k [B, H, T, dh], or k [B, H, dh, T] when
 * k_transposed != 0 (the layout of the operand of the graph's Q·Kᵀ MatMul).
 * logits_h = scale * (q[b,h,0,:] · k[b,h,t,:]); a_h = softmax over all T keys;
 * scores[b, i] = mean_h a_h[has_cls + i] for i in [0, T - has_cls).
 * int8 != 0: the decision in INT8, every step in fp32 unless said otherwise:
 *   1. the keys are centred: their mean over the T keys (accumulated in double) is
 *      subtracted, which is exact for the softmax and removes per-channel offsets;
 *   2. the q row and each centred key are rotated by the unnormalised Walsh-Hadamard
 *      transform over blocks of blk = min(largest power of two dividing dh, 64) channels
 *      (butterflies of adds and subtracts in a fixed order; the factor blk is folded into
 *      the scale): it spreads outlier channels (pretrained DINOv2 has them) over the block,
 *      so that one scale per key no longer spends its int8 range on them;
 *   3. each rotated key is quantised symmetric per vector: s_t = max|x| / 127,
 *      k_int = clamp(round(x / s_t), -127, 127) (round half to even, division not reciprocal);
 *   4. the rotated q row is quantised in two int8 limbs with s_q = max|q| / 127:
 *      hi = round(q / s_q), lo = round(fma(-hi, s_q, q) / (s_q / 127)), qc = 127 * hi + lo;
 *   5. dot_t = sum_d qc_d * k_int,t,d in int32 (= 127 * hi.k_int + lo.k_int: two int8
 *      dot products; exact for dh <= 1024, larger dh is VLMP_ERR_UNSUPPORTED);
 *      logits_t = (scale / blk) * (((s_q / 127) * s_t) * dot_t); softmax as above.
 *   CPU and CUDA round every step 2-5 alike (bit-identical logits for the same mean key; the
 *   CUDA kernel sums the mean in another fixed order, and the softmax too: see
 *   kernels/README.md, "CUDA kernels"). On the pretrained
 *   DINOv2-S/14 (tools/check_int8_scorer.py) this keeps >= 0.99 of fp32's kept indices in
 *   every block and K measured, where per-vector int8 of q and centred keys alone fell to 0.987. */
vlmp_status vlmp_cls_scores_cpu(vlmp_dtype dt, const void* q, const void* k, int64_t B, int64_t H, int64_t T,
                                int64_t dh, int k_transposed, float scale, int has_cls, int int8, float* scores);

/* DivPrune greedy selection (max-min diversity). dist [B, N, N] fp32, dist[b, r, c],
 * arbitrary (not assumed symmetric) -> picks [B, K] int64 in pick order (not sorted).
 * Requires B >= 1 and 1 <= K <= N. Per image, with argmax ties to the lowest index:
 *   pick_0 = argmax_c min_{r != c} dist[r, c]   (a column minimum off the diagonal; +inf when N == 1)
 *   running[c] = dist[pick_0, c]                 (the picked token's row)
 *   pick_k = argmax_c (c picked ? -inf : running[c]), then running[c] = min(running[c], dist[pick_k, c]).
 * fp32 comparisons and minima only, so for finite dist the picks are exactly those of the
 * ONNX graph (ReduceMin of dist + diag(+inf) over axis 1, ArgMax, GatherElements, Min,
 * ScatterElements of -inf), also with -inf off the diagonal: when every candidate is -inf
 * the lowest index wins, even an already picked one, as in that graph (whose Add of the
 * -inf mask would turn +inf entries into NaN; here +inf is an ordinary value).
 * NaN in dist gives undefined (but in-range) picks. */
vlmp_status vlmp_divprune_select_cpu(const float* dist, int64_t B, int64_t N, int64_t K, int64_t* picks);

/* CUDA twins: same arguments and semantics, device pointers, enqueued on stream
 * (a cudaStream_t passed as void*). vlmp_select_topk_cuda and vlmp_divprune_select_cuda
 * handle N <= 4096. */
vlmp_status vlmp_select_topk_cuda(const float* scores, int64_t B, int64_t N, int64_t K, int64_t* kept, void* stream);
vlmp_status vlmp_gather_summary_cuda(vlmp_dtype dt, const void* hidden, int64_t B, int64_t T, int64_t D,
                                     int has_cls, const int64_t* kept, int64_t K, void* out, void* stream);
vlmp_status vlmp_cls_scores_cuda(vlmp_dtype dt, const void* q, const void* k, int64_t B, int64_t H, int64_t T,
                                 int64_t dh, int k_transposed, float scale, int has_cls, int int8, float* scores,
                                 void* stream);
vlmp_status vlmp_divprune_select_cuda(const float* dist, int64_t B, int64_t N, int64_t K, int64_t* picks,
                                      void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* VLMPRUNE_KERNELS_H */
