// Portable IEEE binary16 <-> binary32 conversion for the CPU kernels.
//
// The library is built for plain x86-64-v2 (no F16C) and for aarch64, so the
// conversions are written on the bit patterns. half_to_float is branch-free
// (selects only) so that GCC/Clang vectorise the fp16 accumulation loops.
#ifndef VLMPRUNE_CPU_HALF_H
#define VLMPRUNE_CPU_HALF_H

#include <stdint.h>
#include <string.h>

namespace vlmp {

inline float bits_to_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

// Exact for every half value (normals, subnormals, +-0, inf, NaN payloads).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  // Normal: rebias the exponent by 127 - 15. Inf/NaN: force the fp32 max exponent.
  const uint32_t normal = (em << 13) + 0x38000000u;
  const uint32_t infnan = (em << 13) + 0x70000000u;
  // Subnormal: em * 2^-24 is exact in fp32 and avoids relying on fp32 denormals
  // (the caller may run with denormals-are-zero).
  const uint32_t subnormal = float_to_bits(static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f);
  // Masks instead of ?: keep the loop free of control flow for the vectoriser.
  const uint32_t is_infnan = 0u - static_cast<uint32_t>(em >= 0x7c00u);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(em < 0x0400u);
  const uint32_t mag = (subnormal & is_sub) | (~is_sub & ((infnan & is_infnan) | (normal & ~is_infnan)));
  return bits_to_float(sign | mag);
}

// Round to nearest, ties to even; overflow -> inf; NaN stays NaN (quiet).
inline uint16_t float_to_half(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x0200u : 0u));
  }
  if (abs >= 0x477ff000u) {  // >= 65520 rounds to inf
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    // Adding 0.5 makes the FPU do the round-to-nearest-even at the 2^-24 position.
    const float shifted = bits_to_float(abs) + 0.5f;
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(float_to_bits(shifted) - 0x3f000000u));
  }
  // Normal: rebias, then round the 13 dropped mantissa bits to nearest even.
  const uint32_t odd = (abs >> 13) & 1u;
  const uint32_t rounded = abs - 0x38000000u + 0x0fffu + odd;
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(rounded >> 13));
}

}  // namespace vlmp

#endif  // VLMPRUNE_CPU_HALF_H
