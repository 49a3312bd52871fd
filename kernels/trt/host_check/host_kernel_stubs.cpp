/* Host stand-ins for the CUDA entry points the plugins call: they record their
 * arguments and write recognisable indices, so the checks can follow the wiring
 * (which buffer, which sizes, which stream) without a GPU. Numerics are the
 * kernels' own tests' business. Also the two CUDA runtime calls of the error path.
 */
#include "host_check/host_fakes.h"

namespace host_check
{

KernelCalls& kernelCalls()
{
    static KernelCalls calls;
    return calls;
}

} // namespace host_check

extern "C" vlmp_status vlmp_select_topk_cuda(
    float const* scores, int64_t B, int64_t N, int64_t K, int64_t* kept, void* stream)
{
    host_check::KernelCalls& c = host_check::kernelCalls();
    ++c.selectCalls;
    c.scores = scores;
    c.selB = B;
    c.selN = N;
    c.selK = K;
    c.selKept = kept;
    c.selStream = stream;
    if (c.selectResult != VLMP_OK)
    {
        return c.selectResult;
    }
    for (int64_t b = 0; b < B; ++b)
    {
        for (int64_t i = 0; i < K; ++i)
        {
            kept[b * K + i] = host_check::stubIndex(b, i);
        }
    }
    return VLMP_OK;
}

extern "C" vlmp_status vlmp_gather_summary_cuda(vlmp_dtype dt, void const* hidden, int64_t B, int64_t T, int64_t D,
    int has_cls, int64_t const* kept, int64_t K, void* out, void* stream)
{
    host_check::KernelCalls& c = host_check::kernelCalls();
    ++c.gatherCalls;
    c.dtype = dt;
    c.hidden = hidden;
    c.gatB = B;
    c.gatT = T;
    c.gatD = D;
    c.hasCls = has_cls;
    c.gatKept = kept;
    c.gatK = K;
    c.out = out;
    c.gatStream = stream;
    return VLMP_OK;
}

extern "C" vlmp_status vlmp_cls_scores_cuda(vlmp_dtype dt, void const* q, void const* k, int64_t B, int64_t H,
    int64_t T, int64_t dh, int k_transposed, float scale, int has_cls, int int8, float* scores, void* stream)
{
    host_check::KernelCalls& c = host_check::kernelCalls();
    ++c.scoreCalls;
    c.scoreDtype = dt;
    c.scoreQ = q;
    c.scoreK = k;
    c.scoreB = B;
    c.scoreH = H;
    c.scoreT = T;
    c.scoreDh = dh;
    c.scoreKTransposed = k_transposed;
    c.scoreScale = scale;
    c.scoreHasCls = has_cls;
    c.scoreInt8 = int8;
    c.scoreOut = scores;
    c.scoreStream = stream;
    return VLMP_OK;
}

extern "C" cudaError_t cudaGetLastError()
{
    return host_check::kernelCalls().lastCudaError;
}

extern "C" char const* cudaGetErrorString(cudaError_t error)
{
    return error == cudaSuccess ? "no error" : "host stub CUDA error";
}
