"""Which loop steps a declared optimizer over DataParallel's buckets.

A declaration says what an optimizer is (its state, its update, what it gathers); the loops that run
it over each rank's optimizer ranges live beside the buckets they read, so they are chosen here
rather than by the declaration (which the buckets' config holds: the other way round is a circle).
"""

from __future__ import annotations

from typing import Callable

from .declaration import AdamW, Declaration, Elementwise, Muon, TorchClass
from .elementwise import ElementwiseOptimizer
from .muon import DistributedMuon
from .muon_buddy import BuddyMuon
from .optimizer import DistributedAdamW
from .torch_optimizer import TorchOptimizer


def optimizer_loop(declaration: Declaration, buckets, cfg, decayed: Callable, name_of: Callable):
    """The optimizer stepping ``buckets``' optimizer ranges (weight decay where ``decayed(param)``;
    ``name_of(param)``: its name, for a matrix-wise optimizer's choice of matrices)."""
    if isinstance(declaration, AdamW):  # its own loop: the fused kernel, bf16 grads through a scratch
        return DistributedAdamW(buckets, cfg, decayed)
    if isinstance(declaration, Muon):
        return DistributedMuon(buckets, cfg, decayed, lambda p: declaration.matrices(name_of(p), p),
                               declaration.matrix_group)
    if isinstance(declaration, TorchClass):
        return TorchOptimizer(buckets, cfg, decayed, declaration)
    if isinstance(declaration, Elementwise):  # any element-wise update, over flat ranges under every stage
        return ElementwiseOptimizer(buckets, cfg, decayed, declaration)
    raise TypeError(f"no optimizer loop for {type(declaration).__name__}: declare it as an Elementwise, "
                    f"Muon or TorchClass optimizer")


def buddy_loop(declaration: Declaration, buddies, cfg, decayed: Callable, name_of: Callable):
    """The optimizer stepping the buddy ranges (buddy.py): the owned ranges' loop, or for Muon one that applies the
    orthogonalized update its bucket's owned step left (muon_buddy.py)."""
    if isinstance(declaration, Muon):
        return BuddyMuon(buddies, cfg, decayed, lambda p: declaration.matrices(name_of(p), p))
    return optimizer_loop(declaration, buddies, cfg, decayed, name_of)
