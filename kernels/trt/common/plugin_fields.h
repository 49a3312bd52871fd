/* Reading keep / has_cls from a PluginFieldCollection, shared by both creators.
 * TensorRT's ONNX parser turns an ONNX INT attribute into a kINT32 field of length 1;
 * IPluginV3's getFieldsToSerialize() writes the same form back. C++14.
 */
#ifndef VLMPRUNE_TRT_PLUGIN_FIELDS_H
#define VLMPRUNE_TRT_PLUGIN_FIELDS_H

#include "common/token_prune_checks.h"

#include <NvInferRuntime.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace vlmprune
{
namespace trt
{

struct TokenPruneAttributes
{
    int32_t keep;
    int32_t hasCls;
};

// Fills `attrs` from `fc`; returns why not when a field is missing, mistyped or out
// of range. Unknown fields are ignored so a newer ONNX side can add optional ones.
inline std::string readAttributes(nvinfer1::PluginFieldCollection const* fc, TokenPruneAttributes& attrs)
{
    bool haveKeep = false;
    bool haveHasCls = false;
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
    {
        nvinfer1::PluginField const& field = fc->fields[i];
        if (field.name == nullptr)
        {
            continue;
        }
        bool const isKeep = std::strcmp(field.name, kFieldKeep) == 0;
        bool const isHasCls = std::strcmp(field.name, kFieldHasCls) == 0;
        if (!isKeep && !isHasCls)
        {
            continue;
        }
        if (field.type != nvinfer1::PluginFieldType::kINT32 || field.length != 1 || field.data == nullptr)
        {
            return std::string("field '") + field.name + "' must be one int32";
        }
        int32_t const value = *static_cast<int32_t const*>(field.data);
        if (isKeep)
        {
            attrs.keep = value;
            haveKeep = true;
        }
        else
        {
            attrs.hasCls = value;
            haveHasCls = true;
        }
    }
    if (!haveKeep || !haveHasCls)
    {
        return std::string("fields '") + kFieldKeep + "' and '" + kFieldHasCls + "' are required";
    }
    return checkAttributes(attrs.keep, attrs.hasCls);
}

} // namespace trt
} // namespace vlmprune

#endif // VLMPRUNE_TRT_PLUGIN_FIELDS_H
