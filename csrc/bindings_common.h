// What the two binding files share: ATen + torch's pybind casters (a third of torch/extension.h's
// compile time), the dtype tag of a tensor, where a call runs (CPU threads or the current CUDA
// stream), the checks of a flat tensor argument, and the CPU/CUDA dispatch macros.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <vector>

#ifdef WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include "include/kernel_api.h"

namespace lo_bind {

inline lo::DType dtype_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return lo::DType::F32;
    case at::kBFloat16: return lo::DType::BF16;
    case at::kHalf: return lo::DType::F16;
    default: TORCH_CHECK_TYPE(false, what, ": dtype ", t.scalar_type(), " is not supported (float32, bfloat16, float16)");
  }
  return lo::DType::F32;
}

inline lo::Exec exec_for(const at::Device& device) {
  lo::Exec ex;
  ex.threads = at::get_num_threads();
#ifdef WITH_CUDA
  if (device.is_cuda()) ex.stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
#else
  TORCH_CHECK(!device.is_cuda(), "lightning_optim kernels were built without CUDA; use the torch backend for CUDA tensors");
#endif
  return ex;
}

inline void check_flat(const at::Tensor& t, const char* name, at::ScalarType type, const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, name, ": on ", t.device(), ", expected ", device);
  TORCH_CHECK_TYPE(t.scalar_type() == type, name, ": expected ", type, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, ": must be contiguous");
}

// bindings_onebit.cpp: the 1-bit compression kernels (flat buffers and per-segment pieces).
void register_onebit(pybind11::module_& m);

}  // namespace lo_bind

#ifdef WITH_CUDA
#define LO_GUARD(dev) c10::cuda::OptionalCUDAGuard guard_(dev.is_cuda() ? std::optional<at::Device>(dev) : std::nullopt)
#define LO_CALL(packed, fn, ...) \
  (is_cuda(packed) ? lo::cuda::fn(__VA_ARGS__) : lo::cpu::fn(__VA_ARGS__))
#define LO_CALL_DEV(device, fn, ...) \
  ((device).is_cuda() ? lo::cuda::fn(__VA_ARGS__) : lo::cpu::fn(__VA_ARGS__))
#else
#define LO_GUARD(dev) (void)0
#define LO_CALL(packed, fn, ...) lo::cpu::fn(__VA_ARGS__)
#define LO_CALL_DEV(device, fn, ...) lo::cpu::fn(__VA_ARGS__)
#endif
