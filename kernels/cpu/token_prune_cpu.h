// Internal C++ entry points of the CPU kernels, one image (row) at a time.
//
// The C ABI in vlmprune/kernels.h loops over the batch; callers with a thread
// pool (the ONNX Runtime op) call these directly to split a batch, or one
// image's rows, over threads. Validation is separate so it runs once per call.
#ifndef VLMPRUNE_CPU_TOKEN_PRUNE_CPU_H
#define VLMPRUNE_CPU_TOKEN_PRUNE_CPU_H

#include "vlmprune/kernels.h"

namespace vlmp {
namespace cpu {

size_t dtype_size(vlmp_dtype dt);

// Argument checks shared by the C ABI and the ORT op.
vlmp_status check_select_args(const float* scores, int64_t B, int64_t N, int64_t K, const int64_t* kept);
vlmp_status check_gather_args(vlmp_dtype dt, const void* hidden, int64_t B, int64_t T, int64_t D, int has_cls,
                              const int64_t* kept, int64_t K, const void* out);
vlmp_status check_scores_args(vlmp_dtype dt, const void* q, const void* k, int64_t B, int64_t H, int64_t T,
                              int64_t dh, int has_cls, const float* scores);

// DivPrune (cpu/divprune.cc): checks of the C ABI's arguments, and the greedy picks of
// one image: dist [N, N] -> picks [K] in pick order (1 <= K <= N, validated).
vlmp_status check_divprune_args(const float* dist, int64_t B, int64_t N, int64_t K, const int64_t* picks);
void divprune_select_image(const float* dist, int64_t N, int64_t K, int64_t* picks);

// TopK of one row of N scores, ties to the lower index, written ascending to kept[0..K).
void select_topk_row(const float* scores, int64_t N, int64_t K, int64_t* kept);

// Gather + summary of one image, in chunks of kGatherChunkRows patch rows that a pool can
// run in any order: hidden [T, D], kept [K] (validated), out [has_cls + K + 1, D].
// gather_chunk writes chunk c's kept rows (chunk 0 also [CLS]) and the fp32 sum of its
// pruned rows to partial [D]; write_summary then adds the gather_chunks(N) partials
// [chunks, D] in chunk order and writes the summary row's columns [c0, c1). The chunk
// size alone fixes the order of the sum, so every caller gets the same bits.
constexpr int64_t kGatherChunkRows = 32;
int64_t gather_chunks(int64_t N);
void gather_chunk(vlmp_dtype dt, const void* hidden, int64_t T, int64_t D, int has_cls, const int64_t* kept, int64_t K,
                  void* out, int64_t chunk, float* partial);
void write_summary(vlmp_dtype dt, const float* partials, int64_t T, int64_t D, int has_cls, int64_t K, void* out,
                   int64_t c0, int64_t c1);

// [CLS]-row scores of one image: q [H, q_rows, dh] (row 0 read; q_rows is T in the C ABI,
// 1 when a graph hands over only the [CLS] query), k [H, T, dh] or [H, dh, T]; scores [T - has_cls].
void cls_scores_image(vlmp_dtype dt, const void* q, int64_t q_rows, const void* k, int64_t H, int64_t T, int64_t dh,
                      int k_transposed, float scale, int has_cls, int int8, float* scores);

}  // namespace cpu
}  // namespace vlmp

#endif  // VLMPRUNE_CPU_TOKEN_PRUNE_CPU_H
