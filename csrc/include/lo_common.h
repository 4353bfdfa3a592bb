// Shared by the CPU and CUDA kernels: the HOST_DEVICE macro, the 16-bit float types and their
// conversions to and from fp32 written with integer bit operations (round to nearest even), so
// that the same code runs on the GPU and vectorises on the CPU. No torch headers here.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define HOST_DEVICE __host__ __device__
#define LO_INLINE __forceinline__
#else
#define HOST_DEVICE
#define LO_INLINE inline __attribute__((always_inline))
#endif

namespace lo {

// Layout-compatible with torch's c10::BFloat16 / c10::Half: the raw 16 bits.
struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

// Runtime tag of an element type, as the bindings see a tensor's dtype.
enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };

HOST_DEVICE LO_INLINE float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

HOST_DEVICE LO_INLINE uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// ---------------------------------------------------------------- bfloat16
HOST_DEVICE LO_INLINE float to_float(bf16_t v) { return bits_to_float(static_cast<uint32_t>(v.bits) << 16); }

// Round to nearest even; any NaN becomes the quiet NaN 0x7FC0 (as c10::BFloat16 does).
HOST_DEVICE LO_INLINE bf16_t to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return bf16_t{static_cast<uint16_t>(nan ? 0x7FC0u : rounded)};
}

// ---------------------------------------------------------------- float16
// Normal, subnormal, zero, inf and NaN handled with selects only (no branches).
HOST_DEVICE LO_INLINE float to_float(f16_t v) {
  uint32_t h = v.bits;
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t em = h & 0x7FFFu;
  uint32_t exp = em & 0x7C00u;
  // normal numbers: rebias the exponent (112 = 127 - 15)
  uint32_t normal = (em << 13) + (112u << 23);
  // inf/NaN: maximal exponent, keep the mantissa (NaN payload), make NaN quiet
  uint32_t mant = em & 0x3FFu;
  uint32_t special = 0x7F800000u | (mant << 13) | (static_cast<uint32_t>(mant != 0) << 22);
  // subnormals and zero: the mantissa times 2^-24, exact in fp32
  uint32_t subnormal = float_to_bits(static_cast<float>(mant) * 5.9604644775390625e-08f);
  // selects as bit masks: GCC turns two compares of one value into a switch, which stops the
  // vectoriser
  uint32_t is_special = 0u - static_cast<uint32_t>(exp == 0x7C00u);
  uint32_t is_sub = 0u - static_cast<uint32_t>(exp == 0);
  uint32_t mag = (special & is_special) | (subnormal & is_sub) | (normal & ~(is_special | is_sub));
  return bits_to_float(sign | mag);
}

// Round to nearest even, overflow to inf, NaN to the quiet NaN 0x7E00 (as c10::Half does).
HOST_DEVICE LO_INLINE f16_t to_f16(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7FFFFFFFu;
  // normal range [2^-14, 65520): drop 13 mantissa bits with round-to-nearest-even
  uint32_t normal = (a - (112u << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
  // below 2^-14: adding 0.5 in fp32 aligns the half subnormal's bits at the bottom of the
  // mantissa, and the fp32 addition itself rounds to nearest even
  float shifted = bits_to_float(a) + 0.5f;
  uint32_t subnormal = float_to_bits(shifted) - float_to_bits(0.5f);
  uint32_t mag = a < 0x38800000u ? subnormal : normal;
  mag = a >= 0x477FF000u ? 0x7C00u : mag;  // >= 65520 rounds to inf
  mag = a > 0x7F800000u ? 0x7E00u : mag;   // NaN
  return f16_t{static_cast<uint16_t>(sign | mag)};
}

HOST_DEVICE LO_INLINE float to_float(float v) { return v; }

template <typename T> HOST_DEVICE LO_INLINE T from_float(float f);
template <> HOST_DEVICE LO_INLINE float from_float<float>(float f) { return f; }
template <> HOST_DEVICE LO_INLINE bf16_t from_float<bf16_t>(float f) { return to_bf16(f); }
template <> HOST_DEVICE LO_INLINE f16_t from_float<f16_t>(float f) { return to_f16(f); }

template <typename T> struct is_low_precision : std::integral_constant<bool, !std::is_same<T, float>::value> {};

// torch's lerp: self + w (end - self) for |w| < 0.5, else end - (end - self)(1 - w).
HOST_DEVICE LO_INLINE float lerp(float self, float end, float w) {
  float diff = end - self;
  return (w < 0.5f && w > -0.5f) ? self + w * diff : end - diff * (1.0f - w);
}

// -1, 0, +1 for finite x; NaN for NaN and +-Inf (x - x), so a non-finite value propagates into
// the step as torch's own optimizers propagate it (torch.sign would give 0 for NaN: a silent freeze).
// The torch path: lightning_optim/optim/sign_sgd.py propagating_sign.
HOST_DEVICE LO_INLINE float sign_of(float x) {
  float s = x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
  return s + (x - x);
}

}  // namespace lo
