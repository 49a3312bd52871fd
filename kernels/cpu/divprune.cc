// CPU kernel of DivPrune's greedy max-min selection (semantics: include/vlmprune/kernels.h).
//
// Exactness: only fp32 comparisons and minima, which round nothing, so the picks are
// bitwise those of the standard-op ONNX graph. Keep the build free of -ffast-math.
#include <limits>
#include <vector>

#include "token_prune_cpu.h"

namespace vlmp {
namespace cpu {
namespace {

// Per-thread running minimum, grown on demand: repeated calls stay off the heap.
float* running_buffer(int64_t N) {
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(N)) buf.resize(static_cast<size_t>(N));
  return buf.data();
}

// m = min(m, v) elementwise, written as the compare-select the graph's Min computes.
void min_into(float* __restrict m, const float* __restrict v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) m[i] = v[i] < m[i] ? v[i] : m[i];
}

// First index of the maximum (ArgMax with select_last_index=0). Index 0 when every value
// is -inf; with NaN some in-range index (undefined, as the header says).
int64_t argmax_first(const float* v, int64_t n) {
  int64_t best = 0;
  float bv = v[0];
  for (int64_t i = 1; i < n; ++i) {
    if (v[i] > bv) {
      bv = v[i];
      best = i;
    }
  }
  return best;
}

}  // namespace

vlmp_status check_divprune_args(const float* dist, int64_t B, int64_t N, int64_t K, const int64_t* picks) {
  if (B < 1 || K < 1 || K > N || dist == nullptr || picks == nullptr) return VLMP_ERR_INVALID_ARGUMENT;
  if (N > std::numeric_limits<int32_t>::max()) return VLMP_ERR_UNSUPPORTED;  // N * N must not overflow
  return VLMP_OK;
}

void divprune_select_image(const float* dist, int64_t N, int64_t K, int64_t* picks) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float* run = running_buffer(N);

  // Step 0: column minima off the diagonal, in one row-major pass (rows stream through
  // once; each row is split around its diagonal element so the inner loops vectorise).
  for (int64_t c = 0; c < N; ++c) run[c] = kInf;
  for (int64_t r = 0; r < N; ++r) {
    const float* row = dist + r * N;
    min_into(run, row, r);
    min_into(run + r + 1, row + r + 1, N - r - 1);
  }
  int64_t p = argmax_first(run, N);
  picks[0] = p;
  if (K == 1) return;

  // A picked token's running value is set to -inf, which min() keeps: that is exactly the
  // contract's "candidate = -inf if picked", with one array instead of a mask.
  const float* row = dist + p * N;
  for (int64_t c = 0; c < N; ++c) run[c] = row[c];
  run[p] = -kInf;
  for (int64_t k = 1; k < K; ++k) {
    p = argmax_first(run, N);
    picks[k] = p;
    if (k + 1 == K) break;
    min_into(run, dist + p * N, N);
    run[p] = -kInf;
  }
}

}  // namespace cpu
}  // namespace vlmp

extern "C" vlmp_status vlmp_divprune_select_cpu(const float* dist, int64_t B, int64_t N, int64_t K, int64_t* picks) {
  const vlmp_status st = vlmp::cpu::check_divprune_args(dist, B, N, K, picks);
  if (st != VLMP_OK) return st;
  for (int64_t b = 0; b < B; ++b) vlmp::cpu::divprune_select_image(dist + b * N * N, N, K, picks + b * K);
  return VLMP_OK;
}
