/* VlmpTokenPrune as a TensorRT 10 IPluginV3 (Jetson Orin, JetPack 6, TensorRT 10.3).
 *
 * A thin wrapper: enqueue() runs vlmp_select_topk_cuda (scores -> kept indices) and
 * vlmp_gather_summary_cuda (hidden, kept -> tokens) from kernels/include/vlmprune/kernels.h.
 * Inputs: hidden [B, T, D] fp32|fp16, scores [B, N] fp32 with N = T - has_cls.
 * Outputs: tokens [B, has_cls + keep + 1, D] (hidden's type), kept_indices [B, keep] int64.
 */
#ifndef VLMPRUNE_TRT_V3_TOKEN_PRUNE_PLUGIN_H
#define VLMPRUNE_TRT_V3_TOKEN_PRUNE_PLUGIN_H

#include "common/token_prune_checks.h"

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>

namespace vlmprune
{
namespace trt
{

// One object implements the three capability interfaces, the usual IPluginV3 layout:
// the plugin state is two integers, so splitting it would only add indirection.
class TokenPrunePluginV3 : public nvinfer1::IPluginV3,
                           public nvinfer1::IPluginV3OneCore,
                           public nvinfer1::IPluginV3OneBuild,
                           public nvinfer1::IPluginV3OneRuntime
{
public:
    // Attributes must have passed checkAttributes(); the creator enforces it.
    TokenPrunePluginV3(int32_t keep, int32_t hasCls);
    TokenPrunePluginV3(TokenPrunePluginV3 const& other);
    TokenPrunePluginV3& operator=(TokenPrunePluginV3 const&) = delete;
    ~TokenPrunePluginV3() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t getNbOutputs() const noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    // Logs and returns true when the extents break the contract (see checkExtents).
    bool rejectExtents(PruneExtents const& extents, char const* where) const noexcept;

    int32_t mKeep;
    int32_t mHasCls;
    // Views into mKeep / mHasCls handed to TensorRT by getFieldsToSerialize().
    nvinfer1::PluginField mSerialFields[2];
    nvinfer1::PluginFieldCollection mSerialCollection;
};

class TokenPruneCreatorV3 : public nvinfer1::IPluginCreatorV3One
{
public:
    TokenPruneCreatorV3();

    nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
        nvinfer1::TensorRTPhase phase) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

private:
    nvinfer1::PluginField mFieldNames[2];
    nvinfer1::PluginFieldCollection mFieldCollection;
};

} // namespace trt
} // namespace vlmprune

#endif // VLMPRUNE_TRT_V3_TOKEN_PRUNE_PLUGIN_H
