/* int64 -> int32 narrowing of the kept indices for the TensorRT 8.5 wrapper, whose
 * plugin outputs cannot be int64. A wrapper concern, so it lives here and not in
 * the kernels' C ABI. C++14.
 */
#ifndef VLMPRUNE_TRT_V2_INDEX_CAST_H
#define VLMPRUNE_TRT_V2_INDEX_CAST_H

#include <cuda_runtime_api.h>

#include <cstdint>

namespace vlmprune
{
namespace trt
{

// Enqueues out[i] = int32(in[i]) for i < count on `stream`; returns the launch status.
// The values are patch indices (< 4096), so the narrowing is exact.
cudaError_t castIndicesToInt32(int64_t const* in, int32_t* out, int64_t count, cudaStream_t stream) noexcept;

} // namespace trt
} // namespace vlmprune

#endif // VLMPRUNE_TRT_V2_INDEX_CAST_H
