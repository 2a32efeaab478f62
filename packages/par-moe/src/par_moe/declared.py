"""Declared routing: token counts given in place of the data's, for a run on fake tensors.

On fake tensors (``pretrain plan --simulate``) the router's choices have shapes but no values,
so they cannot size the dispatch (``nonzero``, ``bincount``, the all-to-all's split sizes). A
:class:`DeclaredRouting`, set as :attr:`MoELayer.routing`, declares those sizes instead; every
op then runs with the declared shapes, and the training path (``routing=None``) is unchanged.

The declaration: every rank routes its ``T x k`` (token, expert) pairs alike. Balanced, each
expert gets ``T k / E`` of them; with ``imbalance = F``, expert 0 (on EP rank 0) gets ``F`` times
its share and the others split the rest evenly. A token's k experts sit on distinct EP ranks as
far as the EP group allows, so the all-to-all carries the most rows it can (one per pair, capped
at one per token and rank). Capacity, when set, caps each expert's pairs per source rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutedSizes:
    """The sizes one dispatch takes from the routing, for ``tokens`` rows on this rank."""

    pairs: list[int]  # (token, expert) pairs this rank routes to each expert [E]
    send: list[int]  # rows to each EP rank
    receive: list[int]  # rows from each EP rank
    local: list[int]  # pairs for each of this rank's experts, from every source rank


@dataclass(frozen=True)
class DeclaredRouting:
    imbalance: float = 1.0  # expert 0 receives this many times its share (1: balanced)

    def pairs(self, tokens: int, top_k: int, num_experts: int, capacity: int | None = None) -> list[int]:
        """Pairs per expert from ``tokens`` tokens: expert 0 takes ``imbalance`` shares (at most
        one pair per token), the others the rest as evenly as whole numbers allow."""
        total = tokens * top_k
        hot = min(tokens, round(self.imbalance * total / num_experts))
        rest, extra = divmod(total - hot, num_experts - 1) if num_experts > 1 else (0, 0)
        out = [hot] + [rest + (i < extra) for i in range(num_experts - 1)]
        return out if capacity is None else [min(p, capacity) for p in out]

    def counts(self, tokens: int, top_k: int, num_experts: int, device: torch.device,
               capacity: int | None = None) -> torch.Tensor:
        """The router's pairs per expert, int64 ``[E]`` (what ``tokens_per_expert`` would count)."""
        return torch.tensor(self.pairs(tokens, top_k, num_experts, capacity), dtype=torch.int64, device=device)

    def sizes(self, tokens: int, top_k: int, num_experts: int, ep: int, ep_rank: int,
              capacity: int | None = None) -> RoutedSizes:
        pairs = self.pairs(tokens, top_k, num_experts, capacity)
        n = num_experts // ep
        send = [min(tokens, sum(pairs[p * n:(p + 1) * n])) for p in range(ep)]
        mine = pairs[ep_rank * n:(ep_rank + 1) * n]
        return RoutedSizes(pairs, send, [send[ep_rank]] * ep, [ep * c for c in mine])


def nonzero(mask: torch.Tensor, size: int | None) -> tuple[torch.Tensor, ...]:
    """``mask.nonzero(as_tuple=True)``; with a declared ``size``, that many (a static shape)."""
    if size is None:
        return mask.nonzero(as_tuple=True)
    return tuple(torch.nonzero_static(mask, size=size).unbind(1))


def bincount(values: torch.Tensor, minlength: int, declared: list[int] | None) -> torch.Tensor:
    """``torch.bincount(values, minlength=minlength)``; the ``declared`` counts where given."""
    if declared is None:
        return torch.bincount(values, minlength=minlength)
    return torch.tensor(declared, dtype=torch.int64, device=values.device)
