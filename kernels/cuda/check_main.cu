// GPU check of the vlmprune kernels: the CUDA twins against the CPU kernels on the
// same inputs, and against the previous CUDA kernels (cuda/token_prune_v1.cu, the *_v1
// entry points: bit for bit where both are deterministic in the same order, within the
// CPU tolerance for the scorer, whose summation order changed), then timings of both side
// by side. Built and driven by tools/gpu_kernel_check.py:
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Iinclude -Icpu cuda/check_main.cu cuda/token_prune.cu \
//        cuda/token_prune_v1.cu cpu/*.cc
//   ./a.out [--reps 200] [--quick] [--no-timing]
//
// --no-timing: correctness checks only (what compute-sanitizer runs).
// Prints one JSON object on stdout; exits 1 when any correctness check fails.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "half.h"
#include "vlmprune/kernels.h"

// The previous kernels (cuda/token_prune_v1.cu): baseline for timings and results.
extern "C" {
vlmp_status vlmp_select_topk_cuda_v1(const float* scores, int64_t B, int64_t N, int64_t K, int64_t* kept, void* stream);
vlmp_status vlmp_gather_summary_cuda_v1(vlmp_dtype dt, const void* hidden, int64_t B, int64_t T, int64_t D,
                                        int has_cls, const int64_t* kept, int64_t K, void* out, void* stream);
vlmp_status vlmp_cls_scores_cuda_v1(vlmp_dtype dt, const void* q, const void* k, int64_t B, int64_t H, int64_t T,
                                    int64_t dh, int k_transposed, float scale, int has_cls, int int8, float* scores,
                                    void* stream);
vlmp_status vlmp_divprune_select_cuda_v1(const float* dist, int64_t B, int64_t N, int64_t K, int64_t* picks,
                                         void* stream);
}

namespace {

#define CUDA_CHECK(expr)                                                                                  \
  do {                                                                                                    \
    cudaError_t err_ = (expr);                                                                            \
    if (err_ != cudaSuccess) {                                                                            \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(err_), __FILE__, __LINE__, \
                   #expr);                                                                                \
      std::exit(2);                                                                                       \
    }                                                                                                     \
  } while (0)

// ------------------------------------------------------------------ inputs

struct Rng {  // splitmix64: deterministic on every platform
  uint64_t state;
  explicit Rng(uint64_t seed) : state(seed) {}
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(next() >> 40) / static_cast<float>(1ull << 24); }
  float normal() {
    const float u1 = std::max(uniform(), 1e-7f), u2 = uniform();
    return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.2831853f * u2);
  }
};

std::vector<float> normals(size_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = scale * rng.normal();
  return v;
}

// Scores from a few values only: the K-th boundary always sits inside a tie.
std::vector<float> tied_scores(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.next() % 7) / 7.0f;
  return v;
}

size_t elem_size(vlmp_dtype dt) { return dt == VLMP_FLOAT16 ? 2 : 4; }
const char* dtype_name(vlmp_dtype dt) { return dt == VLMP_FLOAT16 ? "fp16" : "fp32"; }

// Host tensor of dtype dt, stored as raw bytes.
std::vector<uint8_t> encode(const std::vector<float>& v, vlmp_dtype dt) {
  std::vector<uint8_t> bytes(v.size() * elem_size(dt));
  if (dt == VLMP_FLOAT32) {
    std::memcpy(bytes.data(), v.data(), bytes.size());
  } else {
    uint16_t* h = reinterpret_cast<uint16_t*>(bytes.data());
    for (size_t i = 0; i < v.size(); ++i) h[i] = vlmp::float_to_half(v[i]);
  }
  return bytes;
}

float decode(const std::vector<uint8_t>& bytes, vlmp_dtype dt, size_t i) {
  if (dt == VLMP_FLOAT32) {
    float f;
    std::memcpy(&f, bytes.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return vlmp::half_to_float(h);
}

struct DeviceMem {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceMem(size_t n) : bytes(n) { CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 1))); }
  ~DeviceMem() { cudaFree(ptr); }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  template <typename T>
  T* as(size_t byte_offset = 0) const { return reinterpret_cast<T*>(static_cast<char*>(ptr) + byte_offset); }
  void upload(const void* src, size_t n, size_t offset = 0) {
    CUDA_CHECK(cudaMemcpy(static_cast<char*>(ptr) + offset, src, n, cudaMemcpyHostToDevice));
  }
  void download(void* dst, size_t n, size_t offset = 0) const {
    CUDA_CHECK(cudaMemcpy(dst, static_cast<const char*>(ptr) + offset, n, cudaMemcpyDeviceToHost));
  }
};

// ------------------------------------------------------------------ report

struct Report {
  std::vector<std::string> checks, timings;
  int failures = 0;

  void check(const std::string& name, bool pass, const std::string& detail) {
    if (!pass) ++failures;
    checks.push_back("{\"name\": \"" + name + "\", \"pass\": " + (pass ? "true" : "false") +
                     (detail.empty() ? "" : ", " + detail) + "}");
    std::fprintf(stderr, "%s %s %s\n", pass ? "PASS" : "FAIL", name.c_str(), detail.c_str());
  }
};

std::string fmt(const char* f, double a) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, a);
  return buf;
}

std::string shape_name(const char* op, vlmp_dtype dt, int64_t B, int64_t N, int64_t D, int64_t K, int has_cls) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s %s B=%lld N=%lld D=%lld K=%lld cls=%d", op, dtype_name(dt),
                static_cast<long long>(B), static_cast<long long>(N), static_cast<long long>(D),
                static_cast<long long>(K), has_cls);
  return buf;
}

// ------------------------------------------------------------- correctness

struct PruneCase {
  vlmp_dtype dt;
  int64_t B, N, D, K;
  int has_cls;
  bool ties;
  size_t misalign;  // elements: a non-zero offset forces the scalar (1-element) gather path
};

void check_prune(Report& rep, const PruneCase& c, uint64_t seed) {
  const int64_t T = c.N + c.has_cls, out_rows = c.has_cls + c.K + 1;
  const size_t es = elem_size(c.dt);
  const std::vector<float> scores = c.ties ? tied_scores(c.B * c.N, seed) : normals(c.B * c.N, seed);
  const std::vector<uint8_t> hidden = encode(normals(c.B * T * c.D, seed + 1), c.dt);

  std::vector<int64_t> kept_cpu(c.B * c.K), kept_gpu(c.B * c.K);
  std::vector<uint8_t> out_cpu(c.B * out_rows * c.D * es), out_gpu(out_cpu.size());
  const vlmp_status s1 = vlmp_select_topk_cpu(scores.data(), c.B, c.N, c.K, kept_cpu.data());
  const vlmp_status s2 = vlmp_gather_summary_cpu(c.dt, hidden.data(), c.B, T, c.D, c.has_cls, kept_cpu.data(), c.K,
                                                 out_cpu.data());

  const size_t off = c.misalign * es;
  DeviceMem d_scores(scores.size() * 4), d_kept(kept_gpu.size() * 8), d_hidden(hidden.size() + off),
      d_out(out_gpu.size() + off);
  d_scores.upload(scores.data(), scores.size() * 4);
  d_hidden.upload(hidden.data(), hidden.size(), off);
  CUDA_CHECK(cudaMemset(d_out.ptr, 0xff, d_out.bytes));  // NaN-ish fill: unwritten rows cannot pass
  const vlmp_status g1 = vlmp_select_topk_cuda(d_scores.as<float>(), c.B, c.N, c.K, d_kept.as<int64_t>(), nullptr);
  const vlmp_status g2 = vlmp_gather_summary_cuda(c.dt, d_hidden.as<void>(off), c.B, T, c.D, c.has_cls,
                                                  d_kept.as<int64_t>(), c.K, d_out.as<void>(off), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  d_kept.download(kept_gpu.data(), kept_gpu.size() * 8);
  d_out.download(out_gpu.data(), out_gpu.size(), off);
  // The v1 selection and gather on the same inputs: the same kept list and bytes.
  std::vector<int64_t> kept_v1(kept_gpu.size());
  std::vector<uint8_t> out_v1(out_gpu.size());
  CUDA_CHECK(cudaMemset(d_out.ptr, 0xff, d_out.bytes));
  const vlmp_status v1 = vlmp_select_topk_cuda_v1(d_scores.as<float>(), c.B, c.N, c.K, d_kept.as<int64_t>(), nullptr);
  const vlmp_status v2 = vlmp_gather_summary_cuda_v1(c.dt, d_hidden.as<void>(off), c.B, T, c.D, c.has_cls,
                                                     d_kept.as<int64_t>(), c.K, d_out.as<void>(off), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  d_kept.download(kept_v1.data(), kept_v1.size() * 8);
  d_out.download(out_v1.data(), out_v1.size(), off);

  const std::string name = shape_name("prune", c.dt, c.B, c.N, c.D, c.K, c.has_cls) + (c.ties ? " ties" : "") +
                           (c.misalign ? " misaligned" : "");
  if (s1 || s2 || g1 || g2 || v1 || v2) {
    rep.check(name, false, "\"status\": [" + std::to_string(s1) + ", " + std::to_string(s2) + ", " +
                               std::to_string(g1) + ", " + std::to_string(g2) + ", " + std::to_string(v1) + ", " +
                               std::to_string(v2) + "]");
    return;
  }
  const bool same_as_v1 = kept_v1 == kept_gpu && out_v1 == out_gpu;
  int64_t kept_mismatch = 0;
  for (size_t i = 0; i < kept_cpu.size(); ++i) kept_mismatch += kept_cpu[i] != kept_gpu[i];
  // [CLS] and kept rows are copies: bit-exact. The summary row: fp32 sums in another order.
  int64_t copy_mismatch = 0;
  double summary_err = 0.0;
  bool summary_ok = true;
  for (int64_t b = 0; b < c.B; ++b) {
    const size_t row0 = static_cast<size_t>(b * out_rows * c.D);
    const size_t copy_bytes = static_cast<size_t>((out_rows - 1) * c.D) * es;
    copy_mismatch += std::memcmp(out_cpu.data() + row0 * es, out_gpu.data() + row0 * es, copy_bytes) != 0;
    for (int64_t d = 0; d < c.D; ++d) {
      const size_t i = row0 + static_cast<size_t>((out_rows - 1) * c.D + d);
      const double ref = decode(out_cpu, c.dt, i), got = decode(out_gpu, c.dt, i);
      const double err = std::fabs(ref - got);
      const double tol = c.dt == VLMP_FLOAT32 ? 1e-6 + 1e-5 * std::fabs(ref) : 1e-3 + 1e-3 * std::fabs(ref);
      summary_ok = summary_ok && err <= tol;  // also false for NaN
      summary_err = std::max(summary_err, err);
    }
  }
  rep.check(name, kept_mismatch == 0 && copy_mismatch == 0 && summary_ok && same_as_v1,
            "\"kept_mismatch\": " + std::to_string(kept_mismatch) + ", \"copied_rows_mismatch\": " +
                std::to_string(copy_mismatch) + ", \"summary_max_abs\": " + fmt("%.3g", summary_err) +
                ", \"bitwise_v1\": " + (same_as_v1 ? "true" : "false"));
}

struct ScoreCase {
  vlmp_dtype dt;
  int64_t B, H, T, dh;
  int k_transposed, has_cls, int8;
  size_t misalign = 0;  // elements k is offset by: forces the scalar-load path of the [T, dh] scorer
};

void check_scores(Report& rep, const ScoreCase& c, uint64_t seed) {
  const size_t n = static_cast<size_t>(c.B * c.H * c.T * c.dh);
  const std::vector<uint8_t> q = encode(normals(n, seed, 1.5f), c.dt), k = encode(normals(n, seed + 1), c.dt);
  const int64_t N = c.T - c.has_cls;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.dh));
  std::vector<float> cpu(c.B * N), gpu(c.B * N, NAN);
  const vlmp_status s = vlmp_cls_scores_cpu(c.dt, q.data(), k.data(), c.B, c.H, c.T, c.dh, c.k_transposed, scale,
                                            c.has_cls, c.int8, cpu.data());
  const size_t koff = c.misalign * elem_size(c.dt);
  DeviceMem dq(q.size()), dk(k.size() + koff), ds(gpu.size() * 4);
  dq.upload(q.data(), q.size());
  dk.upload(k.data(), k.size(), koff);
  void* kp = dk.as<void>(koff);
  CUDA_CHECK(cudaMemset(ds.ptr, 0xff, ds.bytes));  // NaN: unwritten scores cannot pass
  const vlmp_status g = vlmp_cls_scores_cuda(c.dt, dq.ptr, kp, c.B, c.H, c.T, c.dh, c.k_transposed, scale,
                                             c.has_cls, c.int8, ds.as<float>(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  ds.download(gpu.data(), gpu.size() * 4);
  // Deterministic: a second run gives the same bits.
  std::vector<float> again(gpu.size()), v1(gpu.size());
  CUDA_CHECK(cudaMemset(ds.ptr, 0xff, ds.bytes));
  const vlmp_status g2 = vlmp_cls_scores_cuda(c.dt, dq.ptr, kp, c.B, c.H, c.T, c.dh, c.k_transposed, scale,
                                              c.has_cls, c.int8, ds.as<float>(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  ds.download(again.data(), again.size() * 4);
  const vlmp_status g3 = vlmp_cls_scores_cuda_v1(c.dt, dq.ptr, kp, c.B, c.H, c.T, c.dh, c.k_transposed, scale,
                                                 c.has_cls, c.int8, ds.as<float>(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  ds.download(v1.data(), v1.size() * 4);
  char name[160];
  std::snprintf(name, sizeof name, "scores %s B=%lld H=%lld T=%lld dh=%lld %s%s cls=%d%s", dtype_name(c.dt),
                static_cast<long long>(c.B), static_cast<long long>(c.H), static_cast<long long>(c.T),
                static_cast<long long>(c.dh), c.k_transposed ? "kT" : "k", c.int8 ? " int8" : "", c.has_cls,
                c.misalign ? " misaligned" : "");
  if (s || g || g2 || g3) {
    rep.check(name, false, "\"status\": [" + std::to_string(s) + ", " + std::to_string(g) + ", " +
                               std::to_string(g2) + ", " + std::to_string(g3) + "]");
    return;
  }
  double max_rel = 0.0, max_rel_v1 = 0.0;
  bool ok = true;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double err = std::fabs(static_cast<double>(cpu[i]) - gpu[i]);
    const double err_v1 = std::fabs(static_cast<double>(v1[i]) - gpu[i]);
    ok = ok && err <= 1e-7 + 1e-4 * std::fabs(cpu[i]);  // exp/summation order only
    ok = ok && err_v1 <= 1e-7 + 1e-4 * std::fabs(v1[i]);
    max_rel = std::max(max_rel, err / std::max(1e-12, std::fabs(static_cast<double>(cpu[i]))));
    max_rel_v1 = std::max(max_rel_v1, err_v1 / std::max(1e-12, std::fabs(static_cast<double>(v1[i]))));
  }
  const bool deterministic = std::memcmp(gpu.data(), again.data(), gpu.size() * 4) == 0;
  rep.check(name, ok && deterministic,
            "\"max_rel\": " + fmt("%.3g", max_rel) + ", \"max_rel_v1\": " + fmt("%.3g", max_rel_v1) +
                ", \"deterministic\": " + (deterministic ? "true" : "false"));
}

// DivPrune distance matrices [B, N, N]. kCosine: 1 - cosine of random tokens (what the
// graph feeds the op); kRandom: asymmetric uniform values; kTied: a few levels, so every
// argmax meets ties; kEqual: all 0.5 (picks must be 0, 1, 2, ...); kInf: random with some
// off-diagonal +-inf (every candidate -inf after a -inf row: ties to index 0).
enum DistKind { kCosine, kRandom, kTied, kEqual, kInf };
const char* dist_kind_name(DistKind k) {
  static const char* names[] = {"cosine", "random", "tied", "equal", "inf"};
  return names[k];
}

std::vector<float> divprune_dist(DistKind kind, int64_t B, int64_t N, uint64_t seed) {
  const size_t nn = static_cast<size_t>(N * N);
  std::vector<float> d(static_cast<size_t>(B) * nn);
  Rng rng(seed);
  if (kind == kCosine) {
    const int64_t D = 32;
    std::vector<float> unit(static_cast<size_t>(N * D));
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < N; ++i) {
        float norm = 0.0f;
        for (int64_t e = 0; e < D; ++e) {
          unit[i * D + e] = rng.normal();
          norm += unit[i * D + e] * unit[i * D + e];
        }
        norm = std::max(std::sqrt(norm), 1e-12f);
        for (int64_t e = 0; e < D; ++e) unit[i * D + e] /= norm;
      }
      for (int64_t r = 0; r < N; ++r) {
        for (int64_t c = 0; c < N; ++c) {
          float dot = 0.0f;
          for (int64_t e = 0; e < D; ++e) dot += unit[r * D + e] * unit[c * D + e];
          d[b * nn + r * N + c] = 1.0f - dot;
        }
      }
    }
    return d;
  }
  for (size_t i = 0; i < d.size(); ++i) {
    const uint64_t u = rng.next();
    switch (kind) {
      case kTied: d[i] = static_cast<float>(u % 4) / 4.0f; break;
      case kEqual: d[i] = 0.5f; break;
      case kInf: d[i] = u % 20 == 0 ? -INFINITY : u % 20 == 1 ? INFINITY : rng.uniform(); break;
      default: d[i] = rng.uniform(); break;
    }
  }
  return d;
}

struct DivPruneCase {
  int64_t B, N, K;
  DistKind kind;
};

void check_divprune(Report& rep, const DivPruneCase& c, uint64_t seed) {
  const std::vector<float> dist = divprune_dist(c.kind, c.B, c.N, seed);
  std::vector<int64_t> cpu(static_cast<size_t>(c.B * c.K)), gpu(cpu.size(), -1);
  const vlmp_status s = vlmp_divprune_select_cpu(dist.data(), c.B, c.N, c.K, cpu.data());
  DeviceMem d_dist(dist.size() * 4), d_picks(gpu.size() * 8);
  d_dist.upload(dist.data(), dist.size() * 4);
  CUDA_CHECK(cudaMemset(d_picks.ptr, 0xff, d_picks.bytes));  // -1: unwritten picks cannot pass
  const vlmp_status g = vlmp_divprune_select_cuda(d_dist.as<float>(), c.B, c.N, c.K, d_picks.as<int64_t>(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  d_picks.download(gpu.data(), gpu.size() * 8);
  std::vector<int64_t> v1(gpu.size(), -1);
  CUDA_CHECK(cudaMemset(d_picks.ptr, 0xff, d_picks.bytes));
  const vlmp_status gv = vlmp_divprune_select_cuda_v1(d_dist.as<float>(), c.B, c.N, c.K, d_picks.as<int64_t>(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  d_picks.download(v1.data(), v1.size() * 8);
  char name[160];
  std::snprintf(name, sizeof name, "divprune %s B=%lld N=%lld K=%lld", dist_kind_name(c.kind),
                static_cast<long long>(c.B), static_cast<long long>(c.N), static_cast<long long>(c.K));
  if (s || g || gv) {
    rep.check(name, false, "\"status\": [" + std::to_string(s) + ", " + std::to_string(g) + ", " +
                               std::to_string(gv) + "]");
    return;
  }
  const bool same_as_v1 = v1 == gpu;
  int64_t mismatch = 0, first = -1, order_bad = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (cpu[i] != gpu[i]) {
      ++mismatch;
      if (first < 0) first = static_cast<int64_t>(i % c.K);  // the first step that differs
    }
    if (c.kind == kEqual) order_bad += cpu[i] != static_cast<int64_t>(i % c.K);  // all ties: 0, 1, 2, ...
  }
  rep.check(name, mismatch == 0 && order_bad == 0 && same_as_v1,
            "\"picks_mismatch\": " + std::to_string(mismatch) + ", \"first_bad_step\": " + std::to_string(first) +
                ", \"cpu_not_in_order\": " + std::to_string(order_bad) +
                ", \"bitwise_v1\": " + (same_as_v1 ? "true" : "false"));
}

void check_errors(Report& rep) {
  DeviceMem buf(1 << 20);
  float* f = buf.as<float>();
  int64_t* i = buf.as<int64_t>();
  struct {
    const char* name;
    vlmp_status got, want;
  } cases[] = {
      {"topk K=0", vlmp_select_topk_cuda(f, 1, 10, 0, i, nullptr), VLMP_ERR_INVALID_ARGUMENT},
      {"topk K=N", vlmp_select_topk_cuda(f, 1, 10, 10, i, nullptr), VLMP_ERR_INVALID_ARGUMENT},
      {"topk N>4096", vlmp_select_topk_cuda(f, 1, 4097, 10, i, nullptr), VLMP_ERR_UNSUPPORTED},
      {"topk null", vlmp_select_topk_cuda(nullptr, 1, 10, 3, i, nullptr), VLMP_ERR_INVALID_ARGUMENT},
      {"gather K=N", vlmp_gather_summary_cuda(VLMP_FLOAT32, f, 1, 11, 4, 1, i, 10, f, nullptr),
       VLMP_ERR_INVALID_ARGUMENT},
      {"gather N>4096", vlmp_gather_summary_cuda(VLMP_FLOAT32, f, 1, 4098, 4, 1, i, 10, f, nullptr),
       VLMP_ERR_UNSUPPORTED},
      {"gather dtype", vlmp_gather_summary_cuda(static_cast<vlmp_dtype>(7), f, 1, 11, 4, 1, i, 3, f, nullptr),
       VLMP_ERR_UNSUPPORTED},
      {"scores T>4097", vlmp_cls_scores_cuda(VLMP_FLOAT32, f, f, 1, 1, 4098, 4, 1, 1.0f, 1, 0, f, nullptr),
       VLMP_ERR_UNSUPPORTED},
      {"scores no patch", vlmp_cls_scores_cuda(VLMP_FLOAT32, f, f, 1, 1, 1, 4, 1, 1.0f, 1, 0, f, nullptr),
       VLMP_ERR_INVALID_ARGUMENT},
      {"divprune K=0", vlmp_divprune_select_cuda(f, 1, 10, 0, i, nullptr), VLMP_ERR_INVALID_ARGUMENT},
      {"divprune K>N", vlmp_divprune_select_cuda(f, 1, 10, 11, i, nullptr), VLMP_ERR_INVALID_ARGUMENT},
      {"divprune B=0", vlmp_divprune_select_cuda(f, 0, 10, 3, i, nullptr), VLMP_ERR_INVALID_ARGUMENT},
      {"divprune null", vlmp_divprune_select_cuda(f, 1, 10, 3, nullptr, nullptr), VLMP_ERR_INVALID_ARGUMENT},
      {"divprune N>4096", vlmp_divprune_select_cuda(f, 1, 4097, 10, i, nullptr), VLMP_ERR_UNSUPPORTED},
  };
  for (const auto& c : cases) {
    rep.check(std::string("status ") + c.name, c.got == c.want,
              "\"got\": " + std::to_string(c.got) + ", \"want\": " + std::to_string(c.want));
  }
  CUDA_CHECK(cudaDeviceSynchronize());
}

// ----------------------------------------------------------------- timing

// Average milliseconds of fn(rep) over reps, after warm-up, with CUDA events.
template <typename F>
double time_ms(F&& fn, int reps) {
  for (int r = 0; r < 5; ++r) fn(r);
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  CUDA_CHECK(cudaEventRecord(start));
  for (int r = 0; r < reps; ++r) fn(r);
  CUDA_CHECK(cudaEventRecord(stop));
  CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / reps;
}

// Enough copies of a buffer that successive reps miss the L2 cache (DRAM bandwidth,
// not L2 bandwidth, is what a real forward pass gets).
int rotation(size_t bytes, int l2_bytes) {
  return static_cast<int>(std::min<size_t>(64, std::max<size_t>(2, (4 * static_cast<size_t>(l2_bytes)) / bytes + 1)));
}

void time_prune(Report& rep, vlmp_dtype dt, int64_t B, int64_t N, int64_t D, int64_t K, int reps, int l2) {
  const int64_t T = N + 1, out_rows = K + 2;
  const size_t es = elem_size(dt);
  const size_t in_bytes = static_cast<size_t>(B * T * D) * es, out_bytes = static_cast<size_t>(B * out_rows * D) * es;
  const int copies = rotation(in_bytes, l2);
  DeviceMem hidden(in_bytes * copies), out(out_bytes * copies), scores(B * N * 4), kept(B * K * 8);
  CUDA_CHECK(cudaMemset(hidden.ptr, 0, hidden.bytes));
  const std::vector<float> s = tied_scores(B * N, 99);
  scores.upload(s.data(), s.size() * 4);
  const vlmp_status st = vlmp_select_topk_cuda(scores.as<float>(), B, N, K, kept.as<int64_t>(), nullptr);

  const double gather_ms = time_ms(
      [&](int r) {
        vlmp_gather_summary_cuda(dt, hidden.as<void>(in_bytes * (r % copies)), B, T, D, 1, kept.as<int64_t>(), K,
                                 out.as<void>(out_bytes * (r % copies)), nullptr);
      },
      reps);
  const double select_ms = time_ms(
      [&](int) { vlmp_select_topk_cuda(scores.as<float>(), B, N, K, kept.as<int64_t>(), nullptr); }, reps);
  const double select_v1_ms = time_ms(
      [&](int) { vlmp_select_topk_cuda_v1(scores.as<float>(), B, N, K, kept.as<int64_t>(), nullptr); }, reps);
  // One CPU thread on the same scores (best of a few: the figure to beat at B=1).
  std::vector<int64_t> kept_cpu(static_cast<size_t>(B * K));
  double select_cpu_ms = 1e30;
  for (int r = 0; r < 20; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    vlmp_select_topk_cpu(s.data(), B, N, K, kept_cpu.data());
    select_cpu_ms = std::min(
        select_cpu_ms, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  // The same traffic as one device-to-device copy: it reads and writes `half` bytes each.
  const size_t moved = in_bytes + out_bytes, half = moved / 2;
  const int mcopies = rotation(half, l2);
  DeviceMem src(half * mcopies), dst(half * mcopies);
  const double memcpy_ms = time_ms(
      [&](int r) {
        cudaMemcpyAsync(dst.as<char>(half * (r % mcopies)), src.as<char>(half * (r % mcopies)), half,
                        cudaMemcpyDeviceToDevice, nullptr);
      },
      reps);
  CUDA_CHECK(cudaGetLastError());
  char buf[640];
  std::snprintf(buf, sizeof buf,
                "{\"op\": \"gather_summary\", \"dtype\": \"%s\", \"B\": %lld, \"N\": %lld, \"D\": %lld, \"K\": %lld, "
                "\"status\": %d, \"ms\": %.5f, \"bytes\": %zu, \"gbps\": %.1f, \"memcpy_ms\": %.5f, "
                "\"memcpy_gbps\": %.1f, \"vs_memcpy\": %.3f, \"select_topk_ms\": %.5f, \"select_topk_v1_ms\": %.5f, "
                "\"select_topk_cpu_1thread_ms\": %.5f}",
                dtype_name(dt), static_cast<long long>(B), static_cast<long long>(N), static_cast<long long>(D),
                static_cast<long long>(K), static_cast<int>(st), gather_ms, moved, moved / gather_ms / 1e6, memcpy_ms,
                moved / memcpy_ms / 1e6, memcpy_ms / gather_ms, select_ms, select_v1_ms, select_cpu_ms);
  rep.timings.push_back(buf);
}

void time_scores(Report& rep, vlmp_dtype dt, int64_t B, int64_t H, int64_t T, int64_t dh, int k_transposed, int int8,
                 int reps) {
  const size_t bytes = static_cast<size_t>(B * H * T * dh) * elem_size(dt);
  DeviceMem q(bytes), k(bytes), s(B * T * 4);
  CUDA_CHECK(cudaMemset(q.ptr, 0, bytes));
  CUDA_CHECK(cudaMemset(k.ptr, 0, bytes));
  const double ms = time_ms(
      [&](int) {
        vlmp_cls_scores_cuda(dt, q.ptr, k.ptr, B, H, T, dh, k_transposed, 0.125f, 1, int8, s.as<float>(), nullptr);
      },
      reps);
  // The v1 kernel is slow (ms per call with int8): fewer repetitions.
  const double ms_v1 = time_ms(
      [&](int) {
        vlmp_cls_scores_cuda_v1(dt, q.ptr, k.ptr, B, H, T, dh, k_transposed, 0.125f, 1, int8, s.as<float>(), nullptr);
      },
      std::max(1, reps / 10));
  // Device copy of the key bytes, the bandwidth yardstick (read + write of `bytes` each).
  DeviceMem dst(bytes);
  const double copy_ms = time_ms(
      [&](int) { cudaMemcpyAsync(dst.ptr, k.ptr, bytes, cudaMemcpyDeviceToDevice, nullptr); }, reps);
  CUDA_CHECK(cudaGetLastError());
  char buf[480];
  std::snprintf(buf, sizeof buf,
                "{\"op\": \"cls_scores\", \"dtype\": \"%s\", \"B\": %lld, \"H\": %lld, \"T\": %lld, \"dh\": %lld, "
                "\"k_transposed\": %d, \"int8\": %d, \"ms\": %.5f, \"k_gbps\": %.1f, \"ms_v1\": %.5f, "
                "\"k_gbps_v1\": %.1f, \"copy_gbps\": %.1f}",
                dtype_name(dt), static_cast<long long>(B), static_cast<long long>(H), static_cast<long long>(T),
                static_cast<long long>(dh), k_transposed, int8, ms, bytes / ms / 1e6, ms_v1, bytes / ms_v1 / 1e6,
                2.0 * bytes / copy_ms / 1e6);
  rep.timings.push_back(buf);
}

// GPU milliseconds of one DivPrune call (dist stays in L2 at small B, as after the MatMul
// that produces it), and one single-threaded CPU call for scale.
void time_divprune(Report& rep, int64_t B, int64_t N, int64_t K, int reps) {
  const std::vector<float> dist = divprune_dist(kCosine, B, N, 7);
  DeviceMem d_dist(dist.size() * 4), d_picks(static_cast<size_t>(B * K) * 8);
  d_dist.upload(dist.data(), dist.size() * 4);
  const vlmp_status st = vlmp_divprune_select_cuda(d_dist.as<float>(), B, N, K, d_picks.as<int64_t>(), nullptr);
  const double ms = time_ms(
      [&](int) { vlmp_divprune_select_cuda(d_dist.as<float>(), B, N, K, d_picks.as<int64_t>(), nullptr); }, reps);
  const double ms_v1 = time_ms(
      [&](int) { vlmp_divprune_select_cuda_v1(d_dist.as<float>(), B, N, K, d_picks.as<int64_t>(), nullptr); }, reps);
  CUDA_CHECK(cudaGetLastError());
  std::vector<int64_t> picks(static_cast<size_t>(B * K));
  double cpu_ms = 1e30;  // best of three single-threaded calls
  for (int r = 0; r < 3; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    vlmp_divprune_select_cpu(dist.data(), B, N, K, picks.data());
    cpu_ms = std::min(cpu_ms, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "{\"op\": \"divprune_select\", \"B\": %lld, \"N\": %lld, \"K\": %lld, \"status\": %d, "
                "\"ms\": %.5f, \"ms_v1\": %.5f, \"cpu_1thread_ms\": %.4f}",
                static_cast<long long>(B), static_cast<long long>(N), static_cast<long long>(K), static_cast<int>(st),
                ms, ms_v1, cpu_ms);
  rep.timings.push_back(buf);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 200;
  bool quick = false, timing = true;
  for (int a = 1; a < argc; ++a) {
    if (!std::strcmp(argv[a], "--reps") && a + 1 < argc) reps = std::atoi(argv[++a]);
    if (!std::strcmp(argv[a], "--quick")) quick = true;
    if (!std::strcmp(argv[a], "--no-timing")) timing = false;
  }
  int dev = 0, l2 = 0;
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));

  Report rep;
  const vlmp_dtype dtypes[] = {VLMP_FLOAT32, VLMP_FLOAT16};
  uint64_t seed = 1;
  for (vlmp_dtype dt : dtypes) {
    for (int64_t B : {1, 8}) {
      for (int64_t N : {576, 1024}) {
        const int64_t K = N == 576 ? 192 : 256;
        check_prune(rep, {dt, B, N, 1024, K, 1, true, 0}, seed++);
        check_prune(rep, {dt, B, N, 1024, K, 1, false, 0}, seed++);
      }
    }
    // Shapes that take the narrow, tail and padding paths.
    check_prune(rep, {dt, 2, 10, 37, 1, 1, true, 0}, seed++);
    check_prune(rep, {dt, 2, 10, 36, 9, 0, true, 0}, seed++);
    check_prune(rep, {dt, 3, 4096, 64, 1000, 1, true, 0}, seed++);
    check_prune(rep, {dt, 3, 4096, 64, 4095, 0, false, 0}, seed++);
    check_prune(rep, {dt, 2, 577, 1000, 192, 1, true, 0}, seed++);
    check_prune(rep, {dt, 2, 576, 1024, 192, 1, true, 1}, seed++);
    check_prune(rep, {dt, 70, 100, 24, 33, 1, true, 0}, seed++);
    for (int64_t B : {1, 8}) {
      for (int64_t T : {577, 1025}) {
        for (int kt = 0; kt < 2; ++kt) {
          for (int int8 = 0; int8 < 2; ++int8) check_scores(rep, {dt, B, 16, T, 64, kt, 1, int8}, seed++);
        }
      }
    }
    check_scores(rep, {dt, 2, 3, 50, 40, 1, 0, 0}, seed++);
    check_scores(rep, {dt, 2, 3, 4097, 80, 0, 1, 1}, seed++);
    // int8 rotation blocks other than 64: dh = 72 (blocks of 8), 128 (two of 64), 1 (no rotation)
    check_scores(rep, {dt, 2, 6, 257, 72, 1, 1, 1}, seed++);
    check_scores(rep, {dt, 2, 4, 257, 128, 0, 1, 1}, seed++);
    check_scores(rep, {dt, 1, 2, 33, 1, 1, 1, 1}, seed++);
    // The cluster scorer's edges: T = 4097 over 16 ranks of 257 keys (B=1), ranks ending
    // mid-warp (T=100), dh not a multiple of the 16-byte load (scalar path), a misaligned k,
    // more heads than one group holds (dh = 1024: groups of a few heads, int8 of two).
    check_scores(rep, {dt, 1, 12, 4097, 64, 0, 1, 0}, seed++);
    check_scores(rep, {dt, 1, 12, 4097, 64, 1, 1, 1}, seed++);
    check_scores(rep, {dt, 3, 5, 100, 50, 0, 0, 0}, seed++);
    check_scores(rep, {dt, 2, 4, 577, 64, 0, 1, 0, 1}, seed++);
    check_scores(rep, {dt, 2, 16, 300, 1024, 0, 1, 0}, seed++);
    check_scores(rep, {dt, 2, 16, 300, 1024, 1, 1, 1}, seed++);
    check_scores(rep, {dt, 1, 3, 1025, 96, 0, 1, 1}, seed++);
  }
  // TopK at K == 1 and K == N - 1 on B=1, and tied rows at the selection's 4096 limit.
  check_prune(rep, {VLMP_FLOAT32, 1, 576, 64, 1, 1, true, 0}, seed++);
  check_prune(rep, {VLMP_FLOAT32, 1, 576, 64, 575, 1, true, 0}, seed++);
  check_prune(rep, {VLMP_FLOAT32, 8, 4096, 16, 1, 0, true, 0}, seed++);
  // DivPrune: the ONNX graph's shapes (N = 576 patches), every block size path (N below,
  // at and above 1024 threads, up to the 4096 limit), K == 1, K == N, and exact ties.
  const DivPruneCase divprune_cases[] = {
      {1, 1, 1, kRandom},      {3, 2, 2, kRandom},     {3, 7, 7, kTied},      {2, 7, 3, kEqual},
      {1, 576, 1, kCosine},    {1, 576, 192, kCosine}, {8, 576, 192, kCosine}, {3, 576, 576, kTied},
      {3, 576, 64, kRandom},   {2, 576, 100, kInf},    {2, 33, 33, kEqual},   {2, 1000, 333, kRandom},
      {2, 1024, 256, kCosine}, {2, 1025, 300, kTied},  {2, 2304, 576, kCosine}, {2, 4096, 1024, kRandom},
      {1, 4096, 4096, kTied},
  };
  for (const DivPruneCase& c : divprune_cases) check_divprune(rep, c, seed++);
  check_errors(rep);

  const int treps = quick ? 20 : reps;
  if (timing) {
    for (vlmp_dtype dt : dtypes) {
      for (int64_t B : {1, 8}) {
        for (int64_t N : {576, 1024}) time_prune(rep, dt, B, N, 1024, N == 576 ? 192 : 256, treps, l2);
      }
      for (int64_t B : {8, 1}) {
        for (int kt = 0; kt < 2; ++kt) {
          for (int int8 = 0; int8 < 2; ++int8) time_scores(rep, dt, B, 16, 1025, 64, kt, int8, treps);
        }
      }
    }
    const int64_t divprune_timed[][3] = {{1, 576, 64}, {1, 576, 192}, {8, 576, 192}, {8, 1024, 256}, {1, 4096, 1024}};
    for (const auto& t : divprune_timed) time_divprune(rep, t[0], t[1], t[2], std::max(1, treps / 10));
  }

  std::printf("{\"device\": \"%s\", \"sm\": \"%d%d\", \"l2_bytes\": %d, \"failures\": %d,\n \"checks\": [\n  ",
              prop.name, prop.major, prop.minor, l2, rep.failures);
  for (size_t i = 0; i < rep.checks.size(); ++i) std::printf("%s%s", i ? ",\n  " : "", rep.checks[i].c_str());
  std::printf("],\n \"timings\": [\n  ");
  for (size_t i = 0; i < rep.timings.size(); ++i) std::printf("%s%s", i ? ",\n  " : "", rep.timings[i].c_str());
  std::printf("]}\n");
  return rep.failures == 0 ? 0 : 1;
}
