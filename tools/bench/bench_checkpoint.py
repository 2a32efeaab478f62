"""How long a checkpoint save blocks the training thread (sync and async) and how long a load takes,
on one CPU rank (a one-rank gloo group, as `pretrain train` makes) and a checkpoint of about 0.5 GB.

    uv run python tools/bench/bench_checkpoint.py [--repeats 5] [--hidden 1024 --layers 2 --ffn 2816
        --vocab 8192] [--dir /tmp] [--paired-legacy]

The model (fp32, untied) is sized so that its weights and AdamW's two moments (what a checkpoint
holds) come to ~0.5 GB at the default shape; one training step fills the moments. Per repeat:

- ``sync``: ``Trainer.save_checkpoint`` (what ``[checkpoint].async_save = false`` runs), all of it
  blocks the training thread;
- ``async``: ``CheckpointSaver(background=True).save`` (the training thread's part: staging the
  owned state, starting DCP's writer thread), then ``finish`` timed apart (``finish_s``: the wait
  for the writer, done at the next save or the end of the run);
- ``load``: ``Trainer.load_checkpoint`` of the last save (files verified against ``checksums.json``).

Each save goes to a fresh directory with ``keep = 1``, so every save after the first also prunes
the one before (the pruning is part of what the training thread may wait for); the ``--warmup``
first repeats are not counted. Prints the commit,
the checkpoint's size, then ``RESULT checkpoint <what>_s=median [min, max] repeats=N`` lines.
The page cache is warm (the files were just written): the load figure is the read from memory plus
hashing and deserialising, not a cold disk's.

``--paired-legacy``: each repeat also runs the code paths as they were before checkpoint integrity
moved off the critical path (commit 156cd2b), in alternating order within the same process, so a
busy machine's drift hits both alike: the data files re-read and hashed after DCP's plain
FileSystemWriter wrote them; a load hashing each file, then DCP reading it again; fresh CPU copies
for every async save; the pruning inline. It prints the same lines for ``legacy`` and, per
measure, ``RESULT checkpoint-paired <what> ratio=`` new / legacy (median [min, max] of the
per-repeat ratios, below 1: faster now) with the median's 95 % confidence interval.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from commit import print_commit  # noqa: E402
from paired_timing import median_ci  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spread(name: str, xs: list[float]) -> str:
    return f"{name}={statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"


@contextlib.contextmanager
def legacy():
    """The checkpoint code paths of commit 156cd2b, patched over today's (see the module docstring)."""
    from unittest import mock

    from torch.distributed.checkpoint import FileSystemWriter

    from pretrain.checkpoint import background, checked_reader, integrity, retention, store
    from pretrain.checkpoint.safe_metadata import SafeReader

    class PlainWriter(FileSystemWriter):  # DCP's writer: nothing hashed while writing
        written: dict = {}

    def reread(writer, tmp):  # every file this rank wrote, read back and hashed after the write
        rank = store._rank()
        names = sorted(p.name for p in tmp.glob(f"__{rank}_*.distcp")) + [f"rng/rank_{rank}.pt"]
        return integrity.digests(tmp, names)

    def read_twice(self, plan, planner):  # hash every file the plan reads, then DCP reads it again
        storage = {item.storage_index: self.storage_data[item.storage_index] for item in plan.items}
        integrity.verify_files(self.root, {i.relative_path for i in storage.values()} | set(self.also), self.checksums)
        return SafeReader.read_data(self, plan, planner)

    def fresh_copies(self, sd):  # new unpinned CPU tensors at every save
        return {k: v.to_cpu_copy() for k, v in sd.items()}, None

    with contextlib.ExitStack() as stack:
        for module in (store, background):
            stack.enter_context(mock.patch.object(module, "HashingWriter", PlainWriter))
            stack.enter_context(mock.patch.object(module, "rank_entries", reread))
            stack.enter_context(mock.patch.object(module, "prune_in_background", retention.prune))  # inline
        stack.enter_context(mock.patch.object(checked_reader.CheckedReader, "read_data", read_twice))
        stack.enter_context(mock.patch.object(background.Staging, "stage", fresh_copies))
        yield


def one_repeat(trainer, saver, work: Path, r: int) -> dict:
    """One sync save, one async save (blocked, then finish) and one load of the sync save: seconds each."""
    out = {}
    t = time.perf_counter()
    path = trainer.save_checkpoint(work / "sync", r + 1, keep=1)
    out["sync_blocked_s"] = time.perf_counter() - t
    t = time.perf_counter()
    saver.save(trainer.checkpointed(), work / "async", r + 1, keep=1)
    out["async_blocked_s"] = time.perf_counter() - t
    t = time.perf_counter()
    saver.finish()
    out["async_finish_s"] = time.perf_counter() - t
    t = time.perf_counter()
    trainer.load_checkpoint(path)
    out["load_s"] = time.perf_counter() - t
    out["size"] = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="first repeats not counted (fresh files, first touches)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (a temporary directory under it)")
    ap.add_argument("--paired-legacy", action="store_true", help="also the code paths before, interleaved")
    args = ap.parse_args()
    print_commit()

    import torch.distributed as dist

    from pretrain.checkpoint import CheckpointSaver
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    cfg = load_config(None, [f"model.hidden={args.hidden}", f"model.layers={args.layers}", "model.heads=16",
                             "model.kv_heads=16", f"model.ffn_hidden={args.ffn}", f"model.vocab_size={args.vocab}",
                             "model.tie_embeddings=false", "train.seq_len=32", "train.global_batch=2",
                             "train.micro_batch=2", "train.steps=10", "train.warmup_steps=1", "train.eval_every=0",
                             "train.dtype=fp32", "log.progress=false"])
    trainer = Trainer(cfg)
    trainer.train_step(0)
    work = Path(tempfile.mkdtemp(prefix="bench_ck_", dir=args.dir))
    saver = CheckpointSaver(True)
    modes = ["new", "legacy"] if args.paired_legacy else ["new"]
    got: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        for r in range(args.warmup + args.repeats):
            for mode in modes if r % 2 == 0 else modes[::-1]:  # alternate which runs first
                with legacy() if mode == "legacy" else contextlib.nullcontext():
                    x = one_repeat(trainer, saver, work / mode, r)
                if r >= args.warmup:
                    got[mode].append(x)
                print(f"repeat {r} {mode}: sync {x['sync_blocked_s']:.3f} s, async blocked {x['async_blocked_s']:.3f} s "
                      f"(+ finish {x['async_finish_s']:.3f} s), load {x['load_s']:.3f} s", flush=True)
        size = got["new"][-1]["size"]
        print(f"checkpoint: {size / 1e6:.0f} MB on one rank; load average (1, 5 min) now {os.getloadavg()[0]:.1f} "
              f"{os.getloadavg()[1]:.1f}")
        n = f"repeats={args.repeats} size_mb={size / 1e6:.0f}"
        for mode in modes:
            tag = "" if mode == "new" else f" {mode}"
            col = lambda k: [x[k] for x in got[mode]]  # noqa: E731
            print(f"RESULT checkpoint{tag} {_spread('sync_blocked_s', col('sync_blocked_s'))} {n}")
            print(f"RESULT checkpoint{tag} {_spread('async_blocked_s', col('async_blocked_s'))} "
                  f"{_spread('async_finish_s', col('async_finish_s'))} {n}")
            print(f"RESULT checkpoint{tag} {_spread('load_s', col('load_s'))} {n}")
        if args.paired_legacy:
            for key in ("sync_blocked_s", "async_blocked_s", "async_finish_s", "load_s"):
                ratios = [a[key] / b[key] for a, b in zip(got["new"], got["legacy"])]
                lo, hi = median_ci(ratios)
                print(f"RESULT checkpoint-paired {key} ratio={statistics.median(ratios):.3f} ratio_min={min(ratios):.3f} "
                      f"ratio_max={max(ratios):.3f} ci95={lo:.3f}-{hi:.3f} repeats={len(ratios)} "
                      f"metric=new_over_legacy_lower_is_better")
    finally:
        saver.close()
        shutil.rmtree(work, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
