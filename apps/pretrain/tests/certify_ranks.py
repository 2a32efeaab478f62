"""Rank entries for the certify tests: the layout's ranks with a planted bug, patched in the rank
processes only (the one-rank reference runs unpatched) and undone after: the harness reuses its workers."""

from __future__ import annotations

import contextlib


def _patches(bug: str):
    """(object, attribute, replacement) for each planted bug, one per parallel dimension."""
    if bug == "tp_norm_partial_grads_not_summed":  # one TP-copied norm's partial grads left unsummed
        import par_zero.grad_buffer as gb

        original = gb.sum_partial_grads_

        def skip_first_norm(items):
            items = list(items)
            norms = [i for i, (g, pl) in enumerate(items) if len(pl.shape) == 1 and pl.needs_grad_sum()]
            return original([it for i, it in enumerate(items) if not norms or i != norms[0]])
        return [(gb, "sum_partial_grads_", skip_first_norm)]
    if bug == "vocab_padding_not_masked":  # the padded vocabulary logits left as the head computes them
        from pretrain.model.parallel import ModelChunk

        return [(ModelChunk, "project", lambda self, x: self.lm_head(x))]
    if bug == "ep_permutation_off_by_one":  # each local expert gets its neighbour's rows
        from par_moe.experts import GroupedSwiGLU

        forward = GroupedSwiGLU.forward
        return [(GroupedSwiGLU, "forward", lambda self, tokens, counts, *a: forward(self, tokens, counts.roll(1, 0), *a))]
    if bug == "mtp_target_shifted":  # MTP predicts one token too far
        import torch.nn.functional as F

        import pretrain.train_loop as tl
        from pretrain.data.packing import IGNORE

        def shifted(labels, depth):
            out = []
            for k in range(1, depth + 1):
                out += [F.pad(labels[..., k - 1:], (0, k - 1), value=0), F.pad(labels[..., k + 1:], (0, k + 1), value=IGNORE)]
            return out
        return [(tl, "mtp_streams", shifted)]
    raise ValueError(bug)


@contextlib.contextmanager
def planted(bug: str | None):
    patches = _patches(bug) if bug else []
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


def layout_with_bug(bug, config, overrides, steps, work, margin):
    from pretrain.certify.ranks import run_layout

    with planted(bug):
        return run_layout(config, overrides, steps, work, margin)
