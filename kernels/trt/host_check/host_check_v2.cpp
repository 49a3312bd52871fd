/* Drives the TensorRT 8.5 wrapper (kernels/trt/v2) through its TensorRT interfaces
 * on the host: static registration, creator and fields, serialise / deserialise,
 * output types and shapes, format combinations, profile refusal, workspace and the
 * enqueue wiring (kernels and the int64 -> int32 cast replaced by host stubs).
 * Linked with the v2 .cpp sources (not index_cast.cu) and host_kernel_stubs.cpp.
 * C++14, like the wrapper.
 */
#include "host_check/host_fakes.h"
#include "v2/cls_score_plugin.h"
#include "v2/index_cast.h"
#include "v2/token_prune_plugin.h"

#include <cstring>
#include <memory>

using namespace nvinfer1;
using host_check::dynamicDesc;
using host_check::loggedContaining;
using host_check::loggedErrors;
using host_check::tensorDesc;

// IPluginV2 is deprecated in the 8.5 headers, yet it is what the creator returns.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace
{

// ---- what libnvinfer would provide ------------------------------------------------

class HostRegistry : public IPluginRegistry
{
public:
    bool registerCreator(IPluginCreator& creator, AsciiChar const* const pluginNamespace) noexcept override
    {
        creators.push_back(&creator);
        namespaces.emplace_back(pluginNamespace);
        return true;
    }
    IPluginCreator* const* getPluginCreatorList(int32_t* const numCreators) const noexcept override
    {
        *numCreators = static_cast<int32_t>(creators.size());
        return creators.data();
    }
    // Looks up by the creator's own name, version and namespace.
    IPluginCreator* getPluginCreator(AsciiChar const* const name, AsciiChar const* const version,
        AsciiChar const* const pluginNamespace) noexcept override
    {
        for (IPluginCreator* c : creators)
        {
            if (std::strcmp(c->getPluginName(), name) == 0 && std::strcmp(c->getPluginVersion(), version) == 0
                && std::strcmp(c->getPluginNamespace(), pluginNamespace) == 0)
            {
                return c;
            }
        }
        return nullptr;
    }
    void setErrorRecorder(IErrorRecorder* const) noexcept override {}
    IErrorRecorder* getErrorRecorder() const noexcept override
    {
        return nullptr;
    }
    bool deregisterCreator(IPluginCreator const&) noexcept override
    {
        return false;
    }

    std::vector<IPluginCreator*> creators;
    std::vector<std::string> namespaces;
};

HostRegistry& registry()
{
    static HostRegistry instance; // constructed on first use: registration runs during static init
    return instance;
}

host_check::RecordingLogger& logger()
{
    static host_check::RecordingLogger instance;
    return instance;
}

struct CastCall
{
    int calls = 0;
    int64_t const* in = nullptr;
    int32_t* out = nullptr;
    int64_t count = 0;
    cudaStream_t stream = nullptr;
};

CastCall& castCall()
{
    static CastCall call;
    return call;
}

} // namespace

extern "C" IPluginRegistry* getPluginRegistry() noexcept
{
    return &registry();
}

extern "C" ILogger* getLogger() noexcept
{
    return &logger();
}

// Host twin of index_cast.cu: the same narrowing, on host memory.
cudaError_t vlmprune::trt::castIndicesToInt32(
    int64_t const* in, int32_t* out, int64_t count, cudaStream_t stream) noexcept
{
    CastCall& c = castCall();
    ++c.calls;
    c.in = in;
    c.out = out;
    c.count = count;
    c.stream = stream;
    for (int64_t i = 0; i < count; ++i)
    {
        out[i] = static_cast<int32_t>(in[i]);
    }
    return cudaSuccess;
}

namespace
{

struct PluginDeleter
{
    void operator()(IPluginV2* p) const
    {
        p->destroy();
    }
};
using PluginPtr = std::unique_ptr<IPluginV2DynamicExt, PluginDeleter>;

PluginPtr create(IPluginCreator& creator, int32_t keep, int32_t hasCls)
{
    std::vector<PluginField> f{PluginField("keep", &keep, PluginFieldType::kINT32, 1),
        PluginField("has_cls", &hasCls, PluginFieldType::kINT32, 1)};
    PluginFieldCollection fc{static_cast<int32_t>(f.size()), f.data()};
    return PluginPtr(static_cast<IPluginV2DynamicExt*>(creator.createPlugin("prune", &fc)));
}

void checkRegistration()
{
    HostRegistry& r = registry();
    HOST_CHECK(r.creators.size() == 2); // VlmpTokenPrune, then VlmpClsScore (register.cpp)
    if (r.creators.size() != 2)
    {
        return;
    }
    IPluginCreator& creator = *r.creators[0];
    HOST_CHECK(r.namespaces[0].empty()); // what REGISTER_TENSORRT_PLUGIN passes
    HOST_CHECK(std::strcmp(creator.getPluginName(), "VlmpTokenPrune") == 0);
    HOST_CHECK(std::strcmp(creator.getPluginVersion(), "1") == 0);
    HOST_CHECK(std::strcmp(creator.getPluginNamespace(), "vlmprune") == 0);
    // The lookup the ONNX parser makes for op_type / plugin_version / plugin_namespace.
    HOST_CHECK(r.getPluginCreator("VlmpTokenPrune", "1", "vlmprune") == &creator);

    PluginFieldCollection const* names = creator.getFieldNames();
    HOST_CHECK(names != nullptr && names->nbFields == 2);
    HOST_CHECK(std::strcmp(names->fields[0].name, "keep") == 0 && names->fields[0].type == PluginFieldType::kINT32);
    HOST_CHECK(std::strcmp(names->fields[1].name, "has_cls") == 0 && names->fields[1].type == PluginFieldType::kINT32);

    // An empty namespace (registration's) does not replace the contract's; others do.
    creator.setPluginNamespace("");
    HOST_CHECK(std::strcmp(creator.getPluginNamespace(), "vlmprune") == 0);

    loggedErrors().clear();
    HOST_CHECK(create(creator, 0, 1) == nullptr);
    HOST_CHECK(loggedContaining("VlmpTokenPrune::createPlugin: keep must be in [1, 4095]"));
    HOST_CHECK(create(creator, 8, -1) == nullptr);
    HOST_CHECK(loggedContaining("has_cls must be 0 or 1"));
}

void checkSerialisation(IPluginCreator& creator, IPluginV2DynamicExt& plugin)
{
    HOST_CHECK(plugin.getSerializationSize() == 2 * sizeof(int32_t));
    std::vector<char> blob(plugin.getSerializationSize());
    plugin.serialize(blob.data());
    PluginPtr restored(static_cast<IPluginV2DynamicExt*>(
        creator.deserializePlugin("prune", blob.data(), blob.size())));
    HOST_CHECK(restored != nullptr);
    if (restored)
    {
        std::vector<char> again(restored->getSerializationSize());
        restored->serialize(again.data());
        HOST_CHECK(again == blob);
        HOST_CHECK(std::strcmp(restored->getPluginNamespace(), "vlmprune") == 0);
    }
    loggedErrors().clear();
    HOST_CHECK(creator.deserializePlugin("prune", blob.data(), blob.size() - 1) == nullptr);
    HOST_CHECK(loggedContaining("deserializePlugin"));
    int32_t const badKeep[2] = {0, 1};
    HOST_CHECK(creator.deserializePlugin("prune", badKeep, sizeof(badKeep)) == nullptr);

    PluginPtr copy(plugin.clone());
    HOST_CHECK(copy != nullptr && copy.get() != &plugin);
    if (copy)
    {
        std::vector<char> copied(copy->getSerializationSize());
        copy->serialize(copied.data());
        HOST_CHECK(copied == blob);
    }
}

void checkBuild(IPluginV2DynamicExt& plugin)
{
    HOST_CHECK(std::strcmp(plugin.getPluginType(), "VlmpTokenPrune") == 0);
    HOST_CHECK(std::strcmp(plugin.getPluginVersion(), "1") == 0);
    HOST_CHECK(std::strcmp(plugin.getPluginNamespace(), "vlmprune") == 0);
    HOST_CHECK(plugin.getNbOutputs() == 2);
    HOST_CHECK(plugin.initialize() == 0);

    DataType in[2] = {DataType::kHALF, DataType::kFLOAT};
    HOST_CHECK(plugin.getOutputDataType(0, in, 2) == DataType::kHALF);
    HOST_CHECK(plugin.getOutputDataType(1, in, 2) == DataType::kINT32);

    host_check::HostExprBuilder builder;
    DimsExprs inputs[2] = {builder.dims({-1, 577, 1024}), builder.dims({-1, 576})};
    DimsExprs tokens = plugin.getOutputDimensions(0, inputs, 2, builder);
    DimsExprs kept = plugin.getOutputDimensions(1, inputs, 2, builder);
    HOST_CHECK(tokens.nbDims == 3 && kept.nbDims == 2);
    HOST_CHECK(tokens.d[0] == inputs[0].d[0] && kept.d[0] == inputs[0].d[0]);
    HOST_CHECK(host_check::constantOr(tokens.d[1], -1) == 10);
    HOST_CHECK(host_check::constantOr(tokens.d[2], -1) == 1024);
    HOST_CHECK(host_check::constantOr(kept.d[1], -1) == 8);
    loggedErrors().clear();
    DimsExprs tooMany[2] = {builder.dims({1, 5001, 64}), builder.dims({1, 5000})};
    plugin.getOutputDimensions(0, tooMany, 2, builder);
    HOST_CHECK(loggedContaining("VlmpTokenPrune::getOutputDimensions: N=5000 patches exceeds"));

    auto io = [](DataType hidden, DataType scores, DataType tokensType, DataType idx) {
        std::vector<PluginTensorDesc> d{tensorDesc({1, 577, 64}, hidden), tensorDesc({1, 576}, scores),
            tensorDesc({1, 10, 64}, tokensType), tensorDesc({1, 8}, idx)};
        return d;
    };
    auto supportsAll = [&](std::vector<PluginTensorDesc> const& d) {
        bool ok = true;
        for (int32_t pos = 0; pos < 4; ++pos)
        {
            ok = ok && plugin.supportsFormatCombination(pos, d.data(), 2, 2);
        }
        return ok;
    };
    HOST_CHECK(supportsAll(io(DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT, DataType::kINT32)));
    HOST_CHECK(supportsAll(io(DataType::kHALF, DataType::kFLOAT, DataType::kHALF, DataType::kINT32)));
    HOST_CHECK(!supportsAll(io(DataType::kHALF, DataType::kFLOAT, DataType::kFLOAT, DataType::kINT32)));
    HOST_CHECK(!supportsAll(io(DataType::kFLOAT, DataType::kHALF, DataType::kFLOAT, DataType::kINT32)));
    HOST_CHECK(!supportsAll(io(DataType::kINT8, DataType::kFLOAT, DataType::kINT8, DataType::kINT32)));
    std::vector<PluginTensorDesc> vectorized = io(DataType::kHALF, DataType::kFLOAT, DataType::kHALF, DataType::kINT32);
    vectorized[0].format = TensorFormat::kHWC8;
    HOST_CHECK(!plugin.supportsFormatCombination(0, vectorized.data(), 2, 2));

    PluginTensorDesc wsIn[2] = {tensorDesc({4, 577, 64}, DataType::kHALF), tensorDesc({4, 576}, DataType::kFLOAT)};
    HOST_CHECK(plugin.getWorkspaceSize(wsIn, 2, nullptr, 2) == 4 * 8 * sizeof(int64_t));
}

void configure(IPluginV2DynamicExt& plugin, int64_t maxN)
{
    std::vector<DynamicPluginTensorDesc> d{dynamicDesc({1, 1 + 576, 64}, {8, 1 + maxN, 64}, DataType::kHALF),
        dynamicDesc({1, 576}, {8, maxN}, DataType::kFLOAT), dynamicDesc({1, 10, 64}, {8, 10, 64}, DataType::kHALF),
        dynamicDesc({1, 8}, {8, 8}, DataType::kINT32)};
    plugin.configurePlugin(d.data(), 2, d.data() + 2, 2);
}

void checkEnqueue(IPluginV2DynamicExt& plugin)
{
    int64_t const B = 2, T = 577, N = 576, D = 64, K = 8;
    PluginTensorDesc in[2] = {tensorDesc({B, T, D}, DataType::kHALF), tensorDesc({B, N}, DataType::kFLOAT)};
    PluginTensorDesc out[2] = {tensorDesc({B, K + 2, D}, DataType::kHALF), tensorDesc({B, K}, DataType::kINT32)};
    std::vector<uint16_t> hidden(B * T * D);
    std::vector<float> scores(B * N);
    std::vector<uint16_t> tokens(B * (K + 2) * D);
    std::vector<int32_t> kept32(B * K, -1);
    std::vector<int64_t> workspace(plugin.getWorkspaceSize(in, 2, out, 2) / sizeof(int64_t), -1);
    void const* inputs[2] = {hidden.data(), scores.data()};
    void* outputs[2] = {tokens.data(), kept32.data()};
    auto* stream = reinterpret_cast<cudaStream_t>(0x5eed);

    configure(plugin, 576);
    host_check::KernelCalls& calls = host_check::kernelCalls();
    calls = host_check::KernelCalls();
    castCall() = CastCall();
    HOST_CHECK(plugin.enqueue(in, out, inputs, outputs, workspace.data(), stream) == 0);
    HOST_CHECK(calls.selectCalls == 1 && calls.gatherCalls == 1);
    HOST_CHECK(calls.scores == scores.data() && calls.selB == B && calls.selN == N && calls.selK == K);
    HOST_CHECK(calls.selKept == workspace.data()); // int64 staging in the workspace
    HOST_CHECK(calls.dtype == VLMP_FLOAT16 && calls.hidden == hidden.data() && calls.out == tokens.data());
    HOST_CHECK(calls.gatB == B && calls.gatT == T && calls.gatD == D && calls.gatK == K && calls.hasCls == 1);
    HOST_CHECK(calls.gatKept == workspace.data());
    HOST_CHECK(calls.selStream == stream && calls.gatStream == stream);
    HOST_CHECK(castCall().calls == 1 && castCall().in == workspace.data() && castCall().out == kept32.data());
    HOST_CHECK(castCall().count == B * K && castCall().stream == stream);
    HOST_CHECK(kept32[K + 3] == host_check::stubIndex(1, 3));

    // A profile beyond the kernel's N <= 4096 is refused at configure time and the
    // refusal sticks: enqueue (the builder's timing run) then fails without launching.
    loggedErrors().clear();
    configure(plugin, 4097);
    HOST_CHECK(loggedContaining("configurePlugin (profile max): N=4097 patches exceeds"));
    calls = host_check::KernelCalls();
    HOST_CHECK(plugin.enqueue(in, out, inputs, outputs, workspace.data(), stream) != 0);
    HOST_CHECK(calls.selectCalls == 0 && calls.gatherCalls == 0);
    PluginPtr refusedCopy(plugin.clone());
    HOST_CHECK(refusedCopy && refusedCopy->enqueue(in, out, inputs, outputs, workspace.data(), stream) != 0);
    configure(plugin, 576);
    HOST_CHECK(plugin.enqueue(in, out, inputs, outputs, workspace.data(), stream) == 0);

    // Kernel errors are returned; the cast does not run after them.
    calls = host_check::KernelCalls();
    calls.selectResult = VLMP_ERR_INVALID_ARGUMENT;
    castCall() = CastCall();
    HOST_CHECK(plugin.enqueue(in, out, inputs, outputs, workspace.data(), stream) == VLMP_ERR_INVALID_ARGUMENT);
    HOST_CHECK(castCall().calls == 0);
    calls = host_check::KernelCalls();
}

// VlmpClsScore through TensorRT 8.5's interfaces: creator, shapes, formats, profile refusal
// (recorded, then enqueue refuses), enqueue wiring, serialisation round trip.
void checkScorer(IPluginCreator& creator)
{
    HOST_CHECK(std::strcmp(creator.getPluginName(), "VlmpClsScore") == 0);
    HOST_CHECK(std::strcmp(creator.getPluginVersion(), "1") == 0);
    HOST_CHECK(std::strcmp(creator.getPluginNamespace(), "vlmprune") == 0);
    HOST_CHECK(creator.getFieldNames() != nullptr && creator.getFieldNames()->nbFields == 4);
    float scale = 0.125F;
    int32_t hasCls = 1, int8 = 1, kTransposed = 0;
    std::vector<PluginField> f{PluginField("scale", &scale, PluginFieldType::kFLOAT32, 1),
        PluginField("has_cls", &hasCls, PluginFieldType::kINT32, 1),
        PluginField("int8", &int8, PluginFieldType::kINT32, 1),
        PluginField("k_transposed", &kTransposed, PluginFieldType::kINT32, 1)};
    PluginFieldCollection fc{static_cast<int32_t>(f.size()), f.data()};
    std::vector<PluginField> intScale{PluginField("scale", &hasCls, PluginFieldType::kINT32, 1), f[1], f[2], f[3]};
    PluginFieldCollection badFc{static_cast<int32_t>(intScale.size()), intScale.data()};
    HOST_CHECK(creator.createPlugin("score", &badFc) == nullptr);
    HOST_CHECK(loggedContaining("VlmpClsScore::createPlugin: field 'scale' must be one float32"));

    PluginPtr plugin(static_cast<IPluginV2DynamicExt*>(creator.createPlugin("score", &fc)));
    HOST_CHECK(plugin != nullptr);
    if (!plugin)
    {
        return;
    }
    HOST_CHECK(std::strcmp(plugin->getPluginType(), "VlmpClsScore") == 0);
    HOST_CHECK(std::strcmp(plugin->getPluginNamespace(), "vlmprune") == 0);
    HOST_CHECK(plugin->getNbOutputs() == 1);
    DataType in[2] = {DataType::kHALF, DataType::kHALF};
    HOST_CHECK(plugin->getOutputDataType(0, in, 2) == DataType::kFLOAT);
    host_check::HostExprBuilder builder;
    DimsExprs inputs[2] = {builder.dims({-1, 6, 257, 64}), builder.dims({-1, 6, 257, 64})};
    DimsExprs out = plugin->getOutputDimensions(0, inputs, 2, builder);
    HOST_CHECK(out.nbDims == 2 && out.d[0] == inputs[0].d[0]);

    std::vector<DynamicPluginTensorDesc> d{dynamicDesc({1, 6, 257, 64}, {4, 6, 257, 64}, DataType::kFLOAT),
        dynamicDesc({1, 6, 257, 64}, {4, 6, 257, 64}, DataType::kFLOAT),
        dynamicDesc({1, 256}, {4, 256}, DataType::kFLOAT)};
    PluginTensorDesc formats[3] = {d[0].desc, d[1].desc, d[2].desc};
    HOST_CHECK(plugin->supportsFormatCombination(0, formats, 2, 1));
    HOST_CHECK(plugin->supportsFormatCombination(1, formats, 2, 1));
    HOST_CHECK(plugin->supportsFormatCombination(2, formats, 2, 1));
    formats[2].type = DataType::kHALF;
    HOST_CHECK(!plugin->supportsFormatCombination(2, formats, 2, 1));

    int64_t const B = 2;
    PluginTensorDesc rin[2] = {tensorDesc({B, 6, 257, 64}, DataType::kFLOAT), tensorDesc({B, 6, 257, 64}, DataType::kFLOAT)};
    PluginTensorDesc rout[1] = {tensorDesc({B, 256}, DataType::kFLOAT)};
    std::vector<float> q(B * 6 * 257 * 64), k(B * 6 * 257 * 64), scores(B * 256);
    void const* ins[2] = {q.data(), k.data()};
    void* outs[1] = {scores.data()};
    auto* stream = reinterpret_cast<cudaStream_t>(0x5c0e);
    host_check::KernelCalls& calls = host_check::kernelCalls();

    std::vector<DynamicPluginTensorDesc> big{dynamicDesc({1, 6, 5000, 64}, {1, 6, 5000, 64}, DataType::kFLOAT),
        dynamicDesc({1, 6, 5000, 64}, {1, 6, 5000, 64}, DataType::kFLOAT), d[2]};
    plugin->configurePlugin(big.data(), 2, &big[2], 1);
    HOST_CHECK(loggedContaining("T <= 4097"));
    calls = host_check::KernelCalls();
    HOST_CHECK(plugin->enqueue(rin, rout, ins, outs, nullptr, stream) != 0);
    HOST_CHECK(calls.scoreCalls == 0);

    plugin->configurePlugin(d.data(), 2, &d[2], 1);
    HOST_CHECK(plugin->getWorkspaceSize(rin, 2, rout, 1) == 0);
    HOST_CHECK(plugin->enqueue(rin, rout, ins, outs, nullptr, stream) == 0);
    HOST_CHECK(calls.scoreCalls == 1 && calls.selectCalls == 0 && calls.gatherCalls == 0);
    HOST_CHECK(calls.scoreDtype == VLMP_FLOAT32 && calls.scoreQ == q.data() && calls.scoreK == k.data());
    HOST_CHECK(calls.scoreB == B && calls.scoreH == 6 && calls.scoreT == 257 && calls.scoreDh == 64);
    HOST_CHECK(calls.scoreKTransposed == 0 && calls.scoreHasCls == 1 && calls.scoreInt8 == 1);
    HOST_CHECK(calls.scoreScale == 0.125F && calls.scoreOut == scores.data() && calls.scoreStream == stream);

    std::vector<char> blob(plugin->getSerializationSize());
    HOST_CHECK(blob.size() == vlmprune::trt::ClsScorePluginV2::kSerializedSize);
    plugin->serialize(blob.data());
    PluginPtr restored(static_cast<IPluginV2DynamicExt*>(creator.deserializePlugin("score", blob.data(), blob.size())));
    HOST_CHECK(restored != nullptr);
    HOST_CHECK(creator.deserializePlugin("score", blob.data(), blob.size() - 1) == nullptr);
    if (restored)
    {
        restored->configurePlugin(d.data(), 2, &d[2], 1);
        calls = host_check::KernelCalls();
        HOST_CHECK(restored->enqueue(rin, rout, ins, outs, nullptr, stream) == 0);
        HOST_CHECK(calls.scoreInt8 == 1 && calls.scoreScale == 0.125F && calls.scoreKTransposed == 0);
    }
    calls = host_check::KernelCalls();
}

} // namespace

int main()
{
    checkRegistration();
    if (registry().creators.size() == 2)
    {
        checkScorer(*registry().creators[1]);
        IPluginCreator& creator = *registry().creators[0];
        PluginPtr plugin = create(creator, 8, 1);
        HOST_CHECK(plugin != nullptr);
        if (plugin)
        {
            checkSerialisation(creator, *plugin);
            checkBuild(*plugin);
            checkEnqueue(*plugin);
            plugin->terminate();
        }
    }
    return host_check::finish("host_check_v2 (TensorRT " + std::to_string(NV_TENSORRT_MAJOR) + "."
        + std::to_string(NV_TENSORRT_MINOR) + " headers)");
}
