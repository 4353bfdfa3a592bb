// CUDA entry points of the optimizer kernels: the shared dispatch (include/optim_dispatch.h) run
// with the multi-tensor-apply launcher. Torch-free: nvcc compiles it alone.
#include "../include/optim_dispatch.h"
#include "multi_tensor_apply.cuh"

namespace lo {
namespace {

struct Gpu {
  template <class Op> static void foreach(const Exec& ex, const ListArgs& a, const Op& op) { cuda_foreach(ex, a, op); }
  template <class Op> static void reduce(const Exec& ex, const ListArgs& a, const Op& op, double* out) {
    cuda_reduce(ex, a, op, out);
  }
};

}  // namespace

namespace cuda {

void adam(const Exec& ex, const ListArgs& a, const AdamHyper& h, const Types& ty, bool amsgrad, bool apply,
          bool frozen) {
  dispatch::adam<Gpu>(ex, a, h, ty, amsgrad, apply, frozen);
}
void sgd(const Exec& ex, const ListArgs& a, const SgdHyper& h, const Types& ty, bool momentum, bool apply) {
  dispatch::sgd<Gpu>(ex, a, h, ty, momentum, apply);
}
void lion(const Exec& ex, const ListArgs& a, const LionHyper& h, const Types& ty, bool apply) {
  dispatch::lion<Gpu>(ex, a, h, ty, apply);
}
void adan(const Exec& ex, const ListArgs& a, const AdanHyper& h, const Types& ty, bool apply) {
  dispatch::adan<Gpu>(ex, a, h, ty, apply);
}
void lamb_moments(const Exec& ex, const ListArgs& a, const LambHyper& h, const Types& ty, bool norms, double* out) {
  dispatch::lamb_moments<Gpu>(ex, a, h, ty, norms, out);
}
void lamb_apply(const Exec& ex, const ListArgs& a, const LambHyper& h, const Types& ty) {
  dispatch::lamb_apply<Gpu>(ex, a, h, ty);
}
void lars_norms(const Exec& ex, const ListArgs& a, const Types& ty, double* out) {
  dispatch::lars_norms<Gpu>(ex, a, ty, out);
}
void lars(const Exec& ex, const ListArgs& a, const LarsHyper& h, const Types& ty, bool momentum, bool apply) {
  dispatch::lars<Gpu>(ex, a, h, ty, momentum, apply);
}
void stable_moments(const Exec& ex, const ListArgs& a, const StableHyper& h, const Types& ty, bool rms, double* out) {
  dispatch::stable_moments<Gpu>(ex, a, h, ty, rms, out);
}
void stable_apply(const Exec& ex, const ListArgs& a, const StableHyper& h, const Types& ty) {
  dispatch::stable_apply<Gpu>(ex, a, h, ty);
}

}  // namespace cuda
}  // namespace lo
