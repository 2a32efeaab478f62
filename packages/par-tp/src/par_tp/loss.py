"""Cross-entropy over vocab-sharded logits, never materializing the full vocabulary on a rank.

Each rank holds ``logits[..., V/tp]`` for vocabulary range ``[r*V/tp, (r+1)*V/tp)``. Forward:
the max is all-reduced (MAX), then one all-reduce (SUM) of three per-token numbers: the target
logit, the sum of exponentials and, for label smoothing, the sum of logits. Backward is local:
``softmax - (1-eps) onehot - eps/V`` on this rank's slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from par_groups import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing, ignore_index):
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        local_vocab = logits.shape[-1]
        vocab = local_vocab * tp
        start = rank * local_vocab

        in_dtype = logits.dtype
        # One fp32 buffer for the whole forward (Megatron's in-place shift, exp and divide): the
        # logits are the largest activation of a step, [S, B, V/tp].
        shifted = logits.to(torch.float32, copy=True)
        max_logit = shifted.amax(dim=-1)
        if tp > 1:
            comm.all_reduce(max_logit, group=group, op=ReduceOp.MAX)
        shifted.sub_(max_logit.unsqueeze(-1))

        valid = target != ignore_index
        local_target = target - start
        here = valid & (local_target >= 0) & (local_target < local_vocab)
        local_target = local_target.masked_fill(~here, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)

        sum_shifted = shifted.sum(-1) if label_smoothing > 0 else torch.zeros_like(target_logit)
        exp = shifted.exp_()
        sums = torch.stack([target_logit, exp.sum(-1), sum_shifted])
        if tp > 1:
            comm.all_reduce(sums, group=group)
        target_logit, sum_exp, sum_logits = sums.unbind(0)

        log_z = sum_exp.log()
        loss = log_z - target_logit
        if label_smoothing > 0:
            # -sum_j (eps/V) log p_j = eps * (log Z - mean_j shifted_j)
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - sum_logits / vocab)
        loss = loss.masked_fill(~valid, 0.0)

        exp.div_(sum_exp.unsqueeze(-1))  # softmax of this rank's slice, reused by backward
        ctx.save_for_backward(exp, local_target, here, valid)
        ctx.label_smoothing, ctx.vocab, ctx.in_dtype = label_smoothing, vocab, in_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, here, valid = ctx.saved_tensors
        eps = ctx.label_smoothing
        # A copy, not the saved buffer: zero-bubble pipelines walk this graph twice (input grads,
        # then weight grads with retain_graph), so the saved softmax must survive the first pass.
        # The copy is made in the logits' dtype: for bf16 logits that halves the largest temporary.
        grad = softmax.to(ctx.in_dtype, copy=True)
        # scatter_add with zeros where the target lives on another rank
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(1.0 - eps) * here.to(grad.dtype).unsqueeze(-1))
        if eps > 0:
            grad.sub_(eps / ctx.vocab)
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    tp_group: ProcessGroup,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of vocab-sharded logits ``[..., V/tp]`` against ``target [...]`` (global ids).

    Matches ``F.cross_entropy(full_logits.flatten(0,-2), target.flatten(), label_smoothing=...,
    ignore_index=..., reduction=...)``: ``"mean"`` divides by the number of non-ignored targets,
    ``"sum"`` sums, ``"none"`` returns per-token losses shaped like ``target`` (0 where ignored).
    The loss is computed in fp32 and is identical on every TP rank.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}; use 'mean', 'sum' or 'none'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing}; use a value in [0, 1]")
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(f"logits_shard {tuple(logits_shard.shape)} and target {tuple(target.shape)} "
                         f"must agree on every dimension but the last (vocabulary)")
    losses = _VocabParallelCrossEntropy.apply(logits_shard, target, tp_group, float(label_smoothing), int(ignore_index))
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum()
