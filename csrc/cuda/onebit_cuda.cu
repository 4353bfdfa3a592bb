// CUDA 1-bit compression: the element math of include/onebit_math.h, one thread per packed byte
// (compress) or per output element (unpack). int64 indices throughout. Torch-free.
#include <cuda_runtime.h>

#include "../include/kernel_api.h"
#include "multi_tensor_apply.cuh"

namespace lo {
namespace {

constexpr int kThreads = 256;

inline int blocks_for(int64_t work) {
  int64_t b = (work + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 * 8 ? b : 65535 * 8);  // grid-stride loops cover the rest
}

__global__ void sumsq_kernel(const float* x, const float* err, int64_t n, double* out) {
  float acc = 0.0f;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) {
    float z = ef_input(x[i], err ? err[i] : 0.0f);
    acc += z * z;
  }
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xFFFFFFFFu, acc, offset);
  __shared__ float warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double b = 0.0;
    for (int w = 0; w < kThreads / 32; ++w) b += warp_sums[w];
    atomicAdd(out, b);
  }
}

template <Ef MODE>
__global__ void compress_kernel(const float* x, float* err, uint8_t* packed, int64_t n, float scale) {
  const int64_t bytes = (n + 7) / 8;
  for (int64_t k = blockIdx.x * int64_t{kThreads} + threadIdx.x; k < bytes; k += int64_t{gridDim.x} * kThreads) {
    const int64_t i = 8 * k;
    const int count = n - i < 8 ? static_cast<int>(n - i) : 8;
    packed[k] = compress_byte<MODE>(x + i, MODE == Ef::None ? nullptr : err + i, count, scale);
  }
}

template <typename T>
__global__ void unpack_kernel(const uint8_t* packed, T* out, int64_t n, float scale) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads)
    out[i] = from_float<T>(unpack_value(packed[i / 8], static_cast<int>(i % 8), scale));
}

template <typename T>
__global__ void unpack_table_kernel(const uint8_t* packed, const T* table, T* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads)
    out[i] = table[8 * static_cast<int64_t>(packed[i / 8]) + i % 8];
}

cudaStream_t stream_of(const Exec& ex) { return static_cast<cudaStream_t>(ex.stream); }

}  // namespace

namespace cuda {

void onebit_sumsq(const Exec& ex, const float* x, const float* err, int64_t n, double* out) {
  sumsq_kernel<<<blocks_for(n), kThreads, 0, stream_of(ex)>>>(x, err, n, out);
  cuda_detail::check(cudaGetLastError(), "onebit_sumsq");
}

void onebit_compress(const Exec& ex, const float* x, float* err, uint8_t* packed, int64_t n, float scale, Ef mode) {
  const int blocks = blocks_for((n + 7) / 8);
  switch (mode) {
    case Ef::None: compress_kernel<Ef::None><<<blocks, kThreads, 0, stream_of(ex)>>>(x, err, packed, n, scale); break;
    case Ef::Residual:
      compress_kernel<Ef::Residual><<<blocks, kThreads, 0, stream_of(ex)>>>(x, err, packed, n, scale);
      break;
    case Ef::Feedback:
      compress_kernel<Ef::Feedback><<<blocks, kThreads, 0, stream_of(ex)>>>(x, err, packed, n, scale);
      break;
  }
  cuda_detail::check(cudaGetLastError(), "onebit_compress");
}

void onebit_unpack(const Exec& ex, const uint8_t* packed, DType out_type, void* out, int64_t n, float scale) {
  with_type(out_type, [&](auto tt) {
    using T = typename std::decay_t<decltype(tt)>::type;
    unpack_kernel<T><<<blocks_for(n), kThreads, 0, stream_of(ex)>>>(packed, static_cast<T*>(out), n, scale);
  });
  cuda_detail::check(cudaGetLastError(), "onebit_unpack");
}

void onebit_unpack_table(const Exec& ex, const uint8_t* packed, DType out_type, const void* table, void* out,
                         int64_t n) {
  with_type(out_type, [&](auto tt) {
    using T = typename std::decay_t<decltype(tt)>::type;
    unpack_table_kernel<T><<<blocks_for(n), kThreads, 0, stream_of(ex)>>>(packed, static_cast<const T*>(table),
                                                                         static_cast<T*>(out), n);
  });
  cuda_detail::check(cudaGetLastError(), "onebit_unpack_table");
}

}  // namespace cuda
}  // namespace lo
