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

        import pretrain.training.train_loop as tl
        from pretrain.data.packing import IGNORE

        def shifted(labels, depth):
            out = []
            for k in range(1, depth + 1):
                out += [F.pad(labels[..., k - 1:], (0, k - 1), value=0), F.pad(labels[..., k + 1:], (0, k + 1), value=IGNORE)]
            return out
        return [(tl, "mtp_streams", shifted)]
    if bug == "sp_reduce_scatter_missing":  # one layer's row-parallel exit keeps its own rows of its partial sum
        from par_tp.layers import RowParallelLinear

        forward, first = RowParallelLinear.forward, []

        def no_reduce_scatter(self, x):
            if not first:
                first.append(self)  # the first sequence-parallel row layer to run: layer 0's attention
            if self is not first[0] or not self.sequence_parallel:
                return forward(self, x)
            y = self.linear_kernel(x, self.weight)
            s = y.shape[0] // self.tp_size
            y = y[self.tp_rank * s:(self.tp_rank + 1) * s]  # the rows it would own, never summed over tp
            return y + self.bias if self.bias is not None else y
        return [(RowParallelLinear, "forward", no_reduce_scatter)]
    if bug == "pp_stale_activation":  # stage 0 sends chunk 1 the previous micro-batch's activation again
        from par_pp.p2p import StageComm

        send, sent = StageComm.send, {}

        def stale(self, message, tensor):
            if message.kind == "act" and message.chunk == 1:
                sent[message.microbatch] = tensor.detach().clone()
                tensor = sent.get(message.microbatch - 1, tensor)
            return send(self, message, tensor)
        return [(StageComm, "send", stale)]
    if bug == "cp_causal_offset_wrong":  # global chunk 1 (cp rank 1's first zigzag chunk) masked one chunk late
        import par_cp.segments as seg
        from par_cp.kernels import BlockMask

        iter_blocks = seg.iter_blocks

        def shifted(q_segs, k_segs, causal, docs):
            n = q_segs[0][1] - q_segs[0][0]
            q_off = 0
            for qa, qb in q_segs:
                late = n if (qa, qb) == (n, 2 * n) else 0  # the causal offset of this chunk is off by one chunk
                k_off = 0
                for ka, kb in k_segs:
                    mask = BlockMask(qa + late, qb + late, ka, kb, causal, docs).clipped()
                    if not mask.is_empty():
                        k_lo = k_off + mask.k_start - ka
                        yield slice(q_off, q_off + qb - qa), slice(k_lo, k_lo + mask.k_len), mask
                    k_off += kb - ka
                q_off += qb - qa
        return [(seg, "iter_blocks", shifted)]
    if bug == "zero2_shard_reduced_twice":  # dp rank 0's shard of the first bucket to finish gets its reduction twice
        import torch.distributed as dist
        from par_zero.bucket import Bucket

        finish, first = Bucket._finish, []

        def twice(self):
            if self.cfg.shard_grads and self._opt_grad is None and dist.get_rank(self.groups.inner) == 0:
                if not first:
                    first.append(self)
                if self is first[0]:
                    self._reduce_out = self._reduce_out * 2  # the reduction's output added a second time
            return finish(self)
        return [(Bucket, "_finish", twice)]
    if bug == "router_picks_next_expert":  # the last MoE layer sends every token to its choices' neighbours
        import par_moe.router as router

        forward, last = router.Router.forward, []

        def next_expert(self, x, *replayed):
            routing = forward(self, x, *replayed)
            if getattr(self, "_certify_last", False):
                routing.indices = (routing.indices + 1) % self.config.num_experts
            return routing

        original_init = router.Router.__init__

        def init(self, config):
            original_init(self, config)
            last.append(self)
            for r in last:
                r._certify_last = r is last[-1]
        return [(router.Router, "forward", next_expert), (router.Router, "__init__", init)]
    if bug == "embedding_shard_edge":  # the last id of each TP vocabulary shard looks up twice its row
        import torch.nn.functional as F

        import par_tp.embedding as emb

        def edge_doubled(self, ids):
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
            partial = partial * (1 + (ids == self.vocab_end - 1).unsqueeze(-1).to(partial.dtype))
            return emb.exit_tensor_parallel_region(partial, self.tp_group, self.sequence_parallel)
        return [(emb.VocabParallelEmbedding, "forward", edge_doubled)]
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


def layout_with_bug(bug, config, overrides, steps, work, margin, ids):
    from pretrain.certify.ranks import run_layout

    with planted(bug):
        return run_layout(config, overrides, steps, work, margin, ids)
