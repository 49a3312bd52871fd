/* The TensorRT plugin contract shared with the ONNX side.
 *
 * TensorRT's ONNX parser maps a node to a plugin by op_type == plugin name and the
 * node attributes plugin_version / plugin_namespace, so these strings are the
 * interface between the fused graph and the engine. kernels/trt/plugin_names.json
 * carries the same values for Python; tests/kernels/test_trt_plugins.py keeps the
 * two equal. C++14: the TensorRT 8.5 wrapper is built by the gcc 9 of JetPack 5.1.
 */
#ifndef VLMPRUNE_TRT_PLUGIN_NAMES_H
#define VLMPRUNE_TRT_PLUGIN_NAMES_H

#include <cstdint>

namespace vlmprune
{
namespace trt
{

constexpr char const* kTokenPruneName = "VlmpTokenPrune";
constexpr char const* kTokenPruneVersion = "1";
constexpr char const* kTokenPruneNamespace = "vlmprune";

// Plugin fields (ONNX node attributes), both int32.
constexpr char const* kFieldKeep = "keep";
constexpr char const* kFieldHasCls = "has_cls";

// vlmp_select_topk_cuda handles N <= 4096 (kernels/include/vlmprune/kernels.h); the
// plugin refuses larger profiles at build time instead of failing at enqueue.
constexpr int64_t kMaxPatches = 4096;

// The [CLS]-attention scorer (--scorer int8): vlmp_cls_scores_cuda as a plugin.
constexpr char const* kClsScoreName = "VlmpClsScore";
constexpr char const* kClsScoreVersion = "1";
constexpr char const* kClsScoreNamespace = "vlmprune";

// Its fields: scale float32; has_cls, int8, k_transposed int32 (each 0 or 1).
constexpr char const* kFieldScale = "scale";
constexpr char const* kFieldInt8 = "int8";
constexpr char const* kFieldKTransposed = "k_transposed";

// vlmp_cls_scores_cuda's limits (kernels.h, token_prune.cu): T <= 4097 keys, dh <= 1024.
constexpr int64_t kMaxKeys = 4097;
constexpr int64_t kMaxHeadDim = 1024;

} // namespace trt
} // namespace vlmprune

#endif // VLMPRUNE_TRT_PLUGIN_NAMES_H
