/* VlmpTokenPrune as a TensorRT 8.5 IPluginV2DynamicExt (Jetson Xavier, JetPack 5.1).
 *
 * Same contract as the TensorRT 10 wrapper (kernels/trt/v3) except that
 * kept_indices is int32: TensorRT 8.5 has no int64 plugin I/O. The kernels write
 * int64 indices into the workspace and a local cast kernel (index_cast.cu) narrows
 * them; indices are < N <= 4096, so nothing is lost. C++14 (gcc 9 on JetPack 5.1).
 */
#ifndef VLMPRUNE_TRT_V2_TOKEN_PRUNE_PLUGIN_H
#define VLMPRUNE_TRT_V2_TOKEN_PRUNE_PLUGIN_H

#include "common/token_prune_checks.h"

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>

namespace vlmprune
{
namespace trt
{

class TokenPrunePluginV2 : public nvinfer1::IPluginV2DynamicExt
{
public:
    // Attributes must have passed checkAttributes(); the creator enforces it.
    TokenPrunePluginV2(int32_t keep, int32_t hasCls);

    // Serialised form: keep then has_cls, two host-endian int32 (engines do not move
    // between machines anyway).
    static constexpr size_t kSerializedSize = 2 * sizeof(int32_t);

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
    bool rejectExtents(PruneExtents const& extents, char const* where) const noexcept;

    int32_t mKeep;
    int32_t mHasCls;
    std::string mNamespace;
    // Set by configurePlugin() when the profile breaks the contract. TensorRT 8.5's
    // configurePlugin() cannot return an error, so enqueue() refuses instead, which
    // fails the builder's timing of this layer and with it the build.
    bool mProfileRejected;
};

// TensorRT 8.5 marks IPluginV2 deprecated (plugins should derive from its
// subclasses) yet IPluginCreator's own methods return IPluginV2*; the warning for
// those mandated signatures is silenced here and nowhere else.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
class TokenPruneCreatorV2 : public nvinfer1::IPluginCreator
{
public:
    TokenPruneCreatorV2();

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV2* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc) noexcept override;
    nvinfer1::IPluginV2* deserializePlugin(
        char const* name, void const* serialData, size_t serialLength) noexcept override;
    void setPluginNamespace(char const* pluginNamespace) noexcept override;
    char const* getPluginNamespace() const noexcept override;

private:
    nvinfer1::PluginField mFieldNames[2];
    nvinfer1::PluginFieldCollection mFieldCollection;
    std::string mNamespace;
};
#pragma GCC diagnostic pop

} // namespace trt
} // namespace vlmprune

#endif // VLMPRUNE_TRT_V2_TOKEN_PRUNE_PLUGIN_H
