// Multi-tensor apply for CUDA: one launch covers many tensors of a list of lists.
//
// The host walks the tensors, cuts each into kChunk-element chunks and packs (tensor, chunk) pairs
// plus the tensors' pointers into a struct passed by value as the kernel parameter (< 4 KB); when
// the struct is full it launches and starts a new one (a tensor cut across launches is carried
// over). Sizes, chunk indices and element offsets are int64: tensors past 2^31 elements are fine.
// The functor is the optimizer's HOST_DEVICE element op from csrc/include (Op::bind + Op()).
// Torch-free: compiled by nvcc alone.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "../include/kernel_api.h"

namespace lo {
namespace cuda_detail {

constexpr int kBlock = 512;
constexpr int64_t kChunk = 65536;

template <int D> struct Capacity {
  static constexpr int tensors = D <= 4 ? 48 : 28;
  static constexpr int blocks = D <= 4 ? 160 : 128;
};

template <int D>
struct Meta {
  void* ptr[D][Capacity<D>::tensors];
  int64_t numel[Capacity<D>::tensors];
  int64_t tensor_index[Capacity<D>::tensors];  // index in the caller's lists (per-tensor arrays, sums)
  int64_t block_chunk[Capacity<D>::blocks];
  uint8_t block_tensor[Capacity<D>::blocks];
};
static_assert(sizeof(Meta<2>) < 4000 && sizeof(Meta<4>) < 4000 && sizeof(Meta<7>) < 4000 && sizeof(Meta<8>) < 4000,
              "kernel parameters are limited to 4 KB");

inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string("lightning_optim CUDA ") + what + ": " + cudaGetErrorString(status));
}

template <class Op, int D>
__global__ void __launch_bounds__(kBlock) foreach_kernel(const Meta<D> meta, const Op op) {
  const int local = meta.block_tensor[blockIdx.x];
  const int64_t begin = meta.block_chunk[blockIdx.x] * kChunk;
  const int64_t n = meta.numel[local];
  const int64_t end = begin + kChunk < n ? begin + kChunk : n;
  void* base[D];
#pragma unroll
  for (int l = 0; l < D; ++l) base[l] = meta.ptr[l][local];
  const auto t = op.bind(base, meta.tensor_index[local]);
  for (int64_t i = begin + threadIdx.x; i < end; i += kBlock) op(t, i);
}

// Block-wide sum of two floats, then one double atomicAdd per block and value.
template <class Op, int D>
__global__ void __launch_bounds__(kBlock) reduce_kernel(const Meta<D> meta, const Op op, double* out) {
  const int local = meta.block_tensor[blockIdx.x];
  const int64_t begin = meta.block_chunk[blockIdx.x] * kChunk;
  const int64_t n = meta.numel[local];
  const int64_t end = begin + kChunk < n ? begin + kChunk : n;
  void* base[D];
#pragma unroll
  for (int l = 0; l < D; ++l) base[l] = meta.ptr[l][local];
  const auto t = op.bind(base, meta.tensor_index[local]);
  float a0 = 0.0f, a1 = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += kBlock) op(t, i, a0, a1);
  for (int offset = 16; offset > 0; offset /= 2) {
    a0 += __shfl_down_sync(0xFFFFFFFFu, a0, offset);
    a1 += __shfl_down_sync(0xFFFFFFFFu, a1, offset);
  }
  __shared__ float s0[kBlock / 32], s1[kBlock / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    s0[warp] = a0;
    s1[warp] = a1;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double b0 = 0.0, b1 = 0.0;
    for (int w = 0; w < kBlock / 32; ++w) {
      b0 += s0[w];
      b1 += s1[w];
    }
    const int64_t k = meta.tensor_index[local];
    atomicAdd(out + 2 * k, b0);
    atomicAdd(out + 2 * k + 1, b1);
  }
}

// Packs the lists into Meta structs and calls launch(meta, blocks) for each full one.
template <int D, class Launch>
void for_each_launch(const ListArgs& a, Launch launch) {
  using Cap = Capacity<D>;
  Meta<D> meta;
  int nt = 0, nb = 0;
  for (int64_t t = 0; t < a.n; ++t) {
    const int64_t n = a.numel[t];
    if (n == 0) continue;
    for (int l = 0; l < D; ++l) meta.ptr[l][nt] = a.ptr[l] ? a.ptr[l][t] : nullptr;
    meta.numel[nt] = n;
    meta.tensor_index[nt] = t;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_tensor[nb] = static_cast<uint8_t>(nt);
      meta.block_chunk[nb] = c;
      ++nb;
      const bool last_chunk = c == chunks - 1;
      if (nb == Cap::blocks || (last_chunk && nt + 1 == Cap::tensors)) {
        launch(meta, nb);
        nb = 0;
        if (last_chunk) {
          nt = -1;  // every tensor so far is done
        } else {    // this tensor goes on in the next launch, from slot 0
          for (int l = 0; l < D; ++l) meta.ptr[l][0] = meta.ptr[l][nt];
          meta.numel[0] = meta.numel[nt];
          meta.tensor_index[0] = meta.tensor_index[nt];
          nt = 0;
        }
      }
    }
    ++nt;
  }
  if (nb > 0) launch(meta, nb);
}

}  // namespace cuda_detail

template <class Op>
void cuda_foreach(const Exec& ex, const ListArgs& a, const Op& op) {
  constexpr int D = Op::depth;
  auto stream = static_cast<cudaStream_t>(ex.stream);
  cuda_detail::for_each_launch<D>(a, [&](const cuda_detail::Meta<D>& meta, int blocks) {
    cuda_detail::foreach_kernel<Op, D><<<blocks, cuda_detail::kBlock, 0, stream>>>(meta, op);
    cuda_detail::check(cudaGetLastError(), "launch");
  });
}

// `out`: 2 doubles per tensor in device memory, zeroed by the caller.
template <class Op>
void cuda_reduce(const Exec& ex, const ListArgs& a, const Op& op, double* out) {
  constexpr int D = Op::depth;
  auto stream = static_cast<cudaStream_t>(ex.stream);
  cuda_detail::for_each_launch<D>(a, [&](const cuda_detail::Meta<D>& meta, int blocks) {
    cuda_detail::reduce_kernel<Op, D><<<blocks, cuda_detail::kBlock, 0, stream>>>(meta, op, out);
    cuda_detail::check(cudaGetLastError(), "launch");
  });
}

}  // namespace lo
