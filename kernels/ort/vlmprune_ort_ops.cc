// ONNX Runtime custom-op library, domain "vlmprune":
//   TokenPrune(hidden [B,T,D] f32|f16, scores [B,N] f32; keep, has_cls)
//       -> tokens [B, has_cls+keep+1, D], kept_indices [B, keep] int64
//   ClsAttentionScore(q [B,H,T|1,dh], k [B,H,dh,T] | [B,H,T,dh]; scale, has_cls, int8, k_transposed)
//       -> scores [B, T-has_cls] f32
//   DivPruneSelect(dist [B,N,N] f32; keep) -> picks [B, keep] int64, in pick order
// and, domain "trt.plugins", the TensorRT plugin node's host-side twin:
//   VlmpTokenPrune(hidden, scores; keep, has_cls, plugin_version "1", plugin_namespace "vlmprune")
//   VlmpClsScore(q, k; scale, has_cls, int8, k_transposed, plugin_version "1", plugin_namespace "vlmprune")
//       the same kernels as TokenPrune and ClsAttentionScore, so the TensorRT targets' model.onnx runs here for parity
//       (the plugin itself, kernels/trt, runs the CUDA twins of the same kernels).
// All run the CPU kernels of kernels/cpu over ONNX Runtime's intra-op thread pool.
// The library also exports the vlmp_* C functions (see the build's version script).
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/plugin_names.h"
#include "token_prune_cpu.h"
#include "vlmprune/kernels.h"

namespace {

constexpr const char* kDomain = "vlmprune";
// The TensorRT plugin contract, from the header the plugins themselves use.
constexpr const char* kPluginDomain = "trt.plugins";
constexpr const char* kPluginName = vlmprune::trt::kTokenPruneName;
constexpr const char* kPluginVersion = vlmprune::trt::kTokenPruneVersion;
constexpr const char* kPluginNamespace = vlmprune::trt::kTokenPruneNamespace;
// CreateKernelV2/KernelComputeV2 arrived with API 16, KernelContext_ParallelFor with 17.
constexpr uint32_t kMinApiVersion = 17;

// ------------------------------------------------------------------- errors

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

[[noreturn]] void fail(const char* op, const std::string& message) {
  throw Ort::Exception(std::string("vlmprune.") + op + ": " + message, ORT_INVALID_ARGUMENT);
}

// Exceptions must not cross the C boundary into ONNX Runtime: turn them into statuses.
template <typename F>
OrtStatusPtr guarded(const char* op, F&& body) {
  try {
    body();
    return nullptr;
  } catch (const Ort::Exception& e) {
    return Ort::Status(e).release();
  } catch (const std::exception& e) {
    return Ort::Status((std::string("vlmprune.") + op + ": " + e.what()).c_str(), ORT_FAIL).release();
  }
}

// ------------------------------------------------------------- attributes

int64_t attr_int(const OrtApi& api, const OrtKernelInfo* info, const char* op, const char* name, bool required,
                 int64_t fallback) {
  int64_t value = 0;
  if (OrtStatus* st = api.KernelInfoGetAttribute_int64(info, name, &value)) {
    api.ReleaseStatus(st);
    if (required) fail(op, std::string("attribute '") + name + "' (int) is required");
    return fallback;
  }
  return value;
}

float attr_float(const OrtApi& api, const OrtKernelInfo* info, const char* name, float fallback) {
  float value = 0.0f;
  if (OrtStatus* st = api.KernelInfoGetAttribute_float(info, name, &value)) {
    api.ReleaseStatus(st);
    return fallback;
  }
  return value;
}

// A string attribute, if present, must equal `expected` (absent: TensorRT's parser defaults apply).
void expect_string(const OrtApi& api, const OrtKernelInfo* info, const char* op, const char* name,
                   const char* expected) {
  size_t size = 0;
  if (OrtStatus* st = api.KernelInfoGetAttribute_string(info, name, nullptr, &size)) {
    api.ReleaseStatus(st);
    return;
  }
  std::string value(size, '\0');
  if (OrtStatus* st = api.KernelInfoGetAttribute_string(info, name, &value[0], &size)) {
    api.ReleaseStatus(st);
    fail(op, std::string("cannot read attribute '") + name + "'");
  }
  value.resize(size > 0 ? size - 1 : 0);  // size counts the terminating NUL
  if (value != expected) {
    fail(op, std::string("attribute '") + name + "' is '" + value + "', this library implements '" + expected + "'");
  }
}

int attr_flag(const OrtApi& api, const OrtKernelInfo* info, const char* op, const char* name, int64_t fallback) {
  const int64_t v = attr_int(api, info, op, name, false, fallback);
  if (v != 0 && v != 1) fail(op, std::string("attribute '") + name + "' must be 0 or 1, got " + std::to_string(v));
  return static_cast<int>(v);
}

// ------------------------------------------------------------------ helpers

vlmp_dtype dtype_of(ONNXTensorElementDataType t, const char* op, const char* input) {
  if (t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) return VLMP_FLOAT32;
  if (t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) return VLMP_FLOAT16;
  fail(op, std::string("input '") + input + "' must be float or float16, got ONNX element type " + std::to_string(t));
}

// Runs f(0..n-1) on ONNX Runtime's intra-op pool; f must not throw.
template <typename F>
void parallel_for(const Ort::KernelContext& ctx, size_t n, F& f) {
  if (n == 1) {
    f(0);
    return;
  }
  ctx.ParallelFor([](void* user, size_t i) { (*static_cast<F*>(user))(i); }, n, 0, &f);
}

// Column blocks per image for the summary row: about two tasks per hardware thread, but
// whole rows as soon as the batch alone feeds the pool, and blocks of >= 256 columns otherwise.
int64_t column_blocks(int64_t B, int64_t D) {
  static const int64_t target_tasks = 2 * std::max<int64_t>(1, std::thread::hardware_concurrency());
  constexpr int64_t kMinColumns = 256;
  const int64_t want = (target_tasks + B - 1) / B;
  return std::max<int64_t>(1, std::min(want, D / kMinColumns));
}

// ---------------------------------------------------------------- TokenPrune

constexpr const char* kTokenPrune = "TokenPrune";

struct TokenPruneKernel {
  TokenPruneKernel(const OrtApi& api, const OrtKernelInfo* info, const char* op = kTokenPrune)
      : op_(op),
        keep_(attr_int(api, info, op, "keep", true, 0)),
        has_cls_(attr_flag(api, info, op, "has_cls", 1)) {
    if (keep_ < 1) fail(op_, "attribute 'keep' must be >= 1, got " + std::to_string(keep_));
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded(op_, [&] { Compute(Ort::KernelContext(context)); });
  }

  void Compute(const Ort::KernelContext& ctx) const {
    const Ort::ConstValue hidden = ctx.GetInput(0);
    const Ort::ConstValue scores = ctx.GetInput(1);
    const auto h_info = hidden.GetTensorTypeAndShapeInfo();
    const std::vector<int64_t> hs = h_info.GetShape();
    const std::vector<int64_t> ss = scores.GetTensorTypeAndShapeInfo().GetShape();
    const vlmp_dtype dt = dtype_of(h_info.GetElementType(), op_, "hidden");
    if (hs.size() != 3) fail(op_, "hidden must be [B, T, D], got " + shape_str(hs));
    const int64_t B = hs[0], T = hs[1], D = hs[2], N = T - has_cls_, K = keep_;
    if (ss.size() != 2 || ss[0] != B || ss[1] != N) {
      fail(op_, "scores must be [B, T - has_cls] = " + shape_str({B, N}) + " for hidden " + shape_str(hs) +
                            " and has_cls=" + std::to_string(has_cls_) + ", got " + shape_str(ss));
    }
    if (K >= N) {
      fail(op_, "keep=" + std::to_string(K) + " must satisfy 1 <= keep < N, the " + std::to_string(N) +
                            " patch tokens of hidden " + shape_str(hs));
    }
    Ort::UnownedValue tokens = ctx.GetOutput(0, {B, has_cls_ + K + 1, D});
    Ort::UnownedValue kept_value = ctx.GetOutput(1, {B, K});
    if (B == 0 || D == 0) return;

    const float* s = scores.GetTensorData<float>();
    int64_t* kept = kept_value.GetTensorMutableData<int64_t>();
    auto select = [&](size_t b) { vlmp::cpu::select_topk_row(s + b * N, N, K, kept + b * K); };
    parallel_for(ctx, static_cast<size_t>(B), select);

    // The gather in chunks of whole rows (each task streams one stretch of the input), then
    // the summary row from the chunks' partial sums. The partials live in a buffer of the
    // calling thread, grown once: concurrent runs call from different threads.
    const size_t es = vlmp::cpu::dtype_size(dt);
    const char* src = static_cast<const char*>(hidden.GetTensorRawData());
    char* dst = static_cast<char*>(tokens.GetTensorMutableRawData());
    const int64_t chunks = vlmp::cpu::gather_chunks(N);
    const int64_t out_rows = has_cls_ + K + 1;
    const int has_cls = has_cls_;
    thread_local std::vector<float> partial_buffer;
    if (partial_buffer.size() < static_cast<size_t>(B * chunks * D)) partial_buffer.resize(B * chunks * D);
    float* partials = partial_buffer.data();
    auto image_src = [&](int64_t b) { return src + static_cast<size_t>(b * T * D) * es; };
    auto image_dst = [&](int64_t b) { return dst + static_cast<size_t>(b * out_rows * D) * es; };
    auto gather = [&](size_t task) {
      const int64_t b = static_cast<int64_t>(task) / chunks, c = static_cast<int64_t>(task) % chunks;
      vlmp::cpu::gather_chunk(dt, image_src(b), T, D, has_cls, kept + b * K, K, image_dst(b), c,
                              partials + (b * chunks + c) * D);
    };
    parallel_for(ctx, static_cast<size_t>(B * chunks), gather);

    const int64_t blocks = column_blocks(B, D);
    const int64_t width = (D + blocks - 1) / blocks;
    auto summary = [&](size_t task) {
      const int64_t b = static_cast<int64_t>(task) / blocks, c0 = (static_cast<int64_t>(task) % blocks) * width;
      const int64_t c1 = std::min(D, c0 + width);
      if (c0 < c1) vlmp::cpu::write_summary(dt, partials + b * chunks * D, T, D, has_cls, K, image_dst(b), c0, c1);
    };
    parallel_for(ctx, static_cast<size_t>(B * blocks), summary);
  }

  const char* op_;
  int64_t keep_;
  int has_cls_;
};

// The TokenPrune signature, shared by its two spellings.
template <typename Op>
struct TokenPruneSignature : Ort::CustomOpBase<Op, TokenPruneKernel, true> {
  size_t GetInputTypeCount() const { return 2; }
  // hidden: float or float16 (UNDEFINED lets ONNX Runtime propagate its type to output 0).
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
};

struct TokenPruneOp : TokenPruneSignature<TokenPruneOp> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return guarded(kTokenPrune, [&] { *kernel = new TokenPruneKernel(api, info); });
  }
  const char* GetName() const { return kTokenPrune; }
};

// The TensorRT plugin node (trt.plugins.VlmpTokenPrune) run by the same kernel; the plugin's
// version and namespace attributes are checked so that a graph meant for another plugin fails here.
struct PluginTwinOp : TokenPruneSignature<PluginTwinOp> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return guarded(kPluginName, [&] {
      expect_string(api, info, kPluginName, "plugin_version", kPluginVersion);
      expect_string(api, info, kPluginName, "plugin_namespace", kPluginNamespace);
      *kernel = new TokenPruneKernel(api, info, kPluginName);
    });
  }
  const char* GetName() const { return kPluginName; }
};

// --------------------------------------------------------- ClsAttentionScore

constexpr const char* kClsScore = "ClsAttentionScore";

struct ClsAttentionScoreKernel {
  ClsAttentionScoreKernel(const OrtApi& api, const OrtKernelInfo* info)
      : scale_(attr_float(api, info, "scale", 1.0f)),
        has_cls_(attr_flag(api, info, kClsScore, "has_cls", 1)),
        int8_(attr_flag(api, info, kClsScore, "int8", 0)),
        k_transposed_(attr_flag(api, info, kClsScore, "k_transposed", 1)) {}

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded(kClsScore, [&] { Compute(Ort::KernelContext(context)); });
  }

  void Compute(const Ort::KernelContext& ctx) const {
    const Ort::ConstValue q = ctx.GetInput(0);
    const Ort::ConstValue k = ctx.GetInput(1);
    const auto q_info = q.GetTensorTypeAndShapeInfo();
    const auto k_info = k.GetTensorTypeAndShapeInfo();
    const std::vector<int64_t> qs = q_info.GetShape(), ks = k_info.GetShape();
    const vlmp_dtype dt = dtype_of(q_info.GetElementType(), kClsScore, "q");
    if (k_info.GetElementType() != q_info.GetElementType()) fail(kClsScore, "q and k must have the same element type");
    if (qs.size() != 4) fail(kClsScore, "q must be [B, H, T, dh] (or [B, H, 1, dh]), got " + shape_str(qs));
    if (ks.size() != 4) fail(kClsScore, "k must be a rank-4 tensor, got " + shape_str(ks));
    const int64_t B = qs[0], H = qs[1], q_rows = qs[2], dh = qs[3];
    const int64_t T = k_transposed_ ? ks[3] : ks[2];
    const std::vector<int64_t> expect_k = k_transposed_ ? std::vector<int64_t>{B, H, dh, T}
                                                        : std::vector<int64_t>{B, H, T, dh};
    if (ks != expect_k) {
      fail(kClsScore, "k must be " + std::string(k_transposed_ ? "[B, H, dh, T]" : "[B, H, T, dh]") + " = " +
                          shape_str(expect_k) + " for q " + shape_str(qs) + ", got " + shape_str(ks));
    }
    if (q_rows != T && q_rows != 1) fail(kClsScore, "q must have T=" + std::to_string(T) + " or 1 rows, got " + shape_str(qs));
    if (T - has_cls_ < 1) fail(kClsScore, "k has no patch tokens (T=" + std::to_string(T) + ")");
    if (int8_ && dh > 1024) {  // kernels.h: the two-limb query's int32 dot is exact up to dh = 1024
      fail(kClsScore, "int8=1 supports head dims up to 1024, got dh=" + std::to_string(dh));
    }
    const int64_t N = T - has_cls_;
    Ort::UnownedValue out = ctx.GetOutput(0, {B, N});
    if (B == 0 || H == 0 || dh == 0) return;

    const size_t es = vlmp::cpu::dtype_size(dt);
    const char* qp = static_cast<const char*>(q.GetTensorRawData());
    const char* kp = static_cast<const char*>(k.GetTensorRawData());
    float* scores = out.GetTensorMutableData<float>();
    auto image = [&](size_t b) {
      vlmp::cpu::cls_scores_image(dt, qp + b * static_cast<size_t>(H * q_rows * dh) * es, q_rows,
                                  kp + b * static_cast<size_t>(H * T * dh) * es, H, T, dh, k_transposed_, scale_,
                                  has_cls_, int8_, scores + b * N);
    };
    parallel_for(ctx, static_cast<size_t>(B), image);
  }

  float scale_;
  int has_cls_, int8_, k_transposed_;
};

struct ClsAttentionScoreOp : Ort::CustomOpBase<ClsAttentionScoreOp, ClsAttentionScoreKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return guarded(kClsScore, [&] { *kernel = new ClsAttentionScoreKernel(api, info); });
  }
  const char* GetName() const { return kClsScore; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

// The TensorRT scorer plugin node (trt.plugins.VlmpClsScore; orin / xavier with --scorer int8)
// run by the same kernel as ClsAttentionScore, whose attributes it carries; version and namespace
// are checked as for VlmpTokenPrune.
constexpr const char* kScorePluginName = vlmprune::trt::kClsScoreName;

struct ClsScorePluginTwinOp : Ort::CustomOpBase<ClsScorePluginTwinOp, ClsAttentionScoreKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return guarded(kScorePluginName, [&] {
      expect_string(api, info, kScorePluginName, "plugin_version", vlmprune::trt::kClsScoreVersion);
      expect_string(api, info, kScorePluginName, "plugin_namespace", vlmprune::trt::kClsScoreNamespace);
      *kernel = new ClsAttentionScoreKernel(api, info);
    });
  }
  const char* GetName() const { return kScorePluginName; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

// ------------------------------------------------------------ DivPruneSelect

constexpr const char* kDivPrune = "DivPruneSelect";

// The fused form of divprune's greedy Loop (passes/methods/divprune.py): same picks, bit for bit.
struct DivPruneSelectKernel {
  DivPruneSelectKernel(const OrtApi& api, const OrtKernelInfo* info)
      : keep_(attr_int(api, info, kDivPrune, "keep", true, 0)) {
    if (keep_ < 1) fail(kDivPrune, "attribute 'keep' must be >= 1, got " + std::to_string(keep_));
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded(kDivPrune, [&] { Compute(Ort::KernelContext(context)); });
  }

  void Compute(const Ort::KernelContext& ctx) const {
    const Ort::ConstValue dist = ctx.GetInput(0);
    const std::vector<int64_t> ds = dist.GetTensorTypeAndShapeInfo().GetShape();
    if (ds.size() != 3 || ds[1] != ds[2]) fail(kDivPrune, "dist must be [B, N, N], got " + shape_str(ds));
    const int64_t B = ds[0], N = ds[1], K = keep_;
    if (K > N) {
      fail(kDivPrune, "keep=" + std::to_string(K) + " must satisfy 1 <= keep <= N, the " + std::to_string(N) +
                          " tokens of dist " + shape_str(ds));
    }
    Ort::UnownedValue out = ctx.GetOutput(0, {B, K});
    if (B == 0) return;
    const float* d = dist.GetTensorData<float>();
    int64_t* picks = out.GetTensorMutableData<int64_t>();
    if (vlmp::cpu::check_divprune_args(d, B, N, K, picks) != VLMP_OK) {
      fail(kDivPrune, "dist " + shape_str(ds) + " has more tokens than the kernel supports");
    }
    // One image per task: the greedy steps within an image are sequential.
    auto image = [&](size_t task) {
      const int64_t b = static_cast<int64_t>(task);
      vlmp::cpu::divprune_select_image(d + b * N * N, N, K, picks + b * K);
    };
    parallel_for(ctx, static_cast<size_t>(B), image);
  }

  int64_t keep_;
};

struct DivPruneSelectOp : Ort::CustomOpBase<DivPruneSelectOp, DivPruneSelectKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return guarded(kDivPrune, [&] { *kernel = new DivPruneSelectKernel(api, info); });
  }
  const char* GetName() const { return kDivPrune; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64; }
};

const OrtApi* newest_api(const OrtApiBase* base) {
  for (uint32_t v = ORT_API_VERSION; v >= kMinApiVersion; --v) {
    if (const OrtApi* api = base->GetApi(v)) return api;
  }
  return nullptr;
}

}  // namespace

extern "C" OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = newest_api(api_base);
  if (api == nullptr) {
    // API 1 always exists and can at least report why we refuse to load.
    return api_base->GetApi(1)->CreateStatus(ORT_FAIL, "vlmprune custom ops need onnxruntime >= 1.17");
  }
  Ort::InitApi(api);
  static const TokenPruneOp token_prune;
  static const ClsAttentionScoreOp cls_score;
  static const DivPruneSelectOp divprune_select;
  static const PluginTwinOp plugin_twin;
  static const ClsScorePluginTwinOp score_plugin_twin;
  // Domains must outlive every session that uses them. They are kept until exit and
  // deliberately never released: at exit ONNX Runtime may already be unloaded.
  static std::mutex mutex;
  static auto* domains = new std::vector<OrtCustomOpDomain*>();
  return guarded("RegisterCustomOps", [&] {
    Ort::CustomOpDomain domain{kDomain};
    domain.Add(&token_prune);
    domain.Add(&cls_score);
    domain.Add(&divprune_select);
    Ort::CustomOpDomain plugin_domain{kPluginDomain};
    plugin_domain.Add(&plugin_twin);
    plugin_domain.Add(&score_plugin_twin);
    Ort::UnownedSessionOptions(options).Add(domain);
    Ort::UnownedSessionOptions(options).Add(plugin_domain);
    std::lock_guard<std::mutex> lock(mutex);
    domains->push_back(domain.release());
    domains->push_back(plugin_domain.release());
  });
}
