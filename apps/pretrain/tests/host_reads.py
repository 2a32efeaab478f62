"""A rank entry that counts host reads of tensor values in pretrain's own ``run_rank``: every call of
``Tensor.item / tolist / __float__ / __int__ / __bool__`` (on a GPU each one waits for the stream to
drain), per step. Patched in the rank processes only (as fault_ranks.py)."""

import contextlib
import functools
import threading

import torch

READS = ("item", "tolist", "__float__", "__int__", "__bool__")


@contextlib.contextmanager
def host_reads_counted():
    """``with host_reads_counted() as count:`` ``count[0]`` = the host reads of tensor values this thread
    makes inside: another thread's (an async checkpoint's publisher reading the CPU tensors of its gloo
    collectives) do not hold up this one's kernel launches."""
    count, originals = [0], {name: getattr(torch.Tensor, name) for name in READS}
    counting = threading.get_ident()
    for name, original in originals.items():

        @functools.wraps(original)
        def counted(self, *a, _original=original, **kw):
            count[0] += threading.get_ident() == counting
            return _original(self, *a, **kw)

        setattr(torch.Tensor, name, counted)
    try:
        yield count
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def counting_host_reads(out_file: str, *run_args) -> dict:
    """``run_rank(*run_args)``; writes ``[reads between the starts of step s and s + 1, ...]`` of this
    rank to ``out_file.<rank>`` (the last entry: the last step through the end of the run)."""
    import json


    from pretrain.training.run import run_rank
    from pretrain.training.train_loop import Trainer

    per_step, train_step = [], Trainer.train_step
    with host_reads_counted() as count:

        def marking(self, step):
            per_step.append(count[0])
            return train_step(self, step)

        Trainer.train_step = marking
        result = run_rank(*run_args)
        per_step.append(count[0])
    with open(f"{out_file}.{result['rank']}", "w") as f:
        json.dump([b - a for a, b in zip(per_step, per_step[1:])], f)
    return result
