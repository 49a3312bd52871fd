/* Host-only stand-ins for what TensorRT and the CUDA kernels provide, so the plugin
 * wrappers can be driven through their TensorRT interfaces on a machine with neither
 * (tools/trt_compile_check.py builds and runs host_check_v2/v3.cpp with these).
 * Test code, not shipped in any plugin library. C++14 (the v2 check builds as C++14).
 */
#ifndef VLMPRUNE_TRT_HOST_FAKES_H
#define VLMPRUNE_TRT_HOST_FAKES_H

#include "vlmprune/kernels.h"

#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <deque>
#include <string>
#include <vector>

namespace host_check
{

// ---- checks -------------------------------------------------------------------

inline int& failures()
{
    static int count = 0;
    return count;
}

#define HOST_CHECK(cond)                                                                                               \
    do                                                                                                                 \
    {                                                                                                                  \
        if (!(cond))                                                                                                   \
        {                                                                                                              \
            std::printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);                                                \
            ++host_check::failures();                                                                                  \
        }                                                                                                              \
    } while (0)

inline int finish(std::string const& what)
{
    if (failures() == 0)
    {
        std::printf("PASS %s\n", what.c_str());
        return 0;
    }
    std::printf("FAILED %s: %d check(s)\n", what.c_str(), failures());
    return 1;
}

// ---- errors the plugin logs -----------------------------------------------------

inline std::vector<std::string>& loggedErrors()
{
    static std::vector<std::string> errors;
    return errors;
}

inline bool loggedContaining(char const* text)
{
    for (std::string const& e : loggedErrors())
    {
        if (e.find(text) != std::string::npos)
        {
            return true;
        }
    }
    return false;
}

class RecordingLogger : public nvinfer1::ILogger
{
public:
    void log(Severity severity, nvinfer1::AsciiChar const* msg) noexcept override
    {
        if (severity <= Severity::kERROR)
        {
            loggedErrors().emplace_back(msg);
        }
    }
};

// ---- dimension expressions ------------------------------------------------------

#if NV_TENSORRT_MAJOR >= 10
using DimValue = int64_t;
#else
using DimValue = int32_t;
#endif

class HostDimImpl : public nvinfer1::apiv::VDimensionExpr
{
public:
    HostDimImpl(bool constant, DimValue value)
        : mConstant(constant)
        , mValue(value)
    {
    }
    bool isConstant() const override
    {
        return mConstant;
    }
    DimValue getConstantValue() const override
    {
        return mValue;
    }
#if NV_TENSORRT_MAJOR >= 10
    bool isSizeTensor() const override
    {
        return false;
    }
#endif

private:
    bool mConstant;
    DimValue mValue;
};

class HostDim : public nvinfer1::IDimensionExpr
{
public:
    explicit HostDim(HostDimImpl* impl)
    {
        mImpl = impl;
    }
    ~HostDim() override = default;
};

// Owns every expression it hands out; `runtime()` is a dimension unknown at build time.
class HostExprBuilder : public nvinfer1::IExprBuilder, private nvinfer1::apiv::VExprBuilder
{
public:
    HostExprBuilder()
    {
        nvinfer1::IExprBuilder::mImpl = this;
    }
    ~HostExprBuilder() override = default;

    nvinfer1::IDimensionExpr const* make(bool constant, DimValue value)
    {
        mImpls.emplace_back(constant, value);
        mDims.emplace_back(&mImpls.back());
        return &mDims.back();
    }
    nvinfer1::IDimensionExpr const* runtime()
    {
        return make(false, -1);
    }
    nvinfer1::IDimensionExpr const* constant(DimValue value) override
    {
        return make(true, value);
    }
    nvinfer1::IDimensionExpr const* operation(nvinfer1::DimensionOperation, nvinfer1::IDimensionExpr const&,
        nvinfer1::IDimensionExpr const&) override
    {
        return runtime(); // the plugins build outputs from constants and input dims only
    }
#if NV_TENSORRT_MAJOR >= 10
    nvinfer1::IDimensionExpr const* declareSizeTensor(
        int32_t, nvinfer1::IDimensionExpr const&, nvinfer1::IDimensionExpr const&) override
    {
        return nullptr;
    }
#endif

    // A DimsExprs whose entries are constants, or runtime dims where value < 0.
    nvinfer1::DimsExprs dims(std::vector<int64_t> const& values)
    {
        nvinfer1::DimsExprs out{};
        out.nbDims = static_cast<int32_t>(values.size());
        for (size_t i = 0; i < values.size(); ++i)
        {
            out.d[i] = values[i] < 0 ? runtime() : constant(static_cast<DimValue>(values[i]));
        }
        return out;
    }

private:
    std::deque<HostDimImpl> mImpls;
    std::deque<HostDim> mDims;
};

inline int64_t constantOr(nvinfer1::IDimensionExpr const* e, int64_t unknown)
{
    return e != nullptr && e->isConstant() ? static_cast<int64_t>(e->getConstantValue()) : unknown;
}

// ---- tensor descriptions --------------------------------------------------------

inline nvinfer1::Dims makeDims(std::vector<int64_t> const& values)
{
    nvinfer1::Dims d{};
    d.nbDims = static_cast<int32_t>(values.size());
    for (size_t i = 0; i < values.size(); ++i)
    {
        d.d[i] = static_cast<host_check::DimValue>(values[i]);
    }
    return d;
}

inline nvinfer1::PluginTensorDesc tensorDesc(std::vector<int64_t> const& dims, nvinfer1::DataType type,
    nvinfer1::TensorFormat format = nvinfer1::TensorFormat::kLINEAR)
{
    nvinfer1::PluginTensorDesc d{};
    d.dims = makeDims(dims);
    d.type = type;
    d.format = format;
    d.scale = 1.F;
    return d;
}

inline nvinfer1::DynamicPluginTensorDesc dynamicDesc(std::vector<int64_t> const& min, std::vector<int64_t> const& max,
    nvinfer1::DataType type)
{
    nvinfer1::DynamicPluginTensorDesc d{};
    std::vector<int64_t> declared(min.size());
    for (size_t i = 0; i < min.size(); ++i)
    {
        declared[i] = min[i] == max[i] ? min[i] : -1;
    }
    d.desc = tensorDesc(declared, type);
    d.min = makeDims(min);
    d.max = makeDims(max);
#if NV_TENSORRT_MAJOR >= 10
    d.opt = makeDims(max); // DynamicPluginTensorDesc::opt appeared in TensorRT 10
#endif
    return d;
}

// ---- kernel stubs (host_kernel_stubs.cpp) --------------------------------------

struct KernelCalls
{
    int selectCalls = 0;
    int gatherCalls = 0;
    // Last vlmp_select_topk_cuda call.
    float const* scores = nullptr;
    int64_t selB = 0, selN = 0, selK = 0;
    int64_t* selKept = nullptr;
    void* selStream = nullptr;
    // Last vlmp_gather_summary_cuda call.
    vlmp_dtype dtype = VLMP_FLOAT32;
    void const* hidden = nullptr;
    int64_t gatB = 0, gatT = 0, gatD = 0, gatK = 0;
    int hasCls = -1;
    int64_t const* gatKept = nullptr;
    void* out = nullptr;
    void* gatStream = nullptr;
    // Last vlmp_cls_scores_cuda call (VlmpClsScore).
    int scoreCalls = 0;
    vlmp_dtype scoreDtype = VLMP_FLOAT32;
    void const* scoreQ = nullptr;
    void const* scoreK = nullptr;
    int64_t scoreB = 0, scoreH = 0, scoreT = 0, scoreDh = 0;
    int scoreKTransposed = -1, scoreHasCls = -1, scoreInt8 = -1;
    float scoreScale = 0.0f;
    float* scoreOut = nullptr;
    void* scoreStream = nullptr;
    // Status the next calls return, and what cudaGetLastError() then reports.
    vlmp_status selectResult = VLMP_OK;
    cudaError_t lastCudaError = cudaSuccess;
};

KernelCalls& kernelCalls();

// What the select stub writes at kept[b * K + i], so a consumer can be checked.
inline int64_t stubIndex(int64_t b, int64_t i)
{
    return 1000 * b + 2 * i + 1;
}

} // namespace host_check

#endif // VLMPRUNE_TRT_HOST_FAKES_H
