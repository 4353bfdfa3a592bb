// CPU entry points of the optimizer kernels: the shared dispatch (include/optim_dispatch.h) run
// with the OpenMP driver of cpu_loop.h.
#include "../include/optim_dispatch.h"
#include "cpu_loop.h"

namespace lo {
namespace {

struct Cpu {
  template <class Op> static void foreach(const Exec& ex, const ListArgs& a, const Op& op) { cpu_foreach(ex, a, op); }
  template <class Op> static void reduce(const Exec& ex, const ListArgs& a, const Op& op, double* out) {
    cpu_reduce(ex, a, op, out);
  }
};

}  // namespace

namespace cpu {

void adam(const Exec& ex, const ListArgs& a, const AdamHyper& h, const Types& ty, bool amsgrad, bool apply,
          bool frozen) {
  dispatch::adam<Cpu>(ex, a, h, ty, amsgrad, apply, frozen);
}
void sgd(const Exec& ex, const ListArgs& a, const SgdHyper& h, const Types& ty, bool momentum, bool apply) {
  dispatch::sgd<Cpu>(ex, a, h, ty, momentum, apply);
}
void lion(const Exec& ex, const ListArgs& a, const LionHyper& h, const Types& ty, bool apply) {
  dispatch::lion<Cpu>(ex, a, h, ty, apply);
}
void adan(const Exec& ex, const ListArgs& a, const AdanHyper& h, const Types& ty, bool apply) {
  dispatch::adan<Cpu>(ex, a, h, ty, apply);
}
void lamb_moments(const Exec& ex, const ListArgs& a, const LambHyper& h, const Types& ty, bool norms, double* out) {
  dispatch::lamb_moments<Cpu>(ex, a, h, ty, norms, out);
}
void lamb_apply(const Exec& ex, const ListArgs& a, const LambHyper& h, const Types& ty) {
  dispatch::lamb_apply<Cpu>(ex, a, h, ty);
}
void lars_norms(const Exec& ex, const ListArgs& a, const Types& ty, double* out) {
  dispatch::lars_norms<Cpu>(ex, a, ty, out);
}
void lars(const Exec& ex, const ListArgs& a, const LarsHyper& h, const Types& ty, bool momentum, bool apply) {
  dispatch::lars<Cpu>(ex, a, h, ty, momentum, apply);
}
void stable_moments(const Exec& ex, const ListArgs& a, const StableHyper& h, const Types& ty, bool rms, double* out) {
  dispatch::stable_moments<Cpu>(ex, a, h, ty, rms, out);
}
void stable_apply(const Exec& ex, const ListArgs& a, const StableHyper& h, const Types& ty) {
  dispatch::stable_apply<Cpu>(ex, a, h, ty);
}

}  // namespace cpu
}  // namespace lo
