#include "v3/cls_score_plugin.h"

#include <new>

using namespace nvinfer1;

namespace vlmprune
{
namespace trt
{
ClsScorePluginV3::ClsScorePluginV3(ClsScoreAttributes const& attrs)
    : mAttrs(attrs)
    , mSerialCollection{0, nullptr}
{
}

// The serialisation views point into the source object; they are rebuilt on demand.
ClsScorePluginV3::ClsScorePluginV3(ClsScorePluginV3 const& other)
    : ClsScorePluginV3(other.mAttrs)
{
}

IPluginCapability* ClsScorePluginV3::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

IPluginV3* ClsScorePluginV3::clone() noexcept
{
    return new (std::nothrow) ClsScorePluginV3(*this);
}

char const* ClsScorePluginV3::getPluginName() const noexcept
{
    return kClsScoreName;
}

char const* ClsScorePluginV3::getPluginVersion() const noexcept
{
    return kClsScoreVersion;
}

char const* ClsScorePluginV3::getPluginNamespace() const noexcept
{
    return kClsScoreNamespace;
}

// min and max of the profile bound every shape: checking both refuses what the kernel
// cannot serve (T > 4097, dh > 1024, mismatched q / k) when the engine is built.
int32_t ClsScorePluginV3::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
    DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (nbInputs != kClsScoreInputs || nbOutputs != kClsScoreOutputs || !clsScoreRanksOk(in[0].desc.dims, in[1].desc.dims))
    {
        logScoreError("configurePlugin", "expects inputs q and k of rank 4, one output");
        return 1;
    }
    if (rejectExtents(scoreExtentsOf(in[0].min, in[1].min), "configurePlugin (profile min)")
        || rejectExtents(scoreExtentsOf(in[0].max, in[1].max), "configurePlugin (profile max)"))
    {
        return 1;
    }
    return 0;
}

int32_t ClsScorePluginV3::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* /*inputTypes*/, int32_t nbInputs) const noexcept
{
    if (nbInputs != kClsScoreInputs || nbOutputs != kClsScoreOutputs)
    {
        return 1;
    }
    outputTypes[0] = DataType::kFLOAT;
    return 0;
}

int32_t ClsScorePluginV3::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
    int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& exprBuilder) noexcept
{
    if (nbInputs != kClsScoreInputs || nbOutputs != kClsScoreOutputs || inputs[0].nbDims != 4 || inputs[1].nbDims != 4)
    {
        logScoreError("getOutputShapes", "expects inputs q and k of rank 4, one output");
        return 1;
    }
    auto const known = [](IDimensionExpr const* e) -> int64_t { return e->isConstant() ? e->getConstantValue() : -1; };
    ScoreExtents e{};
    for (int i = 0; i < 4; ++i)
    {
        e.q[i] = known(inputs[0].d[i]);
        e.k[i] = known(inputs[1].d[i]);
    }
    if (rejectExtents(e, "getOutputShapes"))
    {
        return 1;
    }
    IDimensionExpr const* keys = inputs[1].d[mAttrs.kTransposed ? 3 : 2];
    outputs[0].nbDims = 2;
    outputs[0].d[0] = inputs[0].d[0];
    outputs[0].d[1] = mAttrs.hasCls
        ? exprBuilder.operation(DimensionOperation::kSUB, *keys, *exprBuilder.constant(1))
        : keys;
    return 0;
}

bool ClsScorePluginV3::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kClsScoreInputs || nbOutputs != kClsScoreOutputs || pos < 0 || pos >= kClsScoreInputs + kClsScoreOutputs)
    {
        return false;
    }
    return scoreTypeOk(pos, inOut[pos].desc.type, inOut[pos].desc.format, inOut[0].desc.type);
}

int32_t ClsScorePluginV3::getNbOutputs() const noexcept
{
    return kClsScoreOutputs;
}

// vlmp_cls_scores_cuda keeps its scratch in shared memory.
size_t ClsScorePluginV3::getWorkspaceSize(DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
    DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    return 0;
}

int32_t ClsScorePluginV3::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /*out*/, int32_t /*nbOutputs*/) noexcept
{
    if (nbInputs != kClsScoreInputs || !clsScoreRanksOk(in[0].dims, in[1].dims))
    {
        logScoreError("onShapeChange", "expects inputs q and k of rank 4");
        return 1;
    }
    return rejectExtents(scoreExtentsOf(in[0].dims, in[1].dims), "onShapeChange") ? 1 : 0;
}

int32_t ClsScorePluginV3::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept
{
    return enqueueClsScore(inputDesc, inputs, mAttrs, outputs[0], stream);
}

IPluginV3* ClsScorePluginV3::attachToContext(IPluginResourceContext* /*context*/) noexcept
{
    return clone(); // no per-context resources
}

PluginFieldCollection const* ClsScorePluginV3::getFieldsToSerialize() noexcept
{
    mSerialFields[0] = PluginField(kFieldScale, &mAttrs.scale, PluginFieldType::kFLOAT32, 1);
    mSerialFields[1] = PluginField(kFieldHasCls, &mAttrs.hasCls, PluginFieldType::kINT32, 1);
    mSerialFields[2] = PluginField(kFieldInt8, &mAttrs.int8, PluginFieldType::kINT32, 1);
    mSerialFields[3] = PluginField(kFieldKTransposed, &mAttrs.kTransposed, PluginFieldType::kINT32, 1);
    mSerialCollection.nbFields = 4;
    mSerialCollection.fields = mSerialFields;
    return &mSerialCollection;
}

bool ClsScorePluginV3::rejectExtents(ScoreExtents const& extents, char const* where) const noexcept
{
    return scoreRejected(where, [&] { return checkScoreExtents(extents, mAttrs); });
}

ClsScoreCreatorV3::ClsScoreCreatorV3()
    : mFieldNames{PluginField(kFieldScale, nullptr, PluginFieldType::kFLOAT32, 1),
        PluginField(kFieldHasCls, nullptr, PluginFieldType::kINT32, 1),
        PluginField(kFieldInt8, nullptr, PluginFieldType::kINT32, 1),
        PluginField(kFieldKTransposed, nullptr, PluginFieldType::kINT32, 1)}
    , mFieldCollection{4, mFieldNames}
{
}

// Build phase: fields come from the ONNX node; runtime phase: from getFieldsToSerialize().
IPluginV3* ClsScoreCreatorV3::createPlugin(
    char const* /*name*/, PluginFieldCollection const* fc, TensorRTPhase /*phase*/) noexcept
{
    ClsScoreAttributes attrs{1.0f, 1, 0, 1};
    if (scoreRejected("createPlugin", [&] { return readScoreAttributes(fc, attrs); }))
    {
        return nullptr;
    }
    return new (std::nothrow) ClsScorePluginV3(attrs);
}

PluginFieldCollection const* ClsScoreCreatorV3::getFieldNames() noexcept
{
    return &mFieldCollection;
}

char const* ClsScoreCreatorV3::getPluginName() const noexcept
{
    return kClsScoreName;
}

char const* ClsScoreCreatorV3::getPluginVersion() const noexcept
{
    return kClsScoreVersion;
}

char const* ClsScoreCreatorV3::getPluginNamespace() const noexcept
{
    return kClsScoreNamespace;
}

} // namespace trt
} // namespace vlmprune
