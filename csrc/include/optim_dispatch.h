// Runtime dtypes/flags -> template instances of the element ops, written once for both backends.
// A backend B provides B::foreach(exec, lists, op) and B::reduce(exec, lists, op, out);
// cpu/optim_cpu.cpp and cuda/optim_cuda.cu instantiate these with their own drivers.
#pragma once

#include "kernel_api.h"

namespace lo {
namespace dispatch {

template <class B>
void adam(const Exec& ex, const ListArgs& a, const AdamHyper& h, const Types& ty, bool amsgrad, bool apply,
          bool frozen) {
  with_param_types(ty, [&](auto pt, auto gt, auto kt) {
    using P = typename std::decay_t<decltype(pt)>::type;
    using G = typename std::decay_t<decltype(gt)>::type;
    if (frozen) {  // 1-bit Adam's compression stage: m given in the grads' list, v frozen, no copies
      if constexpr (std::is_same<G, float>::value)
        B::foreach(ex, a, AdamFrozenOp<P, std::decay_t<decltype(kt)>::value>{h});
      return;
    }
    with_bool(amsgrad, [&](auto ams) {
      with_bool(apply, [&](auto app) {
        auto run = [&](auto ct) {
          using C = typename std::decay_t<decltype(ct)>::type;
          B::foreach(ex, a, AdamOp<P, G, C, std::decay_t<decltype(ams)>::value, std::decay_t<decltype(kt)>::value, std::decay_t<decltype(app)>::value>{h});
        };
        if constexpr (std::is_same<P, float>::value && std::decay_t<decltype(app)>::value) {
          if (ty.has_copy) {
            with_type(ty.copy, [&](auto ct) {
              if constexpr (!std::is_same<typename std::decay_t<decltype(ct)>::type, float>::value) run(ct);
            });
            return;
          }
        }
        run(Tag<void>{});
      });
    });
  });
}

template <class B>
void sgd(const Exec& ex, const ListArgs& a, const SgdHyper& h, const Types& ty, bool momentum, bool apply) {
  with_param_types(ty, [&](auto pt, auto gt, auto kt) {
    using P = typename std::decay_t<decltype(pt)>::type;
    using G = typename std::decay_t<decltype(gt)>::type;
    with_bool(momentum, [&](auto mom) {
      with_bool(apply, [&](auto app) {
        B::foreach(ex, a, SgdOp<P, G, std::decay_t<decltype(mom)>::value, std::decay_t<decltype(kt)>::value, std::decay_t<decltype(app)>::value>{h});
      });
    });
  });
}

template <class B>
void lion(const Exec& ex, const ListArgs& a, const LionHyper& h, const Types& ty, bool apply) {
  with_param_types(ty, [&](auto pt, auto gt, auto kt) {
    using P = typename std::decay_t<decltype(pt)>::type;
    using G = typename std::decay_t<decltype(gt)>::type;
    with_bool(apply, [&](auto app) {
      B::foreach(ex, a, LionOp<P, G, std::decay_t<decltype(kt)>::value, std::decay_t<decltype(app)>::value>{h});
    });
  });
}

template <class B>
void adan(const Exec& ex, const ListArgs& a, const AdanHyper& h, const Types& ty, bool apply) {
  with_param_types(ty, [&](auto pt, auto gt, auto kt) {
    using P = typename std::decay_t<decltype(pt)>::type;
    using G = typename std::decay_t<decltype(gt)>::type;
    with_bool(apply, [&](auto app) {
      B::foreach(ex, a, AdanOp<P, G, std::decay_t<decltype(kt)>::value, std::decay_t<decltype(app)>::value>{h});
    });
  });
}

// The reductions and the second phases never see a Kahan buffer or a grad: only the instances
// they need are dispatched.
inline Types without_kahan(Types ty) {
  ty.kahan = false;
  return ty;
}

inline Types without_grad(Types ty) {
  ty.g = DType::F32;
  return ty;
}

template <class B>
void lamb_moments(const Exec& ex, const ListArgs& a, const LambHyper& h, const Types& ty, bool norms, double* out) {
  with_param_types(without_kahan(ty), [&](auto pt, auto gt, auto) {
    using P = typename std::decay_t<decltype(pt)>::type;
    using G = typename std::decay_t<decltype(gt)>::type;
    with_bool(norms, [&](auto nb) { B::reduce(ex, a, LambMomentsOp<P, G, std::decay_t<decltype(nb)>::value>{h}, out); });
  });
}

template <class B>
void lamb_apply(const Exec& ex, const ListArgs& a, const LambHyper& h, const Types& ty) {
  with_param_types(without_grad(ty), [&](auto pt, auto gt, auto kt) {
    using P = typename std::decay_t<decltype(pt)>::type;
    if constexpr (std::is_same<typename std::decay_t<decltype(gt)>::type, float>::value)
      B::foreach(ex, a, LambApplyOp<P, std::decay_t<decltype(kt)>::value>{h});
  });
}

template <class B>
void lars_norms(const Exec& ex, const ListArgs& a, const Types& ty, double* out) {
  with_param_types(without_kahan(ty), [&](auto pt, auto gt, auto kt) {
    using P = typename std::decay_t<decltype(pt)>::type;
    using G = typename std::decay_t<decltype(gt)>::type;
    if constexpr (!std::decay_t<decltype(kt)>::value) B::reduce(ex, a, LarsNormOp<P, G>{}, out);
  });
}

template <class B>
void lars(const Exec& ex, const ListArgs& a, const LarsHyper& h, const Types& ty, bool momentum, bool apply) {
  with_param_types(ty, [&](auto pt, auto gt, auto kt) {
    using P = typename std::decay_t<decltype(pt)>::type;
    using G = typename std::decay_t<decltype(gt)>::type;
    with_bool(momentum, [&](auto mom) {
      with_bool(apply, [&](auto app) {
        B::foreach(ex, a, LarsOp<P, G, std::decay_t<decltype(mom)>::value, std::decay_t<decltype(kt)>::value, std::decay_t<decltype(app)>::value>{h});
      });
    });
  });
}

template <class B>
void stable_moments(const Exec& ex, const ListArgs& a, const StableHyper& h, const Types& ty, bool rms, double* out) {
  with_param_types(without_kahan(ty), [&](auto, auto gt, auto kt) {
    using G = typename std::decay_t<decltype(gt)>::type;
    if constexpr (!std::decay_t<decltype(kt)>::value)
      with_bool(rms, [&](auto rb) { B::reduce(ex, a, StableMomentsOp<G, std::decay_t<decltype(rb)>::value>{h}, out); });
  });
}

template <class B>
void stable_apply(const Exec& ex, const ListArgs& a, const StableHyper& h, const Types& ty) {
  with_param_types(without_grad(ty), [&](auto pt, auto gt, auto kt) {
    using P = typename std::decay_t<decltype(pt)>::type;
    if constexpr (std::is_same<typename std::decay_t<decltype(gt)>::type, float>::value)
      B::foreach(ex, a, StableApplyOp<P, std::decay_t<decltype(kt)>::value>{h});
  });
}


}  // namespace dispatch
}  // namespace lo
