"""Self-attention routing (Efficient-CapsNet): one non-iterative pass from primary to class capsules.

Mazzia, Salvetti & Chiaberge (2021), "Efficient-CapsNet: capsule network with self-attention routing",
Sci. Rep. 11, 14634, section "Self-attention routing". Symbols, for input capsules i (n_in of them, the
paper's n^l) and output capsules j (n^{l+1}):

  u_i      input capsule                                            [B, n_in, d_in]
  W_ij     transformation matrix                                    [n_in, n_out, d_in, d_out]
  û_ij     prediction ("vote") W_ij u_i; Û_j stacks them over i     [B, n_in, n_out, d_out]
  A_j      self-attention matrix Û_j Û_jᵀ / √d  (d = d_out)         [B, n_out, n_in, n_in]
  c_ij     coupling: softmax over parents j of Σ_k A_j[i, k]        [B, n_in, n_out]
  b_ij     learned log prior ("priors B"), added to the coupling    [n_in, n_out]
  s_j      Σ_i û_ij (c_ij + b_ij);  v_j = squash_eff(s_j)           [B, n_out, d_out]

The row sums of A_j never need the n_in × n_in matrix: Σ_k û_ij · û_kj = û_ij · (Σ_k û_kj), so the layer computes
the sum of votes S_j = Σ_k û_kj once per parent and one dot product per vote, O(B·n_in·n_out·d) instead of the
O(B·n_out·n_in²·d) of forming A (tests/reference_routing.py forms it; the results are the same).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..nn.squash import efficient_squash
from .base import RoutingOutput, check_capsules, check_sizes, votes


def self_attention_routing(u_hat: torch.Tensor, prior: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-attention routing on precomputed votes û [B, n_in, n_out, d] with log prior b [n_in, n_out].

    Returns v [B, n_out, d] (Efficient-CapsNet's squash) and the coupling c [B, n_in, n_out].
    """
    d = u_hat.shape[-1]
    total = u_hat.sum(dim=1, keepdim=True)  # S_j = Σ_k û_kj  [B, 1, n_out, d]
    logits = (u_hat * total).sum(dim=-1) / math.sqrt(d)  # Σ_k A_j[i, k] = û_ij · S_j / √d  [B, n_in, n_out]
    c = torch.softmax(logits, dim=2)  # c_ij = softmax over the parents j  [B, n_in, n_out]
    s = torch.einsum("bij,bijd->bjd", c + prior.to(c.dtype), u_hat)  # s_j = Σ_i û_ij (c_ij + b_ij)  [B, n_out, d]
    return efficient_squash(s), c


class SelfAttentionRouter(nn.Module):
    """Efficient-CapsNet's fully connected capsule layer with self-attention routing (no iterations).

    Args:
        in_caps, out_caps, in_d, out_d: numbers and dimensions of the input and output capsules.
        weight_std: initial std of W (default √(2 / in_d), He initialisation over a vote's fan-in).

    Parameters: W [in_caps, out_caps, in_d, out_d] (the layout of `capsnet.routing.Router`) and the
    log prior b [in_caps, out_caps], initialised to 0. Efficient-CapsNet's MNIST layer (16×8D → 10×16D) has
    16·10·8·16 + 16·10 = 20,640 of them.
    """

    def __init__(self, in_caps: int, out_caps: int, in_d: int, out_d: int, *, weight_std: float | None = None):
        super().__init__()
        check_sizes("SelfAttentionRouter", in_caps, out_caps, in_d, out_d)
        self.in_caps, self.out_caps, self.in_d, self.out_d = in_caps, out_caps, in_d, out_d
        self.weight_std = math.sqrt(2.0 / in_d) if weight_std is None else weight_std
        self.weight = nn.Parameter(torch.empty(in_caps, out_caps, in_d, out_d))
        self.prior = nn.Parameter(torch.zeros(in_caps, out_caps))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.weight_std)
        nn.init.zeros_(self.prior)

    def extra_repr(self) -> str:
        return f"in_caps={self.in_caps}, out_caps={self.out_caps}, in_d={self.in_d}, out_d={self.out_d}"

    def forward(
        self, u: torch.Tensor, a: torch.Tensor | None = None, *, return_weights: bool = False
    ) -> torch.Tensor | RoutingOutput:
        """u [B, in_caps, in_d] -> v [B, out_caps, out_d]; `a` must be None (this routing has no activations)."""
        check_capsules("SelfAttentionRouter", u, self.in_caps, self.in_d)
        if a is not None:
            raise ValueError("SelfAttentionRouter takes no input activations (pass a=None)")
        v, c = self_attention_routing(votes(self.weight, u), self.prior)  # û_ij = W_ij u_i  [B, in, out, d]
        return RoutingOutput(v, c) if return_weights else v
