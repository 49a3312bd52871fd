/* The whole of the plugins' work, shared by the TensorRT 10 and 8.5 wrappers:
 * vlmp_select_topk_cuda (scores -> kept) then vlmp_gather_summary_cuda (hidden, kept
 * -> tokens), both enqueued on the plugin's stream. C++14.
 */
#ifndef VLMPRUNE_TRT_TOKEN_PRUNE_ENQUEUE_H
#define VLMPRUNE_TRT_TOKEN_PRUNE_ENQUEUE_H

#include "common/token_prune_checks.h"
#include "vlmprune/kernels.h"

#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>

namespace vlmprune
{
namespace trt
{

// inputDesc / inputs: hidden [B, T, D] (fp32 or fp16), scores [B, N] fp32.
// kept: int64 [B, keep] device buffer; tokens: [B, has_cls + keep + 1, D], hidden's type.
// Returns 0 or the failing vlmp_status, which TensorRT reports as an enqueue error.
inline int32_t enqueueTokenPrune(nvinfer1::PluginTensorDesc const* inputDesc, void const* const* inputs,
    int32_t keep, int32_t hasCls, int64_t* kept, void* tokens, cudaStream_t stream) noexcept
{
    nvinfer1::Dims const& hidden = inputDesc[0].dims;
    int64_t const batch = hidden.d[0];
    if (batch == 0)
    {
        return 0; // an empty batch has nothing to write; the kernels reject B < 1
    }
    vlmp_dtype const dtype = inputDesc[0].type == nvinfer1::DataType::kHALF ? VLMP_FLOAT16 : VLMP_FLOAT32;
    vlmp_status status = vlmp_select_topk_cuda(
        static_cast<float const*>(inputs[1]), batch, inputDesc[1].dims.d[1], keep, kept, stream);
    char const* step = "vlmp_select_topk_cuda";
    if (status == VLMP_OK)
    {
        status = vlmp_gather_summary_cuda(
            dtype, inputs[0], batch, hidden.d[1], hidden.d[2], hasCls, kept, keep, tokens, stream);
        step = "vlmp_gather_summary_cuda";
    }
    if (status != VLMP_OK)
    {
        // kernels.h: after VLMP_ERR_CUDA, cudaGetLastError() holds the reason.
        return kernelFailed(kTokenPruneName, step, status,
            status == VLMP_ERR_CUDA ? cudaGetErrorString(cudaGetLastError()) : "");
    }
    return 0;
}

} // namespace trt
} // namespace vlmprune

#endif // VLMPRUNE_TRT_TOKEN_PRUNE_ENQUEUE_H
