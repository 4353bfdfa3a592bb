// 1-bit compression with error feedback (lightning_optim/comm): the element-wise pieces.
//
//   z = x + err;  s = +1 if z >= 0 else -1 (sign(0) = +1, NaN -> -1);  err <- z - scale s
//   bits: 8 signs per byte, element 8k + j in bit j of byte k (least significant bit first),
//         bit = (z >= 0); the missing elements of a partial last byte count as +1 (bits set),
//         as lightning_optim/comm/packing.py pads.
//   unpack: value = +scale if bit else -scale.
// The default scale is ||z||_2 / sqrt(numel) (the 1-bit Adam paper's); the kernels compute the
// sum of z^2 in a first read-only pass when the caller does not give a scale.
#pragma once

#include "lo_common.h"

namespace lo {

HOST_DEVICE LO_INLINE float ef_input(float x, float err) { return x + err; }

HOST_DEVICE LO_INLINE bool sign_bit(float z) { return z >= 0.0f; }

// The new error after sending scale * sign(z).
HOST_DEVICE LO_INLINE float ef_residual(float z, float scale) {
  return z - (sign_bit(z) ? scale : -scale);
}

HOST_DEVICE LO_INLINE float unpack_value(uint8_t byte, int j, float scale) {
  return ((byte >> j) & 1u) ? scale : -scale;
}

// The server's value at bit q of the rows: the mean of the workers' +-scale (summed in worker order,
// then divided, as the torch path does) plus the server's error.
HOST_DEVICE LO_INLINE float server_value(const uint8_t* rows, int64_t stride, int world, const float* scales,
                                         int64_t scale_stride, int64_t q, float err) {
  float sum = 0.0f;
  for (int w = 0; w < world; ++w) {
    const float v = unpack_value(rows[w * stride + q / 8], static_cast<int>(q % 8), scales[w * scale_stride]);
    sum = w == 0 ? v : sum + v;
  }
  return sum / static_cast<float>(world) + err;
}

// What a compression call does with the error buffer.
enum class Ef : int {
  None = 0,      // pack the signs of x only
  Residual = 1,  // z = x; err <- z - scale sign(z) (err is write-only)
  Feedback = 2,  // z = x + err; err <- z - scale sign(z)
};

// One byte: 8 elements starting at x/err (count <= 8 valid ones).
template <Ef MODE>
HOST_DEVICE LO_INLINE uint8_t compress_byte(const float* x, float* err, int count, float scale) {
  uint32_t byte = 0xFFu << count & 0xFFu;  // padding: +1
  for (int j = 0; j < count; ++j) {
    float z = MODE == Ef::Feedback ? ef_input(x[j], err[j]) : x[j];
    byte |= static_cast<uint32_t>(sign_bit(z)) << j;
    if constexpr (MODE != Ef::None) err[j] = ef_residual(z, scale);
  }
  return static_cast<uint8_t>(byte);
}

}  // namespace lo
