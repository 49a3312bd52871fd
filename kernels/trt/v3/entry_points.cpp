/* Entry points of libvlmprune_trt.so for TensorRT 10.
 *
 * IPluginRegistry::loadLibrary() (trtexec --dynamicPlugins, Python
 * get_plugin_registry().load_library()) looks up two C symbols: setLoggerFinder()
 * and getCreators(), the latter returning IPluginCreatorInterface* so it can carry
 * IPluginV3 creators (the older getPluginCreators() only carries IPluginCreator).
 * Both are exported; everything else in the library is hidden (CMakeLists.txt).
 *
 * Loaders that only dlopen() the library (trtexec --staticPlugins, Polygraphy
 * --plugins, ONNX Runtime's TensorRT provider) need self-registration instead:
 * build with -DVLMP_TRT_STATIC_REGISTRATION=ON. It is off by default because
 * loadLibrary() fails when a creator it is handed is already registered.
 */
#include "v3/cls_score_plugin.h"
#include "v3/token_prune_plugin.h"

#include <atomic>
#include <cstdio>

#define VLMP_TRT_EXPORT extern "C" __attribute__((visibility("default")))

namespace vlmprune
{
namespace trt
{
namespace
{

std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};

} // namespace

// The logger TensorRT handed over through setLoggerFinder(); when self-registered
// (linked to libnvinfer) libnvinfer's global one; else stderr.
void logError(char const* message) noexcept
{
    nvinfer1::ILoggerFinder* const finder = gLoggerFinder.load();
    nvinfer1::ILogger* logger = finder != nullptr ? finder->findLogger() : nullptr;
#if VLMP_TRT_STATIC_REGISTRATION
    if (logger == nullptr)
    {
        logger = getLogger();
    }
#endif
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

VLMP_TRT_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    vlmprune::trt::gLoggerFinder.store(finder);
}

VLMP_TRT_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static vlmprune::trt::TokenPruneCreatorV3 creator;
    static vlmprune::trt::ClsScoreCreatorV3 scoreCreator;
    static nvinfer1::IPluginCreatorInterface* const creators[] = {&creator, &scoreCreator};
    nbCreators = 2;
    return creators;
}

#if VLMP_TRT_STATIC_REGISTRATION
// The macro pastes its argument into a variable name, so it takes an unqualified name.
using vlmprune::trt::TokenPruneCreatorV3;
using vlmprune::trt::ClsScoreCreatorV3;
REGISTER_TENSORRT_PLUGIN(TokenPruneCreatorV3);
REGISTER_TENSORRT_PLUGIN(ClsScoreCreatorV3);
#endif
