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

template <typename T>
__global__ void unpack_table_kernel(const uint8_t* packed, const T* table, T* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads)
    out[i] = table[8 * static_cast<int64_t>(packed[i / 8]) + i % 8];
}

// ---- pieces (per-tensor scales): one thread per byte of the pos space, its piece found by bisection
__device__ LO_INLINE int64_t piece_at(const Pieces& pc, int64_t i) {  // last p with pos[p] <= i, or -1
  int64_t lo = 0, hi = pc.n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (pc.pos[mid] <= i) lo = mid + 1;
    else hi = mid;
  }
  return lo - 1;
}

// Adds v to out[p]: one atomic per warp when the whole warp works on one piece.
__device__ LO_INLINE void add_to_piece(double* out, int64_t p, float v) {
  const unsigned mask = __activemask();
  const int64_t first = __shfl_sync(mask, p, __ffs(mask) - 1);
  if (mask == 0xFFFFFFFFu && __all_sync(mask, p == first)) {
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(mask, v, offset);
    if (threadIdx.x % 32 == 0 && p >= 0) atomicAdd(out + p, static_cast<double>(v));
  } else if (p >= 0) {
    atomicAdd(out + p, static_cast<double>(v));
  }
}

// The byte k of the pos space: its piece and element range [i, i + count) relative to the piece (count 0: none).
struct ByteSpot { int64_t p, j; int count; };
__device__ LO_INLINE ByteSpot spot(const Pieces& pc, int64_t k) {
  const int64_t i = 8 * k;
  const int64_t p = piece_at(pc, i);
  if (p < 0 || i >= pc.pos[p] + pc.len[p]) return ByteSpot{-1, 0, 0};
  const int64_t j = i - pc.pos[p];
  const int64_t left = pc.len[p] - j;
  return ByteSpot{p, j, left < 8 ? static_cast<int>(left) : 8};
}

__global__ void seg_sumsq_kernel(const float* x, const float* err, Pieces pc, double* out) {
  const int64_t bytes = pc.total / 8;
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  const int64_t rounds = (bytes + stride - 1) / stride;  // every lane takes part in every round's shuffles
  for (int64_t r = 0; r < rounds; ++r) {
    const int64_t k = r * stride + blockIdx.x * int64_t{kThreads} + threadIdx.x;
    ByteSpot s = k < bytes ? spot(pc, k) : ByteSpot{-1, 0, 0};
    float acc = 0.0f;
    for (int q = 0; q < s.count; ++q) {
      const float z = ef_input(x[pc.off[s.p] + s.j + q], err ? err[pc.pos[s.p] + s.j + q] : 0.0f);
      acc += z * z;
    }
    add_to_piece(out, s.p, acc);
  }
}

template <Ef MODE>
__global__ void seg_compress_kernel(const float* x, float* err, uint8_t* packed, Pieces pc, const float* scales) {
  const int64_t bytes = pc.total / 8;
  for (int64_t k = blockIdx.x * int64_t{kThreads} + threadIdx.x; k < bytes; k += int64_t{gridDim.x} * kThreads) {
    const ByteSpot s = spot(pc, k);
    if (s.count == 0) continue;
    packed[k] = compress_byte<MODE>(x + pc.off[s.p] + s.j, MODE == Ef::None ? nullptr : err + 8 * k, s.count,
                                    scales[s.p]);
  }
}

template <typename T>
__global__ void seg_unpack_kernel(const uint8_t* packed, Pieces pc, const float* scales, T* out) {
  const int64_t bytes = pc.total / 8;
  for (int64_t k = blockIdx.x * int64_t{kThreads} + threadIdx.x; k < bytes; k += int64_t{gridDim.x} * kThreads) {
    const ByteSpot s = spot(pc, k);
    T* o = out + pc.off[s.p < 0 ? 0 : s.p] + s.j;
    for (int q = 0; q < s.count; ++q) o[q] = from_float<T>(unpack_value(packed[k], q, scales[s.p]));
  }
}

__global__ void server_mean_kernel(const uint8_t* rows, int64_t row_stride, int world, const float* scales, float* err,
                                   Pieces pc, double* out) {
  const int64_t bytes = pc.total / 8;
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  const int64_t rounds = (bytes + stride - 1) / stride;
  for (int64_t r = 0; r < rounds; ++r) {
    const int64_t k = r * stride + blockIdx.x * int64_t{kThreads} + threadIdx.x;
    ByteSpot s = k < bytes ? spot(pc, k) : ByteSpot{-1, 0, 0};
    float acc = 0.0f;
    for (int q = 0; q < s.count; ++q) {
      const int64_t i = 8 * k + q;
      const float z = server_value(rows, row_stride, world, scales + s.p, pc.n, i, err[i]);
      err[i] = z;
      acc += z * z;
    }
    add_to_piece(out, s.p, acc);
  }
}

cudaStream_t stream_of(const Exec& ex) { return static_cast<cudaStream_t>(ex.stream); }

}  // namespace

namespace cuda {

void onebit_unpack_table(const Exec& ex, const uint8_t* packed, DType out_type, const void* table, void* out,
                         int64_t n) {
  with_type(out_type, [&](auto tt) {
    using T = typename std::decay_t<decltype(tt)>::type;
    unpack_table_kernel<T><<<blocks_for(n), kThreads, 0, stream_of(ex)>>>(packed, static_cast<const T*>(table),
                                                                         static_cast<T*>(out), n);
  });
  cuda_detail::check(cudaGetLastError(), "onebit_unpack_table");
}

void onebit_seg_sumsq(const Exec& ex, const float* x, const float* err, const Pieces& pc, double* out) {
  seg_sumsq_kernel<<<blocks_for(pc.total / 8), kThreads, 0, stream_of(ex)>>>(x, err, pc, out);
  cuda_detail::check(cudaGetLastError(), "onebit_seg_sumsq");
}

void onebit_seg_compress(const Exec& ex, const float* x, float* err, uint8_t* packed, const Pieces& pc,
                         const float* scales, Ef mode) {
  const int blocks = blocks_for(pc.total / 8);
  cudaStream_t st = stream_of(ex);
  switch (mode) {
    case Ef::None: seg_compress_kernel<Ef::None><<<blocks, kThreads, 0, st>>>(x, err, packed, pc, scales); break;
    case Ef::Residual: seg_compress_kernel<Ef::Residual><<<blocks, kThreads, 0, st>>>(x, err, packed, pc, scales); break;
    case Ef::Feedback: seg_compress_kernel<Ef::Feedback><<<blocks, kThreads, 0, st>>>(x, err, packed, pc, scales); break;
  }
  cuda_detail::check(cudaGetLastError(), "onebit_seg_compress");
}

void onebit_seg_unpack(const Exec& ex, const uint8_t* packed, const Pieces& pc, const float* scales, DType out_type,
                       void* out) {
  with_type(out_type, [&](auto tt) {
    using T = typename std::decay_t<decltype(tt)>::type;
    seg_unpack_kernel<T><<<blocks_for(pc.total / 8), kThreads, 0, stream_of(ex)>>>(packed, pc, scales, static_cast<T*>(out));
  });
  cuda_detail::check(cudaGetLastError(), "onebit_seg_unpack");
}

void onebit_server_mean(const Exec& ex, const uint8_t* rows, int64_t row_stride, int world, const float* scales,
                        float* err, const Pieces& pc, double* out) {
  server_mean_kernel<<<blocks_for(pc.total / 8), kThreads, 0, stream_of(ex)>>>(rows, row_stride, world, scales, err,
                                                                              pc, out);
  cuda_detail::check(cudaGetLastError(), "onebit_server_mean");
}

}  // namespace cuda
}  // namespace lo
