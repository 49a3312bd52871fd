/* Attribute and shape checks shared by the TensorRT 10 (IPluginV3) and 8.5
 * (IPluginV2DynamicExt) wrappers, so that both refuse the same cases with the same
 * words. Header-only and C++14 (see plugin_names.h).
 */
#ifndef VLMPRUNE_TRT_TOKEN_PRUNE_CHECKS_H
#define VLMPRUNE_TRT_TOKEN_PRUNE_CHECKS_H

#include "common/plugin_names.h"
#include "vlmprune/kernels.h"

#include <cstdint>
#include <cstdio>
#include <string>

namespace vlmprune
{
namespace trt
{

// Defined once per plugin library, next to its registration entry points: TensorRT 10
// hands a logger over through setLoggerFinder(), TensorRT 8.5 through getLogger().
void logError(char const* message) noexcept;

// "plugin::where: why", for either plugin of this library (kTokenPruneName, kClsScoreName).
// Formats into a fixed buffer: reporting must still work when the heap does not.
inline void logErrorAs(char const* plugin, char const* where, char const* why) noexcept
{
    char message[512];
    std::snprintf(message, sizeof(message), "%s::%s: %s", plugin, where, why);
    logError(message);
}

inline void logPluginError(char const* where, char const* why) noexcept
{
    logErrorAs(kTokenPruneName, where, why);
}

// Runs `check` (returns an empty string when all is well, else why not) and logs its
// verdict under `plugin`'s name; true means rejected. An allocation failure while
// building the message counts as a rejection, so the TensorRT methods can stay noexcept.
template <typename Check>
bool rejectedAs(char const* plugin, char const* where, Check&& check) noexcept
{
    try
    {
        std::string const why = check();
        if (why.empty())
        {
            return false;
        }
        logErrorAs(plugin, where, why.c_str());
    }
    catch (...)
    {
        logErrorAs(plugin, where, "out of host memory");
    }
    return true;
}

template <typename Check>
bool rejected(char const* where, Check&& check) noexcept
{
    return rejectedAs(kTokenPruneName, where, check);
}

// setPluginNamespace() of the TensorRT 8.5 wrappers: REGISTER_TENSORRT_PLUGIN registers
// with the namespace "", and the ONNX node asks for the contract's namespace, so an
// empty namespace never replaces it.
inline void assignNamespace(char const* plugin, std::string& target, char const* pluginNamespace) noexcept
{
    if (pluginNamespace == nullptr || pluginNamespace[0] == '\0')
    {
        return;
    }
    try
    {
        target = pluginNamespace;
    }
    catch (...)
    {
        logErrorAs(plugin, "setPluginNamespace", "out of host memory");
    }
}

// vlmp_status (kernels/include/vlmprune/kernels.h) in words, for log messages.
inline char const* kernelStatusName(vlmp_status status) noexcept
{
    switch (status)
    {
    case VLMP_OK: return "VLMP_OK";
    case VLMP_ERR_INVALID_ARGUMENT: return "VLMP_ERR_INVALID_ARGUMENT";
    case VLMP_ERR_UNSUPPORTED: return "VLMP_ERR_UNSUPPORTED";
    case VLMP_ERR_CUDA: return "VLMP_ERR_CUDA";
    }
    return "unknown vlmp_status";
}

// Logs "step returned STATUS[: cudaReason]" under `plugin`'s name (cudaReason: CUDA's
// cudaGetErrorString after VLMP_ERR_CUDA, else ""); returns the status as enqueue()'s result.
inline int32_t kernelFailed(char const* plugin, char const* step, vlmp_status status, char const* cudaReason) noexcept
{
    char why[256];
    std::snprintf(why, sizeof(why), "%s returned %s%s%s", step, kernelStatusName(status),
        cudaReason[0] != '\0' ? ": " : "", cudaReason);
    logErrorAs(plugin, "enqueue", why);
    return static_cast<int32_t>(status);
}

inline std::string checkAttributes(int64_t keep, int64_t hasCls)
{
    if (hasCls != 0 && hasCls != 1)
    {
        return "has_cls must be 0 or 1, got " + std::to_string(hasCls);
    }
    if (keep < 1 || keep >= kMaxPatches)
    {
        return "keep must be in [1, " + std::to_string(kMaxPatches - 1) + "], got " + std::to_string(keep);
    }
    return std::string();
}

// The extents one call sees: hidden [B, T, D], scores [B, N]. A negative extent is
// unknown (a runtime dimension while the network is being built) and is not checked.
struct PruneExtents
{
    int64_t hiddenBatch;
    int64_t tokens;
    int64_t scoresBatch;
    int64_t patches;
};

inline std::string checkExtents(PruneExtents const& e, int64_t keep, int64_t hasCls)
{
    if (e.hiddenBatch >= 0 && e.scoresBatch >= 0 && e.hiddenBatch != e.scoresBatch)
    {
        return "hidden has batch " + std::to_string(e.hiddenBatch) + " but scores has batch "
            + std::to_string(e.scoresBatch);
    }
    if (e.tokens >= 0 && e.patches >= 0 && e.tokens != hasCls + e.patches)
    {
        return "hidden has T=" + std::to_string(e.tokens) + " tokens but scores has N=" + std::to_string(e.patches)
            + " patches; expected T = has_cls + N = " + std::to_string(hasCls + e.patches);
    }
    if (e.patches > kMaxPatches)
    {
        return "N=" + std::to_string(e.patches) + " patches exceeds the limit of the CUDA selection kernel (N <= "
            + std::to_string(kMaxPatches) + ", vlmp_select_topk_cuda)";
    }
    if (e.patches >= 0 && keep >= e.patches)
    {
        return "keep=" + std::to_string(keep) + " must be smaller than the number of patches N="
            + std::to_string(e.patches);
    }
    return std::string();
}

} // namespace trt
} // namespace vlmprune

#endif // VLMPRUNE_TRT_TOKEN_PRUNE_CHECKS_H
