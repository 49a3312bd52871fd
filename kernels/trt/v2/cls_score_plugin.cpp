#include "v2/cls_score_plugin.h"

#include <cstring>
#include <new>

using namespace nvinfer1;

namespace vlmprune
{
namespace trt
{
constexpr size_t ClsScorePluginV2::kSerializedSize;

ClsScorePluginV2::ClsScorePluginV2(ClsScoreAttributes const& attrs)
    : mAttrs(attrs)
    , mNamespace(kClsScoreNamespace)
    , mProfileRejected(false)
{
}

char const* ClsScorePluginV2::getPluginType() const noexcept
{
    return kClsScoreName;
}

char const* ClsScorePluginV2::getPluginVersion() const noexcept
{
    return kClsScoreVersion;
}

int32_t ClsScorePluginV2::getNbOutputs() const noexcept
{
    return kClsScoreOutputs;
}

int32_t ClsScorePluginV2::initialize() noexcept
{
    return 0;
}

void ClsScorePluginV2::terminate() noexcept {}

size_t ClsScorePluginV2::getSerializationSize() const noexcept
{
    return kSerializedSize;
}

void ClsScorePluginV2::serialize(void* buffer) const noexcept
{
    char* out = static_cast<char*>(buffer);
    std::memcpy(out, &mAttrs.scale, sizeof(float));
    std::memcpy(out + sizeof(float), &mAttrs.hasCls, sizeof(int32_t));
    std::memcpy(out + sizeof(float) + sizeof(int32_t), &mAttrs.int8, sizeof(int32_t));
    std::memcpy(out + sizeof(float) + 2 * sizeof(int32_t), &mAttrs.kTransposed, sizeof(int32_t));
}

void ClsScorePluginV2::destroy() noexcept
{
    delete this;
}

void ClsScorePluginV2::setPluginNamespace(char const* pluginNamespace) noexcept
{
    assignNamespace(kClsScoreName, mNamespace, pluginNamespace);
}

char const* ClsScorePluginV2::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

DataType ClsScorePluginV2::getOutputDataType(
    int32_t /*index*/, DataType const* /*inputTypes*/, int32_t /*nbInputs*/) const noexcept
{
    return DataType::kFLOAT;
}

IPluginV2DynamicExt* ClsScorePluginV2::clone() const noexcept
{
    try
    {
        return new ClsScorePluginV2(*this);
    }
    catch (...)
    {
        logScoreError("clone", "out of host memory");
        return nullptr;
    }
}

DimsExprs ClsScorePluginV2::getOutputDimensions(
    int32_t outputIndex, DimsExprs const* inputs, int32_t nbInputs, IExprBuilder& exprBuilder) noexcept
{
    DimsExprs out{};
    if (nbInputs != kClsScoreInputs || inputs[0].nbDims != 4 || inputs[1].nbDims != 4 || outputIndex != 0)
    {
        logScoreError("getOutputDimensions", "expects inputs q and k of rank 4, one output");
        return out;
    }
    // getOutputDimensions() cannot fail: a bad static shape is only logged here and
    // refused by configurePlugin() / enqueue().
    auto const known = [](IDimensionExpr const* e) -> int64_t { return e->isConstant() ? e->getConstantValue() : -1; };
    ScoreExtents e{};
    for (int i = 0; i < 4; ++i)
    {
        e.q[i] = known(inputs[0].d[i]);
        e.k[i] = known(inputs[1].d[i]);
    }
    rejectExtents(e, "getOutputDimensions");
    IDimensionExpr const* keys = inputs[1].d[mAttrs.kTransposed ? 3 : 2];
    out.nbDims = 2;
    out.d[0] = inputs[0].d[0];
    out.d[1] = mAttrs.hasCls ? exprBuilder.operation(DimensionOperation::kSUB, *keys, *exprBuilder.constant(1)) : keys;
    return out;
}

bool ClsScorePluginV2::supportsFormatCombination(
    int32_t pos, PluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kClsScoreInputs || nbOutputs != kClsScoreOutputs || pos < 0 || pos >= kClsScoreInputs + kClsScoreOutputs)
    {
        return false;
    }
    return scoreTypeOk(pos, inOut[pos].type, inOut[pos].format, inOut[0].type);
}

void ClsScorePluginV2::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
    DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (nbInputs != kClsScoreInputs || nbOutputs != kClsScoreOutputs || !clsScoreRanksOk(in[0].desc.dims, in[1].desc.dims))
    {
        logScoreError("configurePlugin", "expects inputs q and k of rank 4, one output");
        mProfileRejected = true;
        return;
    }
    mProfileRejected = rejectExtents(scoreExtentsOf(in[0].min, in[1].min), "configurePlugin (profile min)")
        || rejectExtents(scoreExtentsOf(in[0].max, in[1].max), "configurePlugin (profile max)");
}

size_t ClsScorePluginV2::getWorkspaceSize(PluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
    PluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    return 0; // vlmp_cls_scores_cuda keeps its scratch in shared memory
}

int32_t ClsScorePluginV2::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept
{
    if (mProfileRejected)
    {
        logScoreError("enqueue", "refused: configurePlugin rejected this optimization profile (logged above)");
        return 1;
    }
    return enqueueClsScore(inputDesc, inputs, mAttrs, outputs[0], stream);
}

bool ClsScorePluginV2::rejectExtents(ScoreExtents const& extents, char const* where) const noexcept
{
    return scoreRejected(where, [&] { return checkScoreExtents(extents, mAttrs); });
}

ClsScoreCreatorV2::ClsScoreCreatorV2()
    : mFieldNames{PluginField(kFieldScale, nullptr, PluginFieldType::kFLOAT32, 1),
        PluginField(kFieldHasCls, nullptr, PluginFieldType::kINT32, 1),
        PluginField(kFieldInt8, nullptr, PluginFieldType::kINT32, 1),
        PluginField(kFieldKTransposed, nullptr, PluginFieldType::kINT32, 1)}
    , mFieldCollection{4, mFieldNames}
    , mNamespace(kClsScoreNamespace)
{
}

char const* ClsScoreCreatorV2::getPluginName() const noexcept
{
    return kClsScoreName;
}

char const* ClsScoreCreatorV2::getPluginVersion() const noexcept
{
    return kClsScoreVersion;
}

PluginFieldCollection const* ClsScoreCreatorV2::getFieldNames() noexcept
{
    return &mFieldCollection;
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
IPluginV2* ClsScoreCreatorV2::createPlugin(char const* /*name*/, PluginFieldCollection const* fc) noexcept
{
    ClsScoreAttributes attrs{1.0f, 1, 0, 1};
    if (scoreRejected("createPlugin", [&] { return readScoreAttributes(fc, attrs); }))
    {
        return nullptr;
    }
    ClsScorePluginV2* const plugin = new (std::nothrow) ClsScorePluginV2(attrs);
    if (plugin != nullptr)
    {
        plugin->setPluginNamespace(mNamespace.c_str());
    }
    return plugin;
}

IPluginV2* ClsScoreCreatorV2::deserializePlugin(
    char const* /*name*/, void const* serialData, size_t serialLength) noexcept
{
    if (serialData == nullptr || serialLength != ClsScorePluginV2::kSerializedSize)
    {
        logScoreError("deserializePlugin", "serialised data is not scale, has_cls, int8, k_transposed");
        return nullptr;
    }
    ClsScoreAttributes attrs{1.0f, 1, 0, 1};
    char const* in = static_cast<char const*>(serialData);
    std::memcpy(&attrs.scale, in, sizeof(float));
    std::memcpy(&attrs.hasCls, in + sizeof(float), sizeof(int32_t));
    std::memcpy(&attrs.int8, in + sizeof(float) + sizeof(int32_t), sizeof(int32_t));
    std::memcpy(&attrs.kTransposed, in + sizeof(float) + 2 * sizeof(int32_t), sizeof(int32_t));
    if (scoreRejected("deserializePlugin", [&] { return checkScoreAttributes(attrs); }))
    {
        return nullptr;
    }
    ClsScorePluginV2* const plugin = new (std::nothrow) ClsScorePluginV2(attrs);
    if (plugin != nullptr)
    {
        plugin->setPluginNamespace(mNamespace.c_str());
    }
    return plugin;
}
#pragma GCC diagnostic pop

void ClsScoreCreatorV2::setPluginNamespace(char const* pluginNamespace) noexcept
{
    assignNamespace(kClsScoreName, mNamespace, pluginNamespace);
}

char const* ClsScoreCreatorV2::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

} // namespace trt
} // namespace vlmprune
