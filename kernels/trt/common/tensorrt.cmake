# Shared by kernels/trt/v2 and kernels/trt/v3: where the kernels are, and TensorRT.
#
# The defaults match a Jetson: JetPack's Debian packages put TensorRT under the
# multiarch folders. Overrides:
#   -DTENSORRT_ROOT=/opt/TensorRT-x.y        a tarball install (include/, lib/)
#   -DTENSORRT_INCLUDE_DIR=... -DTENSORRT_LIB_DIR=...
#   -DVLMP_KERNELS_DIR=...                   the kernels/ folder when the sources
#                                            were copied elsewhere (e.g. a bundle)

set(VLMP_KERNELS_DIR "${CMAKE_CURRENT_LIST_DIR}/../.." CACHE PATH
    "vlmprune kernels/ folder holding include/, cuda/ and trt/")
get_filename_component(VLMP_KERNELS_DIR "${VLMP_KERNELS_DIR}" ABSOLUTE)

set(VLMP_KERNEL_SOURCE "${VLMP_KERNELS_DIR}/cuda/token_prune.cu")
if(NOT EXISTS "${VLMP_KERNEL_SOURCE}")
  message(FATAL_ERROR "vlmprune: ${VLMP_KERNEL_SOURCE} not found; set VLMP_KERNELS_DIR to the kernels/ folder")
endif()

# vlmp_find_tensorrt(<expected major> <need libnvinfer>)
# Sets TENSORRT_INCLUDE_DIR, TENSORRT_VERSION and, when asked, TENSORRT_NVINFER_LIBRARY.
# The major version is checked because each wrapper targets one plugin API: the V3
# wrapper needs TensorRT 10, the V2 one was written against 8.5.
function(vlmp_find_tensorrt expected_major need_library)
  find_path(TENSORRT_INCLUDE_DIR NvInferVersion.h
    HINTS "${TENSORRT_ROOT}/include"
    PATHS /usr/include/aarch64-linux-gnu /usr/include/x86_64-linux-gnu /usr/include
    DOC "folder holding NvInfer.h")
  if(NOT TENSORRT_INCLUDE_DIR)
    message(FATAL_ERROR
      "vlmprune: TensorRT headers (NvInferVersion.h) not found; set TENSORRT_INCLUDE_DIR or TENSORRT_ROOT")
  endif()

  file(STRINGS "${TENSORRT_INCLUDE_DIR}/NvInferVersion.h" _lines REGEX "^#define NV_TENSORRT_(MAJOR|MINOR|PATCH) ")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX REPLACE ".*#define NV_TENSORRT_${_part} ([0-9]+).*" "\\1" _${_part} "${_lines}")
  endforeach()
  set(TENSORRT_VERSION "${_MAJOR}.${_MINOR}.${_PATCH}" PARENT_SCOPE)
  if(NOT _MAJOR EQUAL expected_major)
    message(FATAL_ERROR "vlmprune: ${TENSORRT_INCLUDE_DIR} is TensorRT ${_MAJOR}.${_MINOR}.${_PATCH}; "
      "this wrapper needs TensorRT ${expected_major}.x (kernels/trt/v3: 10.x, kernels/trt/v2: 8.x)")
  endif()
  message(STATUS "vlmprune: TensorRT ${_MAJOR}.${_MINOR}.${_PATCH} headers in ${TENSORRT_INCLUDE_DIR}")

  if(need_library)
    find_library(TENSORRT_NVINFER_LIBRARY nvinfer
      HINTS "${TENSORRT_LIB_DIR}" "${TENSORRT_ROOT}/lib"
      PATHS /usr/lib/aarch64-linux-gnu /usr/lib/x86_64-linux-gnu
      DOC "libnvinfer")
    if(NOT TENSORRT_NVINFER_LIBRARY)
      message(FATAL_ERROR "vlmprune: libnvinfer not found; set TENSORRT_LIB_DIR or TENSORRT_ROOT")
    endif()
  endif()
endfunction()

# Settings both plugin libraries share.
function(vlmp_configure_plugin_library target)
  target_include_directories(${target} PRIVATE
    "${VLMP_KERNELS_DIR}/include" "${VLMP_KERNELS_DIR}/trt" "${VLMP_KERNELS_DIR}/cuda")
  # SYSTEM: warnings inside the TensorRT and CUDA headers are not ours to fix.
  target_include_directories(${target} SYSTEM PRIVATE
    "${TENSORRT_INCLUDE_DIR}" ${CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES})
  # Only the loader entry points are exported (they say so explicitly), so the
  # kernels and wrappers cannot clash with another library's copies.
  set_target_properties(${target} PROPERTIES
    CXX_VISIBILITY_PRESET hidden
    CUDA_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON
    POSITION_INDEPENDENT_CODE ON)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
  # A missing symbol should fail here, not when TensorRT dlopen()s the library.
  target_link_libraries(${target} PRIVATE "-Wl,--no-undefined")
endfunction()
