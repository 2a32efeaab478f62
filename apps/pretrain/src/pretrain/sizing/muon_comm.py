"""The collectives one Muon step issues on a rank (par_zero/muon.py), in ``par_groups.comm``'s bytes.

Per bucket holding Muon matrices, over its data-parallel sharding group of ``d`` ranks (nothing when
``d`` = 1), with ``N`` its elements (padded to a multiple of ``d``):

    sharded (ZeRO-1/2/3)   all-gather of the fp32 update          4 N            (the gathered output)
                           reduce-scatter of the owners' results  ns_bytes N     (the unreduced input; an
                                                                                  all-reduce with buddy shards)
    no_shard               all-reduce of the owners' results      ns_bytes N

and, per bucket with matrices split over a model-parallel group of ``mp`` ranks (TP, expert TP), one
all-gather of the fp32 blocks of the matrices this rank owns: ``4 mp E`` for ``E`` elements of its own
blocks (``E`` is about the split elements / ``d``: owners balance FLOPs, not bytes).
"""

from __future__ import annotations

UPDATE_BYTES = 4  # the update (momentum arithmetic) is fp32
NS_BYTES = {"bf16": 2, "fp32": 4}  # the owners' results travel in the Newton-Schulz dtype


def muon_step_bytes(elements: float, d: int, zero: str, ns_dtype: str, buddy: bool = False) -> dict[str, float]:
    """{op: bytes} over the sharding group for ``elements`` (the buckets' ``N``, summed) of a Muon step; ``buddy``
    (``[train].buddy_shards``): the owners' results all-reduced, each rank taking its buddy range of them too."""
    if d <= 1 or not elements:
        return {}
    if zero == "no_shard":
        return {"all_reduce": NS_BYTES[ns_dtype] * elements}
    return {"all_gather": UPDATE_BYTES * elements, ("all_reduce" if buddy else "reduce_scatter"): NS_BYTES[ns_dtype] * elements}


def muon_split_gather_bytes(owned_elements: float, mp: int) -> float:
    """All-gather bytes over a model-parallel group of ``mp`` ranks for ``owned_elements`` of own blocks."""
    return UPDATE_BYTES * mp * owned_elements if mp > 1 else 0.0


def muon_wire_per_element(zero: str, ns_dtype: str) -> float:
    """A Muon step's sharding-group bytes per element in the cost model's units (an all-reduce moves
    twice its tensor, a gather or scatter once): the planner's --auto search adds it to ZeRO's traffic."""
    return sum((2 if op == "all_reduce" else 1) * b for op, b in muon_step_bytes(1, 2, zero, ns_dtype).items())
