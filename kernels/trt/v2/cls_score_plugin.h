/* VlmpClsScore as a TensorRT 8.5 IPluginV2DynamicExt (Jetson Xavier, JetPack 5.1).
 *
 * Same contract as the TensorRT 10 wrapper (common/cls_score.h, v3/cls_score_plugin.h):
 * vlmp_cls_scores_cuda on TensorRT's stream; its only output is fp32, so unlike
 * VlmpTokenPrune nothing needs narrowing for 8.5. C++14 (gcc 9 on JetPack 5.1).
 */
#ifndef VLMPRUNE_TRT_V2_CLS_SCORE_PLUGIN_H
#define VLMPRUNE_TRT_V2_CLS_SCORE_PLUGIN_H

#include "common/cls_score.h"

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>

namespace vlmprune
{
namespace trt
{

class ClsScorePluginV2 : public nvinfer1::IPluginV2DynamicExt
{
public:
    // Attributes must have passed checkScoreAttributes(); the creator enforces it.
    explicit ClsScorePluginV2(ClsScoreAttributes const& attrs);

    // Serialised form: scale (float32), has_cls, int8, k_transposed (int32), host-endian.
    static constexpr size_t kSerializedSize = sizeof(float) + 3 * sizeof(int32_t);

    // IPluginV2
    char const* getPluginType() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    int32_t getNbOutputs() const noexcept override;
    int32_t initialize() noexcept override;
    void terminate() noexcept override;
    size_t getSerializationSize() const noexcept override;
    void serialize(void* buffer) const noexcept override;
    void destroy() noexcept override;
    void setPluginNamespace(char const* pluginNamespace) noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV2Ext
    nvinfer1::DataType getOutputDataType(
        int32_t index, nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;

    // IPluginV2DynamicExt
    nvinfer1::IPluginV2DynamicExt* clone() const noexcept override;
    nvinfer1::DimsExprs getOutputDimensions(int32_t outputIndex, nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(
        int32_t pos, nvinfer1::PluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept override;
    void configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    size_t getWorkspaceSize(nvinfer1::PluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;

private:
    bool rejectExtents(ScoreExtents const& extents, char const* where) const noexcept;

    ClsScoreAttributes mAttrs;
    std::string mNamespace;
    // As in TokenPrunePluginV2: 8.5's configurePlugin() cannot fail, so enqueue() refuses.
    bool mProfileRejected;
};

// IPluginCreator's mandated IPluginV2* signatures: see token_prune_plugin.h.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
class ClsScoreCreatorV2 : public nvinfer1::IPluginCreator
{
public:
    ClsScoreCreatorV2();

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV2* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc) noexcept override;
    nvinfer1::IPluginV2* deserializePlugin(
        char const* name, void const* serialData, size_t serialLength) noexcept override;
    void setPluginNamespace(char const* pluginNamespace) noexcept override;
    char const* getPluginNamespace() const noexcept override;

private:
    nvinfer1::PluginField mFieldNames[4];
    nvinfer1::PluginFieldCollection mFieldCollection;
    std::string mNamespace;
};
#pragma GCC diagnostic pop

} // namespace trt
} // namespace vlmprune

#endif // VLMPRUNE_TRT_V2_CLS_SCORE_PLUGIN_H
