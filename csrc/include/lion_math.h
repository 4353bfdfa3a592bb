// Lion (lightning_optim/optim/lion.py): the sign of an interpolated momentum.
//
//   delta = -lr sign(lerp(m, g, 1 - beta1))        (taken before m moves; sign(0) = 0)
//   m <- lerp(m, g, 1 - beta2)
//   then apply_delta (decoupled decay applied before the step, Kahan)
#pragma once

#include "apply_math.h"

namespace lo {

struct LionHyper {
  float w1 /* 1 - beta1 */, w2 /* 1 - beta2 */, neg_lr;
  Decay decay;
};

// Lists: 0 param (P), 1 grad (G), 2 exp_avg, 3 kahan_comp (P).
template <typename P, typename G, bool KAHAN, bool APPLY>
struct LionOp {
  static constexpr int depth = 4;
  using lists = ListAccess<Access<P, APPLY, APPLY>, In<G>, InOut<float>, UsedIf<KAHAN && APPLY, InOut<P>>>;
  struct Ptrs { P* p; const G* g; float* m; P* comp; };
  LionHyper h;

  HOST_DEVICE Ptrs bind(void* const* b, int64_t) const {
    return Ptrs{static_cast<P*>(b[0]), static_cast<const G*>(b[1]), static_cast<float*>(b[2]),
                static_cast<P*>(b[3])};
  }

  HOST_DEVICE LO_INLINE void operator()(const Ptrs& t, int64_t i) const {
    float g = to_float(t.g[i]);
    float m = t.m[i];
    if constexpr (APPLY) {
      float delta = sign_of(lerp(m, g, h.w1)) * h.neg_lr;
      apply_delta<P, KAHAN>(t.p, t.comp, i, delta, h.decay);
    }
    t.m[i] = lerp(m, g, h.w2);
  }
};

}  // namespace lo
