"""How a benchmark starts its CPU ranks, and the model-shape options the trainer benchmarks share.

:func:`run_spawned` spawns ``world`` gloo ranks that each run ``measure(rank, world, args)`` (a
module-level function: spawn pickles it by name) and returns rank 0's result. :func:`launch_with_load`
runs ``measure(args)`` on pretrain's launcher and prints the load average around it (a busy machine is
part of the figure).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _spawned(rank, world, init_file, measure, args, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = measure(rank, world, args)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def run_spawned(measure, world: int, args):
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_spawned, args=(world, os.path.join(tmp, "init"), measure, args, queue), nprocs=world,
                           start_method="spawn")
        return queue.get()


def add_model_arguments(p, *, layers: int, heads: int, repeats: int) -> None:
    """The trainer benchmarks' model, batch and timing options (``heads`` for both query and key heads)."""
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--kv-heads", type=int, default=heads)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")


def _ranked(measure, args):
    import torch

    from pretrain.runtime.launch import init_distributed, shutdown

    me, _, _, _ = init_distributed(600, "cpu")
    torch.set_num_threads(args.threads)
    try:
        out = measure(args)
        return out if me == 0 else None
    finally:
        shutdown()


def launch_with_load(measure, args, world: int):
    """Rank 0's ``measure(args)`` on ``world`` CPU ranks (each with ``args.threads`` intra-op threads), the
    load average printed around the run."""
    from pretrain.runtime.launch import launch

    before = os.getloadavg()
    results = launch(_ranked, (measure, args), nproc=world, device="cpu")[0]
    after = os.getloadavg()
    print(f"load average (1, 5 min) before {before[0]:.2f} {before[1]:.2f}, after {after[0]:.2f} {after[1]:.2f}")
    return results
