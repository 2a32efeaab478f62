"""Zero-bubble's split backward without walking the graph twice.

A chunk's autograd graph has an *activation path* (the nodes that lead back to the chunk's input)
and *weight branches* hanging off it (the nodes that lead only to parameters). A full backward runs
both; zero-bubble splits it:

* **B** runs the activation path only (``autograd.grad`` w.r.t. the input). On the way it records
  the gradient arriving at every *junction*: a path node with a weight branch (a matmul whose
  other operand is a weight, a norm's ``x * weight``).
* **W** starts from the junctions, not from the output: each junction is re-entered with its
  recorded gradient by one backward to the parameters its weight branches reach, so the engine
  runs the junction for its weight outputs only (the dW matmul, nothing of the activation path)
  and the branch down to ``.grad``: one engine call per junction. A parameter reached from
  several junctions (tied) takes two steps instead (see ``backward_weight``). Each junction's
  recorded gradient (and an untied one's saved tensors) is freed as soon as its W ran, so the
  next dW reuses the memory.

So B + W together run each node's work once, the same as one full backward, and the gradients are
exactly the full backward's: every path from the output to a parameter leaves the activation path
at exactly one junction, whose recorded gradient is the sum over all paths above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


@dataclass
class _Junction:
    node: Node
    weight_edges: list[GradientEdge]  # edges into weight branches
    params: list[torch.Tensor]  # the parameters those branches reach
    grads: tuple[torch.Tensor | None, ...] = ()  # the gradient arriving at the node, from B
    shared: bool = False  # a parameter here is also reached through another junction (tied)


@dataclass
class PendingWeightGrad:
    """What a split B leaves for its W: the junctions and their recorded gradients."""

    junctions: list[_Junction] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)


def _post_order(root: Node) -> tuple[list[Node], dict[Node, list[tuple[Node, int]]]]:
    """Every node under ``root``, children before parents, and each node's (child, input nr)."""
    children: dict[Node, list[tuple[Node, int]]] = {}
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in children:
            continue
        children[node] = kids = [(c, nr) for c, nr in node.next_functions if c is not None]
        stack.append((node, True))
        stack.extend((c, False) for c, _ in kids if c not in children)
    return order, children


def _junctions(root: Node, input_: torch.Tensor, params: list[torch.Tensor]) -> list[_Junction]:
    """Which nodes reach the input (the activation path) and which parameters the others reach."""
    by_id = {id(p): p for p in params}
    order, children = _post_order(root)
    on_path: set[Node] = set()
    reached: dict[Node, frozenset[int]] = {}  # off-path nodes: ids of the parameters under them
    junctions, uses = [], {}
    for node in order:
        kids = children[node]
        if not kids:  # a leaf's AccumulateGrad (or a node with no inputs)
            leaf = getattr(node, "variable", None)
            if leaf is input_:
                on_path.add(node)
            else:
                reached[node] = frozenset((id(leaf),)) if id(leaf) in by_id else frozenset()
            continue
        edges = [(c, nr) for c, nr in kids if c not in on_path]
        if len(edges) == len(kids):  # off the path
            reached[node] = frozenset().union(*[reached[c] for c, _ in kids])
            continue
        on_path.add(node)
        edges = [(c, nr) for c, nr in edges if reached[c]]
        if edges:  # a junction
            ids = frozenset().union(*[reached[c] for c, _ in edges])
            for i in ids:
                uses[i] = uses.get(i, 0) + 1
            junctions.append(_Junction(node, [GradientEdge(c, nr) for c, nr in edges], [by_id[i] for i in ids]))
    for j in junctions:
        j.shared = any(uses[id(p)] > 1 for p in j.params)
    return junctions


def backward_input(output: torch.Tensor, input_: torch.Tensor, params: list[torch.Tensor]) -> tuple[torch.Tensor, PendingWeightGrad]:
    """The input gradient of the scalar ``output`` (B), and what W needs for the weight grads."""
    pending = PendingWeightGrad(_junctions(output.grad_fn, input_, params), params)
    handles = []
    for j in pending.junctions:
        def record(grad_outputs, j=j):
            j.grads = tuple(grad_outputs)
        handles.append(j.node.register_prehook(record))
    try:
        (grad_in,) = torch.autograd.grad(output, [input_], retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return grad_in, pending


def backward_weight(pending: PendingWeightGrad) -> None:
    """Accumulate the weight grads into ``.grad`` (W), from the junctions B recorded.

    A junction whose parameters no other junction reaches is one backward from the junction to
    those parameters: the engine runs the junction for its weight outputs only (its activation
    output leads to none of them) and the weight branch down to ``.grad``. Where a parameter is
    shared between junctions (tied weights), its junctions first yield their weight-edge grads,
    then one backward from all those edges adds each contribution once."""
    roots, root_grads = [], []
    for j in pending.junctions:
        outputs = [(GradientEdge(j.node, i), g) for i, g in enumerate(j.grads) if g is not None]
        if not outputs:
            continue
        edges, grads = [e for e, _ in outputs], [g for _, g in outputs]
        j.grads = outputs = ()  # freed once used: the next junction's dW can reuse the memory
        if not j.shared:
            torch.autograd.backward(edges, grads, inputs=j.params)
            continue
        # Only the weight-branch edges are asked for, so the junction computes just those
        # (the dW matmul) and nothing flows down the activation path again.
        edge_grads = torch.autograd.grad(edges, j.weight_edges, grads, retain_graph=True, allow_unused=True)
        for edge, g in zip(j.weight_edges, edge_grads):
            if g is not None:
                roots.append(edge)
                root_grads.append(g)
    # Weight branches never reach the activation path, so one backward from all their edges
    # adds each parameter's contributions once.
    if roots:
        torch.autograd.backward(roots, root_grads, inputs=pending.params)
    pending.junctions.clear()
