/* Registration of the TensorRT 8.5 plugin and where it logs.
 *
 * TensorRT 8.5 has no IPluginRegistry::loadLibrary(): trtexec --plugins, Polygraphy
 * --plugins and ctypes.CDLL() just dlopen() the library, so the creator registers
 * itself from a static initialiser (REGISTER_TENSORRT_PLUGIN). Kept apart from the
 * plugin so tools/trt_compile_check.py can link the plugin without libnvinfer.
 */
#include "v2/cls_score_plugin.h"
#include "v2/token_prune_plugin.h"

#include <cstdio>

namespace vlmprune
{
namespace trt
{

// libnvinfer's global logger (getLogger()); stderr when it has none.
void logError(char const* message) noexcept
{
    nvinfer1::ILogger* const logger = getLogger();
    if (logger != nullptr)
    {
        logger->log(nvinfer1::ILogger::Severity::kERROR, message);
    }
    else
    {
        std::fprintf(stderr, "[vlmprune] %s\n", message);
    }
}

} // namespace trt
} // namespace vlmprune

// The macro pastes its argument into a variable name, so it takes an unqualified name.
// Registered in this order (one translation unit): VlmpTokenPrune, then VlmpClsScore.
using vlmprune::trt::ClsScoreCreatorV2;
using vlmprune::trt::TokenPruneCreatorV2;
REGISTER_TENSORRT_PLUGIN(TokenPruneCreatorV2);
REGISTER_TENSORRT_PLUGIN(ClsScoreCreatorV2);
