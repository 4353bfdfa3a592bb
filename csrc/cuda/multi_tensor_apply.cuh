// Multi-tensor apply for CUDA: one launch covers many tensors of a list of lists.
//
// The plan and each thread's work are in multi_tensor_body.h (CUDA-free, so that the host can emulate
// it): here are the kernels around it. Meta travels as a __grid_constant__ parameter, so the body can
// index it without a per-thread copy. Sizes and element offsets are int64: tensors past 2^31 elements are fine.
// Torch-free: compiled by nvcc alone.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "multi_tensor_body.h"

namespace lo {
namespace cuda_detail {

using mta::kBlock;
using mta::Meta;

inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string("lightning_optim CUDA ") + what + ": " + cudaGetErrorString(status));
}

template <class Op, int U>
__global__ void __launch_bounds__(kBlock) foreach_kernel(const __grid_constant__ Meta<U> meta, const Op op) {
  float unused0 = 0.0f, unused1 = 0.0f;
  mta::run_thread<false>(meta, op, static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x), unused0, unused1);
}

// Block-wide sum of the threads' two partial sums, then one double atomicAdd per block and value.
template <class Op, int U>
__global__ void __launch_bounds__(kBlock) reduce_kernel(const __grid_constant__ Meta<U> meta, const Op op, double* out) {
  float a0 = 0.0f, a1 = 0.0f;
  mta::run_thread<true>(meta, op, static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x), a0, a1);
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
    const int64_t k = meta.tensor_index[mta::slot_of(meta, static_cast<int>(blockIdx.x))];
    atomicAdd(out + 2 * k, b0);
    atomicAdd(out + 2 * k + 1, b1);
  }
}

}  // namespace cuda_detail

template <class Op>
void cuda_foreach(const Exec& ex, const ListArgs& a, const Op& op) {
  constexpr int U = Op::lists::used;
  auto stream = static_cast<cudaStream_t>(ex.stream);
  mta::for_each_launch<typename Op::lists>(a, [&](const mta::Meta<U>& meta, int64_t blocks) {
    cuda_detail::foreach_kernel<Op, U><<<static_cast<unsigned>(blocks), cuda_detail::kBlock, 0, stream>>>(meta, op);
    cuda_detail::check(cudaGetLastError(), "launch");
  });
}

// `out`: 2 doubles per tensor in device memory, zeroed by the caller.
template <class Op>
void cuda_reduce(const Exec& ex, const ListArgs& a, const Op& op, double* out) {
  constexpr int U = Op::lists::used;
  auto stream = static_cast<cudaStream_t>(ex.stream);
  mta::for_each_launch<typename Op::lists>(a, [&](const mta::Meta<U>& meta, int64_t blocks) {
    cuda_detail::reduce_kernel<Op, U><<<static_cast<unsigned>(blocks), cuda_detail::kBlock, 0, stream>>>(meta, op, out);
    cuda_detail::check(cudaGetLastError(), "launch");
  });
}

}  // namespace lo
