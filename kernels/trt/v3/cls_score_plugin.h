/* VlmpClsScore as a TensorRT 10 IPluginV3 (Jetson Orin, JetPack 6, TensorRT 10.3).
 *
 * A thin wrapper over vlmp_cls_scores_cuda (kernels/include/vlmprune/kernels.h): the
 * [CLS]-row attention score, averaged over heads, in INT8 when int8 = 1 (--scorer int8).
 * Contract: common/cls_score.h. Same layout as TokenPrunePluginV3 (token_prune_plugin.h).
 */
#ifndef VLMPRUNE_TRT_V3_CLS_SCORE_PLUGIN_H
#define VLMPRUNE_TRT_V3_CLS_SCORE_PLUGIN_H

#include "common/cls_score.h"

#include <NvInferRuntime.h>

#include <cstdint>

namespace vlmprune
{
namespace trt
{

class ClsScorePluginV3 : public nvinfer1::IPluginV3,
                         public nvinfer1::IPluginV3OneCore,
                         public nvinfer1::IPluginV3OneBuild,
                         public nvinfer1::IPluginV3OneRuntime
{
public:
    // Attributes must have passed checkScoreAttributes(); the creator enforces it.
    explicit ClsScorePluginV3(ClsScoreAttributes const& attrs);
    ClsScorePluginV3(ClsScorePluginV3 const& other);
    ClsScorePluginV3& operator=(ClsScorePluginV3 const&) = delete;
    ~ClsScorePluginV3() override = default;

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
    bool rejectExtents(ScoreExtents const& extents, char const* where) const noexcept;

    ClsScoreAttributes mAttrs;
    nvinfer1::PluginField mSerialFields[4];
    nvinfer1::PluginFieldCollection mSerialCollection;
};

class ClsScoreCreatorV3 : public nvinfer1::IPluginCreatorV3One
{
public:
    ClsScoreCreatorV3();

    nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
        nvinfer1::TensorRTPhase phase) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

private:
    nvinfer1::PluginField mFieldNames[4];
    nvinfer1::PluginFieldCollection mFieldCollection;
};

} // namespace trt
} // namespace vlmprune

#endif // VLMPRUNE_TRT_V3_CLS_SCORE_PLUGIN_H
