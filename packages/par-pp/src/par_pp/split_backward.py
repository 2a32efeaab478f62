"""Zero-bubble's split backward without walking the graph twice.

A chunk's autograd graph has an *activation path* (the nodes that lead back to the chunk's input)
and *weight branches* hanging off it (the nodes that lead only to parameters). A full backward runs
both; zero-bubble splits it:

* **B** runs the activation path only (``autograd.grad`` w.r.t. the input). On the way it records
  the gradient arriving at every *junction*: a path node with a weight branch (a matmul whose
  other operand is a weight, a norm's ``x * weight``).
* **W** starts from the junctions, not from the output: each junction is re-entered with its
  recorded gradient and asked only for its weight-branch edges (the dW matmul and nothing of the
  activation path), then one backward from those edges accumulates into the parameters.

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
    grads: tuple[torch.Tensor | None, ...] = ()  # the gradient arriving at the node, from B


@dataclass
class PendingWeightGrad:
    """What a split B leaves for its W: the junctions and their recorded gradients."""

    junctions: list[_Junction] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)


def _leaf_variable(node: Node):
    return getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf


def _junctions(root: Node, input_: torch.Tensor, params: list[torch.Tensor]) -> list[_Junction]:
    """Post-order walk from ``root``: which nodes reach the input, which reach a parameter."""
    param_ids = {id(p) for p in params}
    reaches_input: dict[Node, bool] = {}
    reaches_param: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if node in reaches_input and not children_done:
            continue
        children = [child for child, _ in node.next_functions if child is not None]
        if not children_done:
            reaches_input[node] = False  # mark as visiting (graphs are acyclic)
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in reaches_input)
            continue
        leaf = _leaf_variable(node)
        reaches_input[node] = leaf is input_ or any(reaches_input[c] for c in children)
        reaches_param[node] = (leaf is not None and id(leaf) in param_ids) or any(reaches_param[c] for c in children)
    junctions = []
    for node, on_path in reaches_input.items():
        if not on_path:
            continue
        edges = [GradientEdge(child, nr) for child, nr in node.next_functions
                 if child is not None and not reaches_input[child] and reaches_param[child]]
        if edges:
            junctions.append(_Junction(node, edges))
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
    """Accumulate the weight grads into ``.grad`` (W), from the junctions B recorded."""
    roots, root_grads = [], []
    for j in pending.junctions:
        outputs = [(GradientEdge(j.node, i), g) for i, g in enumerate(j.grads) if g is not None]
        if not outputs:
            continue
        # Only the weight-branch edges are asked for, so the junction computes just those
        # (the dW matmul) and nothing flows down the activation path again.
        edge_grads = torch.autograd.grad([e for e, _ in outputs], j.weight_edges, [g for _, g in outputs],
                                         retain_graph=True, allow_unused=True)
        for edge, g in zip(j.weight_edges, edge_grads):
            if g is not None:
                roots.append(edge)
                root_grads.append(g)
    # Weight branches never reach the activation path, so one backward from all their edges
    # adds each parameter's contributions once.
    if roots:
        torch.autograd.backward(roots, root_grads, inputs=pending.params)
    pending.junctions.clear()
