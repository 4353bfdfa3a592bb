"""Reference 0/1 Adam (Lu et al. 2022, arXiv 2202.06009; DeepSpeed ``ZeroOneAdam``) run by W
simulated workers in one process. Step t is 1-based and every step updates the params.

Variance stage (t <= var_freeze_step); var_interval starts at 1:
  t % var_interval == 0 ("variance step"), gbar = mean_w g_w:
      m <- b1 m + (1 - b1) gbar,  v <- b2 v + (1 - b2) gbar^2
      after the step: every var_update_scaler variance steps, var_interval doubles
  otherwise:  m <- b1 m + (1 - b1) mask * C(g_0 .. g_{W-1})      (C: 1-bit allreduce, flat)
  p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)
  after step var_freeze_step the 1-bit allreduce restarts with zero error buffers.
Local stage (t > var_freeze_step), v frozen; local_interval starts at 1; worker w:
  m_w <- b1 m_w + (1 - b1) g_w
  p_w <- p_w (1 - lr wd) - a m_w / denom,           a = lr / (1 - b1^t),  denom = sqrt(v_hat) + eps
  u_w <- u_w (1 - lr wd) + a m_w,   A <- A (1 - lr wd) + a
  if t % local_interval == 0 (synchronisation):
      ubar = mask * C(u_0 .. u_{W-1})
      p_w <- p_w + (u_w - ubar) / denom              (undo the own local steps, apply the average)
      m_w <- ubar / A,  u_w <- 0,  A <- 0
  after the step: every local_step_scaler local-stage steps,
      local_interval <- min(local_step_clipper, 2 local_interval)
Bias correction: m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^k), k = variance steps so far.
"""

from __future__ import annotations

import torch

from ._onebit_workers import Workers


class RefZeroOneAdam:
    def __init__(self, params, world_size, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 var_freeze_step=100, var_update_scaler=16, local_step_scaler=32678, local_step_clipper=16,
                 bias_correction=True, lrs=None, masks=None):
        self.w = Workers(params, world_size, lrs, masks)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self.bias_correction = bias_correction
        self.m, self.v, self.u = self.w.zeros(), self.w.zeros(), self.w.zeros()
        self.A = [[0.0] * len(self.w.shapes) for _ in range(world_size)]
        self.t = 0
        self.var_interval, self.var_counter, self.var_updates = 1, 0, 0
        self.local_interval, self.local_counter = 1, 0
        self.synced = []  # per step: did the params agree on every worker afterwards

    @property
    def params(self):
        return self.w.params

    def _lr(self, j):
        return self.w.lrs[j] if self.w.lrs else self.lr

    def _denom(self, w, j):
        b2 = self.betas[1]
        bc2 = 1 - b2**self.var_updates if self.bias_correction and self.var_updates else 1.0
        return torch.sqrt(self.v[w][j] / bc2) + self.eps

    def step(self, grads):
        b1, b2 = self.betas
        W, n = self.w.world, len(self.w.shapes)
        self.t += 1
        t = self.t
        grads = [[g.float() for g in gs] for gs in grads]
        bc1 = 1 - b1**t if self.bias_correction else 1.0
        if t <= self.var_freeze_step:
            var_step = t % self.var_interval == 0
            if var_step:
                self.var_updates += 1
                for j in range(n):
                    gbar = Workers.mean([grads[w][j] for w in range(W)])
                    for w in range(W):
                        self.m[w][j] = b1 * self.m[w][j] + (1 - b1) * gbar
                        self.v[w][j] = b2 * self.v[w][j] + (1 - b2) * gbar * gbar
            else:
                cbar = self.w.compressed_mean(grads)
                for w in range(W):
                    for j in range(n):
                        self.m[w][j] = b1 * self.m[w][j] + (1 - b1) * cbar[j]
            for w in range(W):
                for j in range(n):
                    lr = self._lr(j)
                    p = self.w.params[w][j]
                    self.w.params[w][j] = p * (1 - lr * self.weight_decay) - lr * (self.m[w][j] / bc1) / self._denom(w, j)
            if var_step:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter, self.var_interval = 0, self.var_interval * 2
            if t == self.var_freeze_step:
                self.w.new_allreduce()
            self.synced.append(True)
            return
        for w in range(W):
            for j in range(n):
                lr = self._lr(j)
                keep, a = 1 - lr * self.weight_decay, lr / bc1
                self.m[w][j] = b1 * self.m[w][j] + (1 - b1) * grads[w][j]
                p = self.w.params[w][j]
                self.w.params[w][j] = p * keep - a * self.m[w][j] / self._denom(w, j)
                self.u[w][j] = self.u[w][j] * keep + a * self.m[w][j]
                self.A[w][j] = self.A[w][j] * keep + a
        sync = t % self.local_interval == 0
        if sync:
            ubar = self.w.compressed_mean(self.u)
            for w in range(W):
                for j in range(n):
                    self.w.params[w][j] = self.w.params[w][j] + (self.u[w][j] - ubar[j]) / self._denom(w, j)
                    self.m[w][j] = ubar[j] / self.A[w][j]
                    self.u[w][j] = torch.zeros_like(ubar[j])
                    self.A[w][j] = 0.0
        self.synced.append(sync)
        self.local_counter += 1
        if self.local_counter == self.local_step_scaler:
            self.local_counter = 0
            self.local_interval = min(self.local_step_clipper, self.local_interval * 2)
