"""Reference 1-bit Adam (Tang et al. 2021, arXiv 2102.02888; DeepSpeed ``OnebitAdam``) run by W
simulated workers in one process, with the bias correction and eps placement switches that
DeepSpeed ignores made to work.

Step t (1-based), worker w's gradient g_w, lr/wd per param:

  warmup (t <= freeze_step), on gbar = mean_w g_w (all workers alike):
      m <- b1 m + (1 - b1) gbar,   v <- b2 v + (1 - b2) gbar^2
  compression (t > freeze_step), v frozen:
      m_w <- b1 m + (1 - b1) g_w,  m <- mask * C(m_0 .. m_{W-1})   (C: 1-bit allreduce of the flat
                                                                    concatenation of all momenta)
  then  p <- p * (1 - lr wd) - lr * m_hat / (sqrt(v_hat) + eps)    (or sqrt(v_hat + eps))
      m_hat = m / (1 - b1^t),  v_hat = v / (1 - b2^min(t, freeze_step))   (1 without bias_correction)
"""

from __future__ import annotations

import torch

from ._onebit_workers import Workers


class RefOnebitAdam:
    def __init__(self, params, world_size, lr=1e-3, freeze_step=100, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, bias_correction=True, eps_inside_sqrt=False, lrs=None, masks=None):
        self.w = Workers(params, world_size, lrs, masks)
        self.lr, self.freeze_step, self.betas, self.eps = lr, freeze_step, betas, eps
        self.weight_decay, self.bias_correction, self.eps_inside_sqrt = weight_decay, bias_correction, eps_inside_sqrt
        self.m, self.v = self.w.zeros(), self.w.zeros()
        self.t = 0

    @property
    def params(self):
        return self.w.params

    def step(self, grads):
        """``grads[w][j]``: worker w's gradient of param j."""
        b1, b2 = self.betas
        W, n = self.w.world, len(self.w.shapes)
        self.t += 1
        t = self.t
        grads = [[g.float() for g in gs] for gs in grads]
        if t <= self.freeze_step:
            for j in range(n):
                gbar = Workers.mean([grads[w][j] for w in range(W)])
                for w in range(W):
                    self.m[w][j] = b1 * self.m[w][j] + (1 - b1) * gbar
                    self.v[w][j] = b2 * self.v[w][j] + (1 - b2) * gbar * gbar
        else:
            local = [[b1 * self.m[w][j] + (1 - b1) * grads[w][j] for j in range(n)] for w in range(W)]
            agreed = self.w.compressed_mean(local)
            self.m = [[x.clone() for x in agreed] for _ in range(W)]
        k = min(t, self.freeze_step)
        bc1 = 1 - b1**t if self.bias_correction else 1.0
        bc2 = 1 - b2**k if self.bias_correction and k > 0 else 1.0
        for w in range(W):
            for j in range(n):
                lr = self.w.lrs[j] if self.w.lrs else self.lr
                v_hat = self.v[w][j] / bc2
                denom = torch.sqrt(v_hat + self.eps) if self.eps_inside_sqrt else torch.sqrt(v_hat) + self.eps
                p = self.w.params[w][j]
                self.w.params[w][j] = p * (1 - lr * self.weight_decay) - lr * (self.m[w][j] / bc1) / denom
