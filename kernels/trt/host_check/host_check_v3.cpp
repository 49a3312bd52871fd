/* Drives the TensorRT 10 wrapper (kernels/trt/v3) through its TensorRT interfaces on
 * the host: creator and fields, capability interfaces, output types and shapes,
 * format combinations, profile checks, serialisation round trip and the enqueue
 * wiring to the kernels (host stubs). Linked with the v3 sources and host_kernel_stubs.cpp.
 */
#include "host_check/host_fakes.h"
#include "v3/cls_score_plugin.h"
#include "v3/token_prune_plugin.h"

#include <cstring>
#include <memory>

using namespace nvinfer1;
using host_check::dynamicDesc;
using host_check::loggedContaining;
using host_check::loggedErrors;
using host_check::tensorDesc;

extern "C" void setLoggerFinder(ILoggerFinder* finder);
extern "C" IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);

namespace
{

class HostLoggerFinder : public ILoggerFinder
{
public:
    ILogger* findLogger() override
    {
        return &mLogger;
    }

private:
    host_check::RecordingLogger mLogger;
};

struct PluginDeleter
{
    void operator()(IPluginV3* p) const
    {
        delete p;
    }
};
using PluginPtr = std::unique_ptr<IPluginV3, PluginDeleter>;

PluginFieldCollection fieldsOf(std::vector<PluginField>& storage)
{
    return PluginFieldCollection{static_cast<int32_t>(storage.size()), storage.data()};
}

PluginPtr create(
    IPluginCreatorV3One& creator, int32_t keep, int32_t hasCls, TensorRTPhase phase = TensorRTPhase::kBUILD)
{
    std::vector<PluginField> f{PluginField("keep", &keep, PluginFieldType::kINT32, 1),
        PluginField("has_cls", &hasCls, PluginFieldType::kINT32, 1)};
    PluginFieldCollection fc = fieldsOf(f);
    return PluginPtr(creator.createPlugin("prune", &fc, phase));
}

template <typename T>
T* capability(IPluginV3& plugin, PluginCapabilityType type)
{
    return static_cast<T*>(plugin.getCapabilityInterface(type));
}

std::pair<int32_t, int32_t> serialisedFields(IPluginV3& plugin)
{
    PluginFieldCollection const* fc
        = capability<IPluginV3OneRuntime>(plugin, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize();
    int32_t keep = -1;
    int32_t hasCls = -1;
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        HOST_CHECK(fc->fields[i].type == PluginFieldType::kINT32 && fc->fields[i].length == 1);
        int32_t const value = *static_cast<int32_t const*>(fc->fields[i].data);
        if (std::strcmp(fc->fields[i].name, "keep") == 0)
        {
            keep = value;
        }
        else if (std::strcmp(fc->fields[i].name, "has_cls") == 0)
        {
            hasCls = value;
        }
    }
    return {keep, hasCls};
}

void checkCreator(IPluginCreatorV3One& creator)
{
    HOST_CHECK(std::strcmp(creator.getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0);
    HOST_CHECK(std::strcmp(creator.getPluginName(), "VlmpTokenPrune") == 0);
    HOST_CHECK(std::strcmp(creator.getPluginVersion(), "1") == 0);
    HOST_CHECK(std::strcmp(creator.getPluginNamespace(), "vlmprune") == 0);
    PluginFieldCollection const* names = creator.getFieldNames();
    HOST_CHECK(names != nullptr && names->nbFields == 2);
    HOST_CHECK(std::strcmp(names->fields[0].name, "keep") == 0 && names->fields[0].type == PluginFieldType::kINT32);
    HOST_CHECK(std::strcmp(names->fields[1].name, "has_cls") == 0 && names->fields[1].type == PluginFieldType::kINT32);

    // Refusals, each with a reason in the log.
    loggedErrors().clear();
    HOST_CHECK(create(creator, 0, 1) == nullptr);
    HOST_CHECK(loggedContaining("keep must be in [1, 4095]"));
    HOST_CHECK(create(creator, 4096, 0) == nullptr);
    HOST_CHECK(create(creator, 8, 2) == nullptr);
    HOST_CHECK(loggedContaining("has_cls must be 0 or 1"));
    int32_t keep = 8;
    std::vector<PluginField> onlyKeep{PluginField("keep", &keep, PluginFieldType::kINT32, 1)};
    PluginFieldCollection fc = fieldsOf(onlyKeep);
    HOST_CHECK(creator.createPlugin("prune", &fc, TensorRTPhase::kBUILD) == nullptr);
    HOST_CHECK(loggedContaining("are required"));
    int64_t keep64 = 8;
    int32_t hasCls = 1;
    std::vector<PluginField> wrongType{PluginField("keep", &keep64, PluginFieldType::kINT64, 1),
        PluginField("has_cls", &hasCls, PluginFieldType::kINT32, 1)};
    fc = fieldsOf(wrongType);
    HOST_CHECK(creator.createPlugin("prune", &fc, TensorRTPhase::kBUILD) == nullptr);
    HOST_CHECK(loggedContaining("must be one int32"));
    HOST_CHECK(loggedContaining("VlmpTokenPrune::createPlugin: "));
}

void checkBuild(IPluginV3& plugin, host_check::HostExprBuilder& builder)
{
    auto* core = capability<IPluginV3OneCore>(plugin, PluginCapabilityType::kCORE);
    auto* build = capability<IPluginV3OneBuild>(plugin, PluginCapabilityType::kBUILD);
    HOST_CHECK(core != nullptr && build != nullptr);
    HOST_CHECK(std::strcmp(core->getPluginName(), "VlmpTokenPrune") == 0);
    HOST_CHECK(std::strcmp(core->getPluginVersion(), "1") == 0);
    HOST_CHECK(std::strcmp(core->getPluginNamespace(), "vlmprune") == 0);
    HOST_CHECK(build->getNbOutputs() == 2);

    DataType in[2] = {DataType::kHALF, DataType::kFLOAT};
    DataType out[2] = {DataType::kFLOAT, DataType::kFLOAT};
    HOST_CHECK(build->getOutputDataTypes(out, 2, in, 2) == 0);
    HOST_CHECK(out[0] == DataType::kHALF && out[1] == DataType::kINT64);

    // keep = 8, has_cls = 1: tokens [B, 1 + 8 + 1, D], kept_indices [B, 8].
    DimsExprs inputs[2] = {builder.dims({-1, 577, 1024}), builder.dims({-1, 576})};
    DimsExprs outputs[2];
    HOST_CHECK(build->getOutputShapes(inputs, 2, nullptr, 0, outputs, 2, builder) == 0);
    HOST_CHECK(outputs[0].nbDims == 3 && outputs[1].nbDims == 2);
    HOST_CHECK(outputs[0].d[0] == inputs[0].d[0] && outputs[1].d[0] == inputs[0].d[0]);
    HOST_CHECK(host_check::constantOr(outputs[0].d[1], -1) == 10);
    HOST_CHECK(host_check::constantOr(outputs[0].d[2], -1) == 1024);
    HOST_CHECK(host_check::constantOr(outputs[1].d[1], -1) == 8);

    loggedErrors().clear();
    DimsExprs mismatched[2] = {builder.dims({2, 576, 1024}), builder.dims({2, 576})};
    HOST_CHECK(build->getOutputShapes(mismatched, 2, nullptr, 0, outputs, 2, builder) != 0);
    HOST_CHECK(loggedContaining("expected T = has_cls + N = 577"));
    DimsExprs tooMany[2] = {builder.dims({1, 5001, 64}), builder.dims({1, 5000})};
    HOST_CHECK(build->getOutputShapes(tooMany, 2, nullptr, 0, outputs, 2, builder) != 0);
    HOST_CHECK(loggedContaining("N <= 4096"));
    DimsExprs rank2[2] = {builder.dims({577, 1024}), builder.dims({1, 576})};
    HOST_CHECK(build->getOutputShapes(rank2, 2, nullptr, 0, outputs, 2, builder) != 0);

    // Formats: hidden fp32|fp16, scores fp32, tokens = hidden, indices int64, linear only.
    std::vector<int64_t> h{1, 577, 64};
    std::vector<int64_t> s{1, 576};
    std::vector<int64_t> t{1, 10, 64};
    std::vector<int64_t> k{1, 8};
    auto io = [&](DataType hidden, DataType scores, DataType tokens, DataType idx) {
        std::vector<DynamicPluginTensorDesc> d{dynamicDesc(h, h, hidden), dynamicDesc(s, s, scores),
            dynamicDesc(t, t, tokens), dynamicDesc(k, k, idx)};
        return d;
    };
    auto supportsAll = [&](std::vector<DynamicPluginTensorDesc> const& d) {
        bool ok = true;
        for (int32_t pos = 0; pos < 4; ++pos)
        {
            ok = ok && build->supportsFormatCombination(pos, d.data(), 2, 2);
        }
        return ok;
    };
    HOST_CHECK(supportsAll(io(DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT, DataType::kINT64)));
    HOST_CHECK(supportsAll(io(DataType::kHALF, DataType::kFLOAT, DataType::kHALF, DataType::kINT64)));
    HOST_CHECK(!supportsAll(io(DataType::kHALF, DataType::kFLOAT, DataType::kFLOAT, DataType::kINT64)));
    HOST_CHECK(!supportsAll(io(DataType::kFLOAT, DataType::kHALF, DataType::kFLOAT, DataType::kINT64)));
    HOST_CHECK(!supportsAll(io(DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT, DataType::kINT32)));
    HOST_CHECK(!supportsAll(io(DataType::kBF16, DataType::kFLOAT, DataType::kBF16, DataType::kINT64)));
    std::vector<DynamicPluginTensorDesc> vectorized = io(DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT,
        DataType::kINT64);
    vectorized[0].desc.format = TensorFormat::kCHW32;
    HOST_CHECK(!build->supportsFormatCombination(0, vectorized.data(), 2, 2));

    // Profiles: both bounds are checked.
    auto profile = [&](int64_t minB, int64_t maxB, int64_t minN, int64_t maxN, int64_t hasCls) {
        std::vector<DynamicPluginTensorDesc> d{
            dynamicDesc({minB, hasCls + minN, 64}, {maxB, hasCls + maxN, 64}, DataType::kHALF),
            dynamicDesc({minB, minN}, {maxB, maxN}, DataType::kFLOAT), dynamicDesc(t, t, DataType::kHALF),
            dynamicDesc(k, k, DataType::kINT64)};
        return build->configurePlugin(d.data(), 2, d.data() + 2, 2);
    };
    loggedErrors().clear();
    HOST_CHECK(profile(1, 8, 576, 576, 1) == 0);
    HOST_CHECK(profile(1, 8, 16, 4096, 1) == 0);
    HOST_CHECK(loggedErrors().empty());
    HOST_CHECK(profile(1, 8, 576, 4097, 1) != 0);
    HOST_CHECK(loggedContaining("configurePlugin (profile max): N=4097 patches exceeds"));
    HOST_CHECK(profile(1, 8, 8, 576, 1) != 0);
    HOST_CHECK(loggedContaining("keep=8 must be smaller than the number of patches N=8"));
    HOST_CHECK(profile(1, 8, 576, 576, 0) != 0); // hidden carries no [CLS] but has_cls = 1

    HOST_CHECK(build->getWorkspaceSize(nullptr, 2, nullptr, 2) == 0);
}

void checkRuntime(IPluginV3& plugin)
{
    auto* runtime = capability<IPluginV3OneRuntime>(plugin, PluginCapabilityType::kRUNTIME);
    HOST_CHECK(runtime != nullptr);

    int64_t const B = 2, T = 577, N = 576, D = 64, K = 8;
    PluginTensorDesc in[2] = {tensorDesc({B, T, D}, DataType::kHALF), tensorDesc({B, N}, DataType::kFLOAT)};
    PluginTensorDesc out[2] = {tensorDesc({B, 1 + K + 1, D}, DataType::kHALF), tensorDesc({B, K}, DataType::kINT64)};
    loggedErrors().clear();
    HOST_CHECK(runtime->onShapeChange(in, 2, out, 2) == 0);
    PluginTensorDesc badIn[2] = {tensorDesc({B, T, D}, DataType::kHALF), tensorDesc({B + 1, N}, DataType::kFLOAT)};
    HOST_CHECK(runtime->onShapeChange(badIn, 2, out, 2) != 0);
    HOST_CHECK(loggedContaining("hidden has batch 2 but scores has batch 3"));

    std::vector<uint16_t> hidden(B * T * D);
    std::vector<float> scores(B * N);
    std::vector<uint16_t> tokens(B * (K + 2) * D);
    std::vector<int64_t> kept(B * K, -1);
    void const* inputs[2] = {hidden.data(), scores.data()};
    void* outputs[2] = {tokens.data(), kept.data()};
    auto* stream = reinterpret_cast<cudaStream_t>(0x5eed);

    host_check::KernelCalls& calls = host_check::kernelCalls();
    calls = host_check::KernelCalls();
    HOST_CHECK(runtime->enqueue(in, out, inputs, outputs, nullptr, stream) == 0);
    HOST_CHECK(calls.selectCalls == 1 && calls.gatherCalls == 1);
    HOST_CHECK(calls.scores == scores.data() && calls.selB == B && calls.selN == N && calls.selK == K);
    HOST_CHECK(calls.selKept == kept.data()); // int64 output used directly, no workspace
    HOST_CHECK(calls.dtype == VLMP_FLOAT16 && calls.hidden == hidden.data());
    HOST_CHECK(calls.gatB == B && calls.gatT == T && calls.gatD == D && calls.gatK == K && calls.hasCls == 1);
    HOST_CHECK(calls.gatKept == kept.data() && calls.out == tokens.data());
    HOST_CHECK(calls.selStream == stream && calls.gatStream == stream);
    HOST_CHECK(kept[K + 3] == host_check::stubIndex(1, 3));

    PluginTensorDesc in32[2] = {tensorDesc({B, T, D}, DataType::kFLOAT), tensorDesc({B, N}, DataType::kFLOAT)};
    HOST_CHECK(runtime->enqueue(in32, out, inputs, outputs, nullptr, stream) == 0);
    HOST_CHECK(calls.dtype == VLMP_FLOAT32);

    // An empty batch launches nothing.
    calls = host_check::KernelCalls();
    PluginTensorDesc empty[2] = {tensorDesc({0, T, D}, DataType::kHALF), tensorDesc({0, N}, DataType::kFLOAT)};
    HOST_CHECK(runtime->enqueue(empty, out, inputs, outputs, nullptr, stream) == 0);
    HOST_CHECK(calls.selectCalls == 0 && calls.gatherCalls == 0);

    // A kernel error is returned and logged; the gather does not run after a failed select.
    calls = host_check::KernelCalls();
    calls.selectResult = VLMP_ERR_UNSUPPORTED;
    loggedErrors().clear();
    HOST_CHECK(runtime->enqueue(in, out, inputs, outputs, nullptr, stream) == VLMP_ERR_UNSUPPORTED);
    HOST_CHECK(calls.gatherCalls == 0);
    HOST_CHECK(loggedContaining("vlmp_select_topk_cuda returned VLMP_ERR_UNSUPPORTED"));
    calls = host_check::KernelCalls();
    calls.selectResult = VLMP_ERR_CUDA;
    calls.lastCudaError = cudaErrorLaunchFailure;
    HOST_CHECK(runtime->enqueue(in, out, inputs, outputs, nullptr, stream) == VLMP_ERR_CUDA);
    HOST_CHECK(loggedContaining("returned VLMP_ERR_CUDA: host stub CUDA error"));
    calls = host_check::KernelCalls();
}

void checkSerialisation(IPluginCreatorV3One& creator, IPluginV3& plugin)
{
    std::pair<int32_t, int32_t> const fields = serialisedFields(plugin);
    HOST_CHECK(fields.first == 8 && fields.second == 1);

    // What TensorRT does when deserialising: the serialised fields back through the creator.
    PluginFieldCollection const* fc
        = capability<IPluginV3OneRuntime>(plugin, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize();
    PluginPtr restored(creator.createPlugin("prune", fc, TensorRTPhase::kRUNTIME));
    HOST_CHECK(restored != nullptr);
    if (restored)
    {
        HOST_CHECK(serialisedFields(*restored) == fields);
    }

    PluginPtr copy(plugin.clone());
    HOST_CHECK(copy != nullptr && copy.get() != &plugin);
    if (copy)
    {
        HOST_CHECK(serialisedFields(*copy) == fields);
    }
    PluginPtr attached(
        capability<IPluginV3OneRuntime>(plugin, PluginCapabilityType::kRUNTIME)->attachToContext(nullptr));
    HOST_CHECK(attached != nullptr && attached.get() != &plugin);
}

// VlmpClsScore: the creator's contract, shapes, formats, profile checks, enqueue wiring and
// serialisation, through the same interfaces TensorRT 10 uses.
void checkScorer(IPluginCreatorV3One& creator)
{
    HOST_CHECK(std::strcmp(creator.getPluginName(), "VlmpClsScore") == 0);
    HOST_CHECK(std::strcmp(creator.getPluginVersion(), "1") == 0);
    HOST_CHECK(std::strcmp(creator.getPluginNamespace(), "vlmprune") == 0);
    PluginFieldCollection const* names = creator.getFieldNames();
    HOST_CHECK(names != nullptr && names->nbFields == 4);
    HOST_CHECK(std::strcmp(names->fields[0].name, "scale") == 0 && names->fields[0].type == PluginFieldType::kFLOAT32);
    float scale = 0.125F;
    int32_t hasCls = 1, int8 = 1, kTransposed = 1;
    std::vector<PluginField> f{PluginField("scale", &scale, PluginFieldType::kFLOAT32, 1),
        PluginField("has_cls", &hasCls, PluginFieldType::kINT32, 1),
        PluginField("int8", &int8, PluginFieldType::kINT32, 1),
        PluginField("k_transposed", &kTransposed, PluginFieldType::kINT32, 1)};
    PluginFieldCollection fc = fieldsOf(f);
    int32_t bad = 2;
    std::vector<PluginField> badInt8{f[0], f[1], PluginField("int8", &bad, PluginFieldType::kINT32, 1), f[3]};
    PluginFieldCollection badFc = fieldsOf(badInt8);
    HOST_CHECK(creator.createPlugin("score", &badFc, TensorRTPhase::kBUILD) == nullptr);
    HOST_CHECK(loggedContaining("VlmpClsScore::createPlugin: has_cls, int8 and k_transposed must each be 0 or 1"));
    std::vector<PluginField> noScale{f[1], f[2], f[3]};
    PluginFieldCollection noScaleFc = fieldsOf(noScale);
    HOST_CHECK(creator.createPlugin("score", &noScaleFc, TensorRTPhase::kBUILD) == nullptr);
    HOST_CHECK(loggedContaining("are required"));

    PluginPtr plugin(creator.createPlugin("score", &fc, TensorRTPhase::kBUILD));
    HOST_CHECK(plugin != nullptr);
    if (!plugin)
    {
        return;
    }
    auto* core = capability<IPluginV3OneCore>(*plugin, PluginCapabilityType::kCORE);
    auto* build = capability<IPluginV3OneBuild>(*plugin, PluginCapabilityType::kBUILD);
    auto* runtime = capability<IPluginV3OneRuntime>(*plugin, PluginCapabilityType::kRUNTIME);
    HOST_CHECK(std::strcmp(core->getPluginName(), "VlmpClsScore") == 0);
    HOST_CHECK(build->getNbOutputs() == 1);
    DataType in[2] = {DataType::kHALF, DataType::kHALF};
    DataType out[1] = {DataType::kHALF};
    HOST_CHECK(build->getOutputDataTypes(out, 1, in, 2) == 0 && out[0] == DataType::kFLOAT);

    host_check::HostExprBuilder builder;
    DimsExprs inputs[2] = {builder.dims({-1, 6, 257, 64}), builder.dims({-1, 6, 64, 257})};
    DimsExprs outputs[1];
    HOST_CHECK(build->getOutputShapes(inputs, 2, nullptr, 0, outputs, 1, builder) == 0);
    HOST_CHECK(outputs[0].nbDims == 2 && outputs[0].d[0] == inputs[0].d[0]);
    DimsExprs wrongDh[2] = {builder.dims({2, 6, 257, 64}), builder.dims({2, 6, 32, 257})};
    HOST_CHECK(build->getOutputShapes(wrongDh, 2, nullptr, 0, outputs, 1, builder) != 0);
    HOST_CHECK(loggedContaining("k must be [B, H, dh, T]"));
    DimsExprs tooMany[2] = {builder.dims({1, 6, 5000, 64}), builder.dims({1, 6, 64, 5000})};
    HOST_CHECK(build->getOutputShapes(tooMany, 2, nullptr, 0, outputs, 1, builder) != 0);
    HOST_CHECK(loggedContaining("T <= 4097"));

    std::vector<DynamicPluginTensorDesc> d{dynamicDesc({1, 6, 257, 64}, {4, 6, 257, 64}, DataType::kHALF),
        dynamicDesc({1, 6, 64, 257}, {4, 6, 64, 257}, DataType::kHALF),
        dynamicDesc({1, 256}, {4, 256}, DataType::kFLOAT)};
    HOST_CHECK(build->supportsFormatCombination(0, d.data(), 2, 1));
    HOST_CHECK(build->supportsFormatCombination(1, d.data(), 2, 1));
    HOST_CHECK(build->supportsFormatCombination(2, d.data(), 2, 1));
    std::vector<DynamicPluginTensorDesc> mixed{d[0], dynamicDesc({1, 6, 64, 257}, {4, 6, 64, 257}, DataType::kFLOAT),
        d[2]};
    HOST_CHECK(!build->supportsFormatCombination(1, mixed.data(), 2, 1));
    HOST_CHECK(build->configurePlugin(d.data(), 2, &d[2], 1) == 0);
    std::vector<DynamicPluginTensorDesc> big{dynamicDesc({1, 6, 257, 2048}, {1, 6, 257, 2048}, DataType::kHALF),
        dynamicDesc({1, 6, 2048, 257}, {1, 6, 2048, 257}, DataType::kHALF), d[2]};
    HOST_CHECK(build->configurePlugin(big.data(), 2, &big[2], 1) != 0);
    HOST_CHECK(loggedContaining("dh <= 1024"));

    int64_t const B = 2;
    PluginTensorDesc rin[2] = {tensorDesc({B, 6, 257, 64}, DataType::kHALF), tensorDesc({B, 6, 64, 257}, DataType::kHALF)};
    PluginTensorDesc rout[1] = {tensorDesc({B, 256}, DataType::kFLOAT)};
    HOST_CHECK(runtime->onShapeChange(rin, 2, rout, 1) == 0);
    std::vector<uint16_t> q(B * 6 * 257 * 64), k(B * 6 * 64 * 257);
    std::vector<float> scores(B * 256);
    void const* ins[2] = {q.data(), k.data()};
    void* outs[1] = {scores.data()};
    auto* stream = reinterpret_cast<cudaStream_t>(0x5c0e);
    host_check::KernelCalls& calls = host_check::kernelCalls();
    calls = host_check::KernelCalls();
    HOST_CHECK(runtime->enqueue(rin, rout, ins, outs, nullptr, stream) == 0);
    HOST_CHECK(calls.scoreCalls == 1 && calls.selectCalls == 0 && calls.gatherCalls == 0);
    HOST_CHECK(calls.scoreDtype == VLMP_FLOAT16 && calls.scoreQ == q.data() && calls.scoreK == k.data());
    HOST_CHECK(calls.scoreB == B && calls.scoreH == 6 && calls.scoreT == 257 && calls.scoreDh == 64);
    HOST_CHECK(calls.scoreKTransposed == 1 && calls.scoreHasCls == 1 && calls.scoreInt8 == 1);
    HOST_CHECK(calls.scoreScale == 0.125F && calls.scoreOut == scores.data() && calls.scoreStream == stream);

    PluginFieldCollection const* serial = runtime->getFieldsToSerialize();
    HOST_CHECK(serial != nullptr && serial->nbFields == 4);
    PluginPtr restored(creator.createPlugin("score", serial, TensorRTPhase::kRUNTIME));
    HOST_CHECK(restored != nullptr);
    calls = host_check::KernelCalls();
    if (restored)
    {
        auto* rt = capability<IPluginV3OneRuntime>(*restored, PluginCapabilityType::kRUNTIME);
        HOST_CHECK(rt->enqueue(rin, rout, ins, outs, nullptr, stream) == 0);
        HOST_CHECK(calls.scoreInt8 == 1 && calls.scoreScale == 0.125F && calls.scoreKTransposed == 1);
    }
    calls = host_check::KernelCalls();
}

} // namespace

int main()
{
    HostLoggerFinder finder;
    setLoggerFinder(&finder);

    int32_t nbCreators = 0;
    IPluginCreatorInterface* const* creators = getCreators(nbCreators);
    HOST_CHECK(nbCreators == 2 && creators != nullptr && creators[0] != nullptr && creators[1] != nullptr);
    if (nbCreators != 2 || creators == nullptr || creators[0] == nullptr || creators[1] == nullptr)
    {
        return host_check::finish("host_check_v3");
    }
    checkScorer(*static_cast<IPluginCreatorV3One*>(creators[1]));
    auto& creator = *static_cast<IPluginCreatorV3One*>(creators[0]);
    checkCreator(creator);

    PluginPtr plugin = create(creator, 8, 1);
    HOST_CHECK(plugin != nullptr);
    if (plugin)
    {
        host_check::HostExprBuilder builder;
        checkBuild(*plugin, builder);
        checkRuntime(*plugin);
        checkSerialisation(creator, *plugin);
    }
    return host_check::finish("host_check_v3 (TensorRT " + std::to_string(NV_TENSORRT_MAJOR) + "."
        + std::to_string(NV_TENSORRT_MINOR) + " headers)");
}
