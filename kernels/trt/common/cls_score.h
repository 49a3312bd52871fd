/* The VlmpClsScore plugin's contract, shared by the TensorRT 10 (IPluginV3) and 8.5
 * (IPluginV2DynamicExt) wrappers: field parsing, shape checks and the enqueue, which is
 * vlmp_cls_scores_cuda (kernels/include/vlmprune/kernels.h) on TensorRT's stream.
 * Inputs q [B, H, T, dh] and k ([B, H, dh, T] when k_transposed, else [B, H, T, dh]),
 * both fp32 or both fp16; output scores [B, N] fp32, N = T - has_cls. C++14.
 */
#ifndef VLMPRUNE_TRT_CLS_SCORE_H
#define VLMPRUNE_TRT_CLS_SCORE_H

#include "common/plugin_names.h"
#include "common/token_prune_checks.h"
#include "vlmprune/kernels.h"

#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

namespace vlmprune
{
namespace trt
{

constexpr int32_t kClsScoreInputs = 2;  // q, k
constexpr int32_t kClsScoreOutputs = 1; // scores

// q and k are both rank 4 ([B, H, T, dh]; k [B, H, dh, T] when k_transposed).
inline bool clsScoreRanksOk(nvinfer1::Dims const& q, nvinfer1::Dims const& k) noexcept
{
    return q.nbDims == 4 && k.nbDims == 4;
}

struct ClsScoreAttributes
{
    float scale;
    int32_t hasCls;
    int32_t int8;
    int32_t kTransposed;
};

// logPluginError / rejected() of token_prune_checks.h, under the scorer's name.
inline void logScoreError(char const* where, char const* why) noexcept
{
    logErrorAs(kClsScoreName, where, why);
}

template <typename Check>
bool scoreRejected(char const* where, Check&& check) noexcept
{
    return rejectedAs(kClsScoreName, where, check);
}

inline std::string checkScoreAttributes(ClsScoreAttributes const& a)
{
    if (!std::isfinite(a.scale))
    {
        return "scale must be finite";
    }
    if ((a.hasCls != 0 && a.hasCls != 1) || (a.int8 != 0 && a.int8 != 1) || (a.kTransposed != 0 && a.kTransposed != 1))
    {
        return "has_cls, int8 and k_transposed must each be 0 or 1";
    }
    return std::string();
}

// Fills `attrs` from `fc`: scale (one float32) and has_cls, int8, k_transposed (one int32 each),
// all required; unknown fields are ignored.
inline std::string readScoreAttributes(nvinfer1::PluginFieldCollection const* fc, ClsScoreAttributes& attrs)
{
    char const* const ints[] = {kFieldHasCls, kFieldInt8, kFieldKTransposed};
    int32_t* const slots[] = {&attrs.hasCls, &attrs.int8, &attrs.kTransposed};
    bool seen[4] = {false, false, false, false};
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
    {
        nvinfer1::PluginField const& field = fc->fields[i];
        if (field.name == nullptr)
        {
            continue;
        }
        if (std::strcmp(field.name, kFieldScale) == 0)
        {
            if (field.type != nvinfer1::PluginFieldType::kFLOAT32 || field.length != 1 || field.data == nullptr)
            {
                return std::string("field '") + kFieldScale + "' must be one float32";
            }
            attrs.scale = *static_cast<float const*>(field.data);
            seen[3] = true;
            continue;
        }
        for (int j = 0; j < 3; ++j)
        {
            if (std::strcmp(field.name, ints[j]) != 0)
            {
                continue;
            }
            if (field.type != nvinfer1::PluginFieldType::kINT32 || field.length != 1 || field.data == nullptr)
            {
                return std::string("field '") + field.name + "' must be one int32";
            }
            *slots[j] = *static_cast<int32_t const*>(field.data);
            seen[j] = true;
        }
    }
    if (!(seen[0] && seen[1] && seen[2] && seen[3]))
    {
        return std::string("fields '") + kFieldScale + "', '" + kFieldHasCls + "', '" + kFieldInt8 + "' and '"
            + kFieldKTransposed + "' are required";
    }
    return checkScoreAttributes(attrs);
}

// Extents of q [B, H, Tq, dh] and k; negative = unknown while the network is built.
struct ScoreExtents
{
    int64_t q[4];
    int64_t k[4];
};

inline std::string checkScoreExtents(ScoreExtents const& e, ClsScoreAttributes const& a)
{
    int64_t const keys = a.kTransposed ? e.k[3] : e.k[2];
    int64_t const kDim = a.kTransposed ? e.k[2] : e.k[3];
    auto const differ = [](int64_t x, int64_t y) { return x >= 0 && y >= 0 && x != y; };
    if (differ(e.q[0], e.k[0]) || differ(e.q[1], e.k[1]) || differ(e.q[3], kDim))
    {
        return std::string("k must be ") + (a.kTransposed ? "[B, H, dh, T]" : "[B, H, T, dh]")
            + " for q [B, H, T, dh]: batch, heads or dh differ";
    }
    if (differ(e.q[2], keys))
    {
        return "q has " + std::to_string(e.q[2]) + " rows but k has T=" + std::to_string(keys)
            + " keys; the kernel reads row 0 of q [B, H, T, dh]";
    }
    if (keys >= 0 && keys - a.hasCls < 1)
    {
        return "k has no patch tokens (T=" + std::to_string(keys) + ")";
    }
    if (keys > kMaxKeys || e.q[3] > kMaxHeadDim)
    {
        return "T=" + std::to_string(keys) + ", dh=" + std::to_string(e.q[3])
            + " exceed vlmp_cls_scores_cuda's limits (T <= " + std::to_string(kMaxKeys)
            + ", dh <= " + std::to_string(kMaxHeadDim) + ")";
    }
    return std::string();
}

template <typename DimsT>
ScoreExtents scoreExtentsOf(DimsT const& q, DimsT const& k)
{
    ScoreExtents e{};
    for (int i = 0; i < 4; ++i)
    {
        e.q[i] = q.d[i];
        e.k[i] = k.d[i];
    }
    return e;
}

// pos 0: q (fp32 or fp16), 1: k (q's type), 2: scores (fp32); linear only.
inline bool scoreTypeOk(int32_t pos, nvinfer1::DataType type, nvinfer1::TensorFormat format, nvinfer1::DataType qType)
{
    if (format != nvinfer1::TensorFormat::kLINEAR)
    {
        return false;
    }
    switch (pos)
    {
    case 0: return type == nvinfer1::DataType::kFLOAT || type == nvinfer1::DataType::kHALF;
    case 1: return type == qType;
    default: return type == nvinfer1::DataType::kFLOAT;
    }
}

// inputs: q, k; outputs[0]: scores [B, N] fp32. Returns 0 or the failing vlmp_status.
inline int32_t enqueueClsScore(nvinfer1::PluginTensorDesc const* inputDesc, void const* const* inputs,
    ClsScoreAttributes const& a, void* scores, cudaStream_t stream) noexcept
{
    nvinfer1::Dims const& q = inputDesc[0].dims;
    int64_t const keys = a.kTransposed ? inputDesc[1].dims.d[3] : inputDesc[1].dims.d[2];
    if (q.d[0] == 0)
    {
        return 0;
    }
    vlmp_dtype const dtype = inputDesc[0].type == nvinfer1::DataType::kHALF ? VLMP_FLOAT16 : VLMP_FLOAT32;
    vlmp_status const status = vlmp_cls_scores_cuda(dtype, inputs[0], inputs[1], q.d[0], q.d[1], keys, q.d[3],
        a.kTransposed, a.scale, a.hasCls, a.int8, static_cast<float*>(scores), stream);
    if (status != VLMP_OK)
    {
        // kernels.h: after VLMP_ERR_CUDA, cudaGetLastError() holds the reason.
        return kernelFailed(kClsScoreName, "vlmp_cls_scores_cuda", status,
            status == VLMP_ERR_CUDA ? cudaGetErrorString(cudaGetLastError()) : "");
    }
    return 0;
}

} // namespace trt
} // namespace vlmprune

#endif // VLMPRUNE_TRT_CLS_SCORE_H
