#include "v2/token_prune_plugin.h"

#include "common/plugin_fields.h"
#include "common/token_prune_enqueue.h"
#include "v2/index_cast.h"

#include <cstring>
#include <new>

using namespace nvinfer1;

namespace vlmprune
{
namespace trt
{
namespace
{

constexpr int32_t kNbInputs = 2;  // hidden, scores
constexpr int32_t kNbOutputs = 2; // tokens, kept_indices

PruneExtents extentsOf(Dims const& hidden, Dims const& scores)
{
    return PruneExtents{hidden.d[0], hidden.d[1], scores.d[0], scores.d[1]};
}

bool ranksAre(Dims const& hidden, Dims const& scores)
{
    return hidden.nbDims == 3 && scores.nbDims == 2;
}

} // namespace

constexpr size_t TokenPrunePluginV2::kSerializedSize;

TokenPrunePluginV2::TokenPrunePluginV2(int32_t keep, int32_t hasCls)
    : mKeep(keep)
    , mHasCls(hasCls)
    , mNamespace(kTokenPruneNamespace)
    , mProfileRejected(false)
{
}

char const* TokenPrunePluginV2::getPluginType() const noexcept
{
    return kTokenPruneName;
}

char const* TokenPrunePluginV2::getPluginVersion() const noexcept
{
    return kTokenPruneVersion;
}

int32_t TokenPrunePluginV2::getNbOutputs() const noexcept
{
    return kNbOutputs;
}

int32_t TokenPrunePluginV2::initialize() noexcept
{
    return 0;
}

void TokenPrunePluginV2::terminate() noexcept {}

size_t TokenPrunePluginV2::getSerializationSize() const noexcept
{
    return kSerializedSize;
}

void TokenPrunePluginV2::serialize(void* buffer) const noexcept
{
    char* out = static_cast<char*>(buffer);
    std::memcpy(out, &mKeep, sizeof(mKeep));
    std::memcpy(out + sizeof(mKeep), &mHasCls, sizeof(mHasCls));
}

void TokenPrunePluginV2::destroy() noexcept
{
    delete this;
}

void TokenPrunePluginV2::setPluginNamespace(char const* pluginNamespace) noexcept
{
    assignNamespace(kTokenPruneName, mNamespace, pluginNamespace);
}

char const* TokenPrunePluginV2::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

DataType TokenPrunePluginV2::getOutputDataType(
    int32_t index, DataType const* inputTypes, int32_t /*nbInputs*/) const noexcept
{
    return index == 0 ? inputTypes[0] : DataType::kINT32;
}

IPluginV2DynamicExt* TokenPrunePluginV2::clone() const noexcept
{
    try
    {
        return new TokenPrunePluginV2(*this);
    }
    catch (...)
    {
        logPluginError("clone", "out of host memory");
        return nullptr;
    }
}

DimsExprs TokenPrunePluginV2::getOutputDimensions(
    int32_t outputIndex, DimsExprs const* inputs, int32_t nbInputs, IExprBuilder& exprBuilder) noexcept
{
    DimsExprs out{};
    if (nbInputs != kNbInputs || inputs[0].nbDims != 3 || inputs[1].nbDims != 2 || outputIndex < 0
        || outputIndex >= kNbOutputs)
    {
        logPluginError("getOutputDimensions", "expects inputs hidden [B, T, D] and scores [B, N], two outputs");
        return out;
    }
    // Dimensions known while the network is built are checked now; the rest wait
    // for configurePlugin(). getOutputDimensions() cannot fail, so this only logs.
    auto const known = [](IDimensionExpr const* e) -> int64_t { return e->isConstant() ? e->getConstantValue() : -1; };
    if (outputIndex == 0)
    {
        rejectExtents(PruneExtents{known(inputs[0].d[0]), known(inputs[0].d[1]), known(inputs[1].d[0]),
                          known(inputs[1].d[1])},
            "getOutputDimensions");
        out.nbDims = 3;
        out.d[0] = inputs[0].d[0];
        out.d[1] = exprBuilder.constant(mHasCls + mKeep + 1);
        out.d[2] = inputs[0].d[2];
    }
    else
    {
        out.nbDims = 2;
        out.d[0] = inputs[0].d[0];
        out.d[1] = exprBuilder.constant(mKeep);
    }
    return out;
}

bool TokenPrunePluginV2::supportsFormatCombination(
    int32_t pos, PluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || pos < 0 || pos >= kNbInputs + kNbOutputs)
    {
        return false;
    }
    PluginTensorDesc const& desc = inOut[pos];
    if (desc.format != TensorFormat::kLINEAR)
    {
        return false;
    }
    switch (pos)
    {
    case 0: return desc.type == DataType::kFLOAT || desc.type == DataType::kHALF; // hidden
    case 1: return desc.type == DataType::kFLOAT;                                 // scores
    case 2: return desc.type == inOut[0].type;                                    // tokens
    default: return desc.type == DataType::kINT32;                                // kept_indices
    }
}

// min and max bound every shape of the profile; see mProfileRejected for why a
// rejection is recorded rather than returned.
void TokenPrunePluginV2::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
    DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || !ranksAre(in[0].desc.dims, in[1].desc.dims))
    {
        logPluginError("configurePlugin", "expects inputs hidden [B, T, D] and scores [B, N], two outputs");
        mProfileRejected = true;
        return;
    }
    mProfileRejected = rejectExtents(extentsOf(in[0].min, in[1].min), "configurePlugin (profile min)")
        || rejectExtents(extentsOf(in[0].max, in[1].max), "configurePlugin (profile max)");
}

// The kernels produce int64 indices; they are staged here before the cast to int32.
size_t TokenPrunePluginV2::getWorkspaceSize(PluginTensorDesc const* inputs, int32_t /*nbInputs*/,
    PluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    int64_t const batch = inputs[0].dims.d[0];
    return batch > 0 ? static_cast<size_t>(batch) * static_cast<size_t>(mKeep) * sizeof(int64_t) : 0;
}

int32_t TokenPrunePluginV2::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept
{
    if (mProfileRejected)
    {
        logPluginError("enqueue", "refused: configurePlugin rejected this optimization profile (logged above)");
        return 1;
    }
    int64_t* const kept = static_cast<int64_t*>(workspace);
    int32_t const status = enqueueTokenPrune(inputDesc, inputs, mKeep, mHasCls, kept, outputs[0], stream);
    if (status != 0)
    {
        return status;
    }
    int64_t const count = static_cast<int64_t>(inputDesc[0].dims.d[0]) * mKeep;
    cudaError_t const castStatus = castIndicesToInt32(kept, static_cast<int32_t*>(outputs[1]), count, stream);
    if (castStatus != cudaSuccess)
    {
        logPluginError("enqueue", cudaGetErrorString(castStatus));
        return 1;
    }
    return 0;
}

bool TokenPrunePluginV2::rejectExtents(PruneExtents const& extents, char const* where) const noexcept
{
    return rejected(where, [&] { return checkExtents(extents, mKeep, mHasCls); });
}

TokenPruneCreatorV2::TokenPruneCreatorV2()
    : mFieldNames{PluginField(kFieldKeep, nullptr, PluginFieldType::kINT32, 1),
        PluginField(kFieldHasCls, nullptr, PluginFieldType::kINT32, 1)}
    , mFieldCollection{2, mFieldNames}
    , mNamespace(kTokenPruneNamespace)
{
}

char const* TokenPruneCreatorV2::getPluginName() const noexcept
{
    return kTokenPruneName;
}

char const* TokenPruneCreatorV2::getPluginVersion() const noexcept
{
    return kTokenPruneVersion;
}

PluginFieldCollection const* TokenPruneCreatorV2::getFieldNames() noexcept
{
    return &mFieldCollection;
}

// The IPluginV2* return types are mandated by IPluginCreator (see the header).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
IPluginV2* TokenPruneCreatorV2::createPlugin(char const* /*name*/, PluginFieldCollection const* fc) noexcept
{
    TokenPruneAttributes attrs{0, 0};
    if (rejected("createPlugin", [&] { return readAttributes(fc, attrs); }))
    {
        return nullptr;
    }
    TokenPrunePluginV2* const plugin = new (std::nothrow) TokenPrunePluginV2(attrs.keep, attrs.hasCls);
    if (plugin != nullptr)
    {
        plugin->setPluginNamespace(mNamespace.c_str());
    }
    return plugin;
}

IPluginV2* TokenPruneCreatorV2::deserializePlugin(
    char const* /*name*/, void const* serialData, size_t serialLength) noexcept
{
    if (serialData == nullptr || serialLength != TokenPrunePluginV2::kSerializedSize)
    {
        logPluginError("deserializePlugin", "serialised data is not two int32 (keep, has_cls)");
        return nullptr;
    }
    TokenPruneAttributes attrs{0, 0};
    char const* in = static_cast<char const*>(serialData);
    std::memcpy(&attrs.keep, in, sizeof(attrs.keep));
    std::memcpy(&attrs.hasCls, in + sizeof(attrs.keep), sizeof(attrs.hasCls));
    if (rejected("deserializePlugin", [&] { return checkAttributes(attrs.keep, attrs.hasCls); }))
    {
        return nullptr;
    }
    TokenPrunePluginV2* const plugin = new (std::nothrow) TokenPrunePluginV2(attrs.keep, attrs.hasCls);
    if (plugin != nullptr)
    {
        plugin->setPluginNamespace(mNamespace.c_str());
    }
    return plugin;
}

#pragma GCC diagnostic pop

void TokenPruneCreatorV2::setPluginNamespace(char const* pluginNamespace) noexcept
{
    assignNamespace(kTokenPruneName, mNamespace, pluginNamespace);
}

char const* TokenPruneCreatorV2::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

} // namespace trt
} // namespace vlmprune
