"""Heinsen's 2022 routing (An Algorithm for Routing Vectors in Sequences, arXiv:2211.11754, Algorithm 1 with its
efficient networks A, F, G, S): the `--routing heinsen-vector` layer, for sequences of any length with a mask.

Input vectors x_i [B, I, d_in] are routed to output vectors x_j [B, J, d_out] that maximise "bang per bit" by best
predicting them. With x̃_i = x_i / √I:

  A       a_i = W_A x̃_i + b_A                                       input scores  [B, I]
  F       V_ijh = Σ_d x̃_id W^F1_jd W^F2_dh + B^F2_jh                 proposals, never stored  [B, I, J, d_out]
  E-step  R_ij = 1/J at first, then softmax_j(S_ij)                   [B, I, J]
  G       x̂_j = (N(x_j) W^G1) ⊙ W^G2_j + B^G2_j                       predicted inputs  [B, J, d_in]
  S       S_ij = log f((x_i · x̂_j) W^S_ij + B^S_ij)                   [B, I, J]
  D-step  D^use_ij = f(a_i) R_ij,  D^ign_ij = f(a_i) − D^use_ij        [B, I, J]
  M-step  φ_ij = β^use_ij D^use_ij − β^ign_ij D^ign_ij                 "bang per bit"  [B, I, J]
          x_j = Σ_i φ_ij V_ij = ((Σ_i φ_ij x̃_i) ⊙ W^F1_j) W^F2 + (Σ_i φ_ij) B^F2_j    [B, J, d_out]

iterated r times (the authors' default: 2), then x_j ← N(x_j) (`normalize`); f is the sigmoid, N a LayerNorm
without parameters. The M-step sums before it maps, so the votes V [B, I, J, d_out] are never stored: memory is
O(I·J + I·d_in), which lets a long sequence route (the authors' `memory_efficient`).

A `mask` [..., I, J] (True: input i is ignored by output j) removes inputs: f(a_i) is 0 there and R_ij is a
softmax over the outputs that see input i. An input masked from every output has R = 0 (the authors' code gives
NaN). With `in_caps` = −1 the layer routes sequences of any length: W_A, b_A, W_S, B_S are shared by the inputs and
β^use, β^ign are linear functions of x_i (the authors' n_inp = −1).

CapsNet's class probability is a classifier on x_j (record: probability "classifier"): the outputs are normalised,
so their lengths are all about √d_out. The layer has no input activations: it scores its inputs itself (A).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import RoutingOutput, autocast_off, check_sizes


class HeinsenVectorRouting(nn.Module):
    """Heinsen's 2022 efficient vector routing: x [B, in_caps, in_d] (any number of inputs if in_caps = −1), an
    optional mask, -> x_out [B, out_caps, out_d].

    Args:
        in_caps, out_caps: numbers of input and output vectors (out_caps >= 2); in_caps −1: any number.
        in_d, out_d: the vectors' sizes.
        iterations: routing iterations (the authors' default: 2).
        normalize: N(x_j) at the end (when out_d > 1; the authors' default).
    """

    activations = False  # it scores its inputs itself (network A)

    def __init__(
        self, in_caps: int, out_caps: int, in_d: int, out_d: int, iterations: int = 2, *, normalize: bool = True
    ):
        super().__init__()
        check_sizes("HeinsenVectorRouting", out_caps, in_d, out_d, iterations)
        if in_caps < 1 and in_caps != -1:
            raise ValueError(f"HeinsenVectorRouting: in_caps must be >= 1, or -1 for any number, got {in_caps}")
        if out_caps < 2:
            raise ValueError(f"HeinsenVectorRouting: routing needs at least 2 outputs, got out_caps={out_caps}")
        self.in_caps, self.out_caps, self.in_d, self.out_d = in_caps, out_caps, in_d, out_d
        self.iterations, self.normalize = iterations, normalize
        n, j, d, h = max(1, in_caps), out_caps, in_d, out_d
        self.w_a = nn.Parameter(torch.randn(n, d) * 2.0 * d**-0.5)  # W_A  [I, d_in]
        self.b_a = nn.Parameter(torch.zeros(n))  # b_A  [I]
        self.w_f1 = nn.Parameter(torch.randn(j, d))  # W^F1  [J, d_in]
        self.w_f2 = nn.Parameter(torch.randn(d, h) * 2.0 * d**-0.5)  # W^F2  [d_in, d_out]
        self.b_f2 = nn.Parameter(torch.zeros(j, h))  # B^F2  [J, d_out]
        self.w_g1 = nn.Parameter(torch.randn(h, d) * h**-0.5)  # W^G1  [d_out, d_in]
        self.w_g2 = nn.Parameter(torch.randn(j, d))  # W^G2  [J, d_in]
        self.b_g2 = nn.Parameter(torch.zeros(j, d))  # B^G2  [J, d_in]
        self.w_s = nn.Parameter(torch.randn(n, j) * d**-0.5)  # W^S  [I, J]
        self.b_s = nn.Parameter(torch.zeros(n, j))  # B^S  [I, J]
        if in_caps > 0:
            self.beta_use = nn.Parameter(torch.randn(n, j))  # β^use  [I, J]
            self.beta_ign = nn.Parameter(torch.randn(n, j))  # β^ign  [I, J]
        else:  # any length: β^use_ij, β^ign_ij computed from x_i
            self.beta_use_net, self.beta_ign_net = nn.Linear(d, j), nn.Linear(d, j)

    def extra_repr(self) -> str:
        return (
            f"in_caps={self.in_caps}, out_caps={self.out_caps}, in_d={self.in_d}, out_d={self.out_d}, "
            f"iterations={self.iterations}, normalize={self.normalize}"
        )

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """N: LayerNorm over the last axis without parameters (the identity for out_d = 1)."""
        return F.layer_norm(x, x.shape[-1:]) if self.out_d > 1 else x

    def forward(
        self,
        u: torch.Tensor,
        a: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        return_weights: bool = False,
    ) -> torch.Tensor | RoutingOutput:
        """u [B, I, in_d]; `a` is not used (network A scores the inputs); mask: bool, broadcastable to [B, I, J],
        True where output j ignores input i. -> x_j [B, J, out_d], or RoutingOutput(x_j, R [B, I, J])."""
        self._check(u, mask)
        with autocast_off(u.device.type):  # (bf16 under autocast: routed in fp32)
            x_out, r = self._route(u if u.dtype == torch.float64 else u.float(), mask)
        return RoutingOutput(x_out, r) if return_weights else x_out

    def _route(self, u: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Algorithm 1: u [B, I, in_d] -> (x_j [B, J, out_d], R [B, I, J])."""
        n_in = u.shape[1]
        if self.in_caps > 0:
            beta_use, beta_ign = self.beta_use.to(u.dtype), self.beta_ign.to(u.dtype)  # [I, J]
        else:
            beta_use, beta_ign = self.beta_use_net(u), self.beta_ign_net(u)  # [B, I, J]
        x = u * n_in**-0.5  # x̃_i  [B, I, d_in]
        f_a = torch.sigmoid((x * self.w_a).sum(-1) + self.b_a)[..., None]  # A: f(a_i)  [B, I, 1]
        if mask is not None:  # f(a_i) = 0 where masked  [B, I, J]
            f_a = f_a.masked_fill(mask, 0.0)
        r = x_out = None
        for it in range(self.iterations):
            if it == 0:  # E-step: R_ij = 1/J (over the outputs that see i)
                uniform = u.new_zeros(()).expand(*u.shape[:2], self.out_caps)
                r = (uniform + 1.0 / self.out_caps) if mask is None else self._softmax(uniform, mask)
            else:
                assert x_out is not None
                pred = (self._norm(x_out) @ self.w_g1) * self.w_g2 + self.b_g2  # G: x̂_j  [B, J, d_in]
                s = F.logsigmoid((u @ pred.transpose(1, 2)) * self.w_s + self.b_s)  # S_ij  [B, I, J]
                r = self._softmax(s, mask)
            d_use = f_a * r  # D-step: D^use_ij  [B, I, J]
            d_ign = f_a - d_use  # D^ign_ij
            phi = beta_use * d_use - beta_ign * d_ign  # M-step: φ_ij  [B, I, J]
            # x_j = ((Σ_i φ_ij x̃_i) ⊙ W^F1_j) W^F2 + (Σ_i φ_ij) B^F2_j  [B, J, d_out]
            x_out = ((phi.transpose(1, 2) @ x) * self.w_f1) @ self.w_f2 + phi.sum(1)[..., None] * self.b_f2
        assert x_out is not None and r is not None
        return (self._norm(x_out) if self.normalize else x_out), r

    @staticmethod
    def _softmax(s: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """softmax_j(S_ij) over the outputs that see input i; 0 for an input every output ignores."""
        if mask is None:
            return torch.softmax(s, dim=-1)
        return torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1).masked_fill(mask, 0.0)

    def _check(self, u: torch.Tensor, mask: torch.Tensor | None) -> None:
        n = "any number of" if self.in_caps == -1 else str(self.in_caps)
        if not isinstance(u, torch.Tensor) or u.dim() != 3 or u.shape[2] != self.in_d or not u.is_floating_point():
            got = list(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
            raise ValueError(f"HeinsenVectorRouting expects floats [B, I, {self.in_d}] ({n} inputs I), got {got}")
        if self.in_caps != -1 and u.shape[1] != self.in_caps:
            raise ValueError(f"HeinsenVectorRouting expects {self.in_caps} inputs, got {u.shape[1]}")
        if mask is not None:
            if mask.dtype != torch.bool:
                raise ValueError(f"HeinsenVectorRouting: mask must be bool, got {mask.dtype}")
            try:
                torch.broadcast_shapes(mask.shape, (u.shape[0], u.shape[1], self.out_caps))
            except RuntimeError:
                raise ValueError(
                    f"HeinsenVectorRouting: mask {list(mask.shape)} does not broadcast to "
                    f"[{u.shape[0]}, {u.shape[1]}, {self.out_caps}]"
                ) from None


__all__ = ["HeinsenVectorRouting"]
