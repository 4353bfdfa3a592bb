// SGD with momentum (lightning_optim/optim/sgd.py, torch semantics + wd_after_momentum).
//
//   d = g + l2_pre p
//   b <- d (first step) | mu b + (1 - dampening) d;   d <- d + mu b (nesterov) | b
//   d <- d + l2_post p        (wd_after_momentum)
//   delta = -lr d, then apply_delta (fully decoupled decay, Kahan)
#pragma once

#include "apply_math.h"

namespace lo {

struct SgdHyper {
  float momentum, damp_keep /* 1 - dampening */, l2_pre, l2_post, neg_lr;
  bool first, nesterov;
  Decay decay;
};

// Lists: 0 param (P), 1 grad (G), 2 momentum_buffer, 3 kahan_comp (P).
template <typename P, typename G, bool MOMENTUM, bool KAHAN, bool APPLY>
struct SgdOp {
  static constexpr int depth = 4;
  using lists = ListAccess<Access<P, true, APPLY>, In<G>, UsedIf<MOMENTUM, InOut<float>>, UsedIf<KAHAN && APPLY, InOut<P>>>;
  struct Ptrs { P* p; const G* g; float* buf; P* comp; };
  SgdHyper h;

  HOST_DEVICE Ptrs bind(void* const* b, int64_t) const {
    return Ptrs{static_cast<P*>(b[0]), static_cast<const G*>(b[1]), static_cast<float*>(b[2]),
                static_cast<P*>(b[3])};
  }

  HOST_DEVICE LO_INLINE void operator()(const Ptrs& t, int64_t i) const {
    float pc = to_float(t.p[i]);
    float d = to_float(t.g[i]) + h.l2_pre * pc;
    if constexpr (MOMENTUM) {
      float b = t.buf[i] * h.momentum + h.damp_keep * d;
      b = h.first ? d : b;
      t.buf[i] = b;
      d = h.nesterov ? d + h.momentum * b : b;
    }
    if constexpr (APPLY) {
      d = d + h.l2_post * pc;
      apply_delta<P, KAHAN>(t.p, t.comp, i, d * h.neg_lr, h.decay);
    }
  }
};

}  // namespace lo
