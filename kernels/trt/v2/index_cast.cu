#include "v2/index_cast.h"

namespace vlmprune
{
namespace trt
{
namespace
{

constexpr int kThreads = 256;
// count is B * keep (thousands at most), so a grid-stride loop over a capped grid
// covers any size without 64-bit grid arithmetic.
constexpr int64_t kMaxBlocks = 1024;

__global__ void castIndicesKernel(int64_t const* in, int32_t* out, int64_t count)
{
    int64_t const stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    {
        out[i] = static_cast<int32_t>(in[i]);
    }
}

} // namespace

cudaError_t castIndicesToInt32(int64_t const* in, int32_t* out, int64_t count, cudaStream_t stream) noexcept
{
    if (count <= 0)
    {
        return cudaSuccess;
    }
    int64_t const wanted = (count + kThreads - 1) / kThreads;
    int const blocks = static_cast<int>(wanted < kMaxBlocks ? wanted : kMaxBlocks);
    castIndicesKernel<<<blocks, kThreads, 0, stream>>>(in, out, count);
    return cudaGetLastError();
}

} // namespace trt
} // namespace vlmprune
