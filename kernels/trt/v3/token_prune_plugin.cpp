#include "v3/token_prune_plugin.h"

#include "common/plugin_fields.h"
#include "common/token_prune_enqueue.h"

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

// Extents of one configuration; `pick` chooses the min, max or concrete dims.
template <typename Desc, typename Pick>
PruneExtents extentsOf(Desc const* in, Pick pick)
{
    Dims const& hidden = pick(in[0]);
    Dims const& scores = pick(in[1]);
    return PruneExtents{hidden.d[0], hidden.d[1], scores.d[0], scores.d[1]};
}

bool ranksAre(Dims const& hidden, Dims const& scores)
{
    return hidden.nbDims == 3 && scores.nbDims == 2;
}

} // namespace

TokenPrunePluginV3::TokenPrunePluginV3(int32_t keep, int32_t hasCls)
    : mKeep(keep)
    , mHasCls(hasCls)
    , mSerialCollection{0, nullptr}
{
}

// The serialisation views point into the source object; they are rebuilt on demand.
TokenPrunePluginV3::TokenPrunePluginV3(TokenPrunePluginV3 const& other)
    : TokenPrunePluginV3(other.mKeep, other.mHasCls)
{
}

IPluginCapability* TokenPrunePluginV3::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

IPluginV3* TokenPrunePluginV3::clone() noexcept
{
    return new (std::nothrow) TokenPrunePluginV3(*this);
}

char const* TokenPrunePluginV3::getPluginName() const noexcept
{
    return kTokenPruneName;
}

char const* TokenPrunePluginV3::getPluginVersion() const noexcept
{
    return kTokenPruneVersion;
}

char const* TokenPrunePluginV3::getPluginNamespace() const noexcept
{
    return kTokenPruneNamespace;
}

// Called per optimisation profile: min and max bound every shape the engine will
// see, so checking both refuses a profile the kernels cannot serve (N > 4096,
// keep >= N, T != has_cls + N) when the engine is built rather than at enqueue.
int32_t TokenPrunePluginV3::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
    DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || !ranksAre(in[0].desc.dims, in[1].desc.dims))
    {
        logPluginError("configurePlugin", "expects inputs hidden [B, T, D] and scores [B, N], two outputs");
        return 1;
    }
    auto const pickMin = [](DynamicPluginTensorDesc const& d) -> Dims const& { return d.min; };
    auto const pickMax = [](DynamicPluginTensorDesc const& d) -> Dims const& { return d.max; };
    if (rejectExtents(extentsOf(in, pickMin), "configurePlugin (profile min)")
        || rejectExtents(extentsOf(in, pickMax), "configurePlugin (profile max)"))
    {
        return 1;
    }
    return 0;
}

int32_t TokenPrunePluginV3::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs)
    {
        return 1;
    }
    outputTypes[0] = inputTypes[0];
    outputTypes[1] = DataType::kINT64;
    return 0;
}

int32_t TokenPrunePluginV3::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
    int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& exprBuilder) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || inputs[0].nbDims != 3 || inputs[1].nbDims != 2)
    {
        logPluginError("getOutputShapes", "expects inputs hidden [B, T, D] and scores [B, N], two outputs");
        return 1;
    }
    // Dimensions known while the network is built are checked now, so a bad static
    // shape fails at parse time; runtime dimensions wait for configurePlugin().
    auto const known = [](IDimensionExpr const* e) -> int64_t { return e->isConstant() ? e->getConstantValue() : -1; };
    if (rejectExtents(PruneExtents{known(inputs[0].d[0]), known(inputs[0].d[1]), known(inputs[1].d[0]),
                          known(inputs[1].d[1])},
            "getOutputShapes"))
    {
        return 1;
    }
    outputs[0].nbDims = 3;
    outputs[0].d[0] = inputs[0].d[0];
    outputs[0].d[1] = exprBuilder.constant(mHasCls + mKeep + 1);
    outputs[0].d[2] = inputs[0].d[2];
    outputs[1].nbDims = 2;
    outputs[1].d[0] = inputs[0].d[0];
    outputs[1].d[1] = exprBuilder.constant(mKeep);
    return 0;
}

bool TokenPrunePluginV3::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || pos < 0 || pos >= kNbInputs + kNbOutputs)
    {
        return false;
    }
    PluginTensorDesc const& desc = inOut[pos].desc;
    if (desc.format != TensorFormat::kLINEAR)
    {
        return false;
    }
    switch (pos)
    {
    case 0: return desc.type == DataType::kFLOAT || desc.type == DataType::kHALF; // hidden
    case 1: return desc.type == DataType::kFLOAT;                                 // scores
    case 2: return desc.type == inOut[0].desc.type;                               // tokens
    default: return desc.type == DataType::kINT64;                                // kept_indices
    }
}

int32_t TokenPrunePluginV3::getNbOutputs() const noexcept
{
    return kNbOutputs;
}

// The kept_indices output is already the int64 [B, keep] list the gather reads.
size_t TokenPrunePluginV3::getWorkspaceSize(DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
    DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    return 0;
}

int32_t TokenPrunePluginV3::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /*out*/, int32_t /*nbOutputs*/) noexcept
{
    if (nbInputs != kNbInputs || !ranksAre(in[0].dims, in[1].dims))
    {
        logPluginError("onShapeChange", "expects inputs hidden [B, T, D] and scores [B, N]");
        return 1;
    }
    auto const pickDims = [](PluginTensorDesc const& d) -> Dims const& { return d.dims; };
    return rejectExtents(extentsOf(in, pickDims), "onShapeChange") ? 1 : 0;
}

int32_t TokenPrunePluginV3::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept
{
    // kept_indices is itself the int64 list that the gather reads.
    return enqueueTokenPrune(
        inputDesc, inputs, mKeep, mHasCls, static_cast<int64_t*>(outputs[1]), outputs[0], stream);
}

IPluginV3* TokenPrunePluginV3::attachToContext(IPluginResourceContext* /*context*/) noexcept
{
    return clone(); // no per-context resources
}

PluginFieldCollection const* TokenPrunePluginV3::getFieldsToSerialize() noexcept
{
    mSerialFields[0] = PluginField(kFieldKeep, &mKeep, PluginFieldType::kINT32, 1);
    mSerialFields[1] = PluginField(kFieldHasCls, &mHasCls, PluginFieldType::kINT32, 1);
    mSerialCollection.nbFields = 2;
    mSerialCollection.fields = mSerialFields;
    return &mSerialCollection;
}

bool TokenPrunePluginV3::rejectExtents(PruneExtents const& extents, char const* where) const noexcept
{
    return rejected(where, [&] { return checkExtents(extents, mKeep, mHasCls); });
}

TokenPruneCreatorV3::TokenPruneCreatorV3()
    : mFieldNames{PluginField(kFieldKeep, nullptr, PluginFieldType::kINT32, 1),
        PluginField(kFieldHasCls, nullptr, PluginFieldType::kINT32, 1)}
    , mFieldCollection{2, mFieldNames}
{
}

// Build phase: fields come from the ONNX node; runtime phase: from getFieldsToSerialize().
IPluginV3* TokenPruneCreatorV3::createPlugin(
    char const* /*name*/, PluginFieldCollection const* fc, TensorRTPhase /*phase*/) noexcept
{
    TokenPruneAttributes attrs{0, 0};
    if (rejected("createPlugin", [&] { return readAttributes(fc, attrs); }))
    {
        return nullptr;
    }
    return new (std::nothrow) TokenPrunePluginV3(attrs.keep, attrs.hasCls);
}

PluginFieldCollection const* TokenPruneCreatorV3::getFieldNames() noexcept
{
    return &mFieldCollection;
}

char const* TokenPruneCreatorV3::getPluginName() const noexcept
{
    return kTokenPruneName;
}

char const* TokenPruneCreatorV3::getPluginVersion() const noexcept
{
    return kTokenPruneVersion;
}

char const* TokenPruneCreatorV3::getPluginNamespace() const noexcept
{
    return kTokenPruneNamespace;
}

} // namespace trt
} // namespace vlmprune
