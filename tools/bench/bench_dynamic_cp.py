"""Dynamic CP against static CP (p2p ring) on a skewed mix of document lengths, 4 CPU ranks.

    uv run python tools/bench/bench_dynamic_cp.py [--seq 8192 --repeats 7 --layers 2]

Data: windows of ``seq`` tokens; one window in four is a single long document (``seq`` tokens),
the others pack lognormal lengths clipped to 64..seq (median ~400), each ending with EOS. Both
trainers (tiny model, fp32, document_mask + reset_position_ids + eod_mask_loss) train the same
batches, interleaved in the same processes: static CP over cp=4 with one sequence per micro-batch
(``seq / 4`` tokens per rank), dynamic CP with ``max_seq_per_rank = seq / 4`` (the same memory per
rank). The first step warms up and is dropped; the median over ``repeats`` steps of the time ratio
(dynamic / static) is printed with its spread, and the attention-work imbalance of each (largest
rank's causal query-key pairs over the mean, 1.0 = balanced), ending with
``RESULT dynamic-cp ratio= spread= imbalance= static_imbalance=``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from commit import print_commit
import numpy as np

EOS = 255


def write_data(prefix: Path, seq: int, windows: int = 64) -> str:
    from pretrain.data import write_dataset

    rng = np.random.default_rng(0)
    docs = []
    for w in range(windows):
        if w % 4 == 0:
            docs.append(rng.integers(0, EOS, size=seq - 1).tolist())  # with its EOS: the whole window
            continue
        left = seq
        while left > 0:
            n = int(min(max(rng.lognormal(6.0, 1.0), 64), seq, left))
            docs.append(rng.integers(0, EOS, size=max(n - 1, 1)).tolist())
            left -= n
    write_dataset(prefix, docs, vocab_size=256, eos=EOS)
    return str(prefix)


def static_imbalance(batch, cp: int) -> float:
    """Causal query-key pairs per CP rank of the zigzag split, attention inside documents."""
    from par_cp import shard_segments
    from pretrain.data.packing import positions_within_documents

    pairs = (positions_within_documents(batch.input_segments) + 1).sum(0).double()  # [S]: keys each query sees
    seq = pairs.shape[0]
    work = [sum(float(pairs[a:b].sum()) for a, b in shard_segments(seq, r, cp, "zigzag")) for r in range(cp)]
    return max(work) / (sum(work) / cp)


def job(path: str, seq: int, layers: int, repeats: int):
    import torch.distributed as dist

    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    common = [f"data.path={path}", "data.document_mask=true", "data.reset_position_ids=true",
              "data.eod_mask_loss=true", f"train.seq_len={seq}", "train.global_batch=4", f"model.layers={layers}",
              f"train.steps={repeats + 1}", "train.warmup_steps=1", "train.eval_every=0", "log.progress=false",
              "parallel.cp=4"]
    static = Trainer(load_config(None, common + ["train.micro_batch=1"]))
    dynamic = Trainer(load_config(None, common + ["parallel.dynamic_cp=true", f"parallel.max_seq_per_rank={seq // 4}"]))
    rows = []
    for step in range(repeats + 1):
        times, results = {}, {}
        for name, trainer in (("static", static), ("dynamic", dynamic)):
            dist.barrier()
            t = time.perf_counter()
            results[name] = trainer.train_step(step)
            dist.barrier()
            times[name] = time.perf_counter() - t
        batch = static.sampler.global_train_batch(step)
        times["imbalance"] = results["dynamic"].moe["cp_imbalance"]  # the step's log entry
        times["static_imbalance"] = static_imbalance(batch, 4)
        if step:  # the first step warms up
            rows.append(times)
    return rows


def main() -> None:
    from par_groups.testing import RankPool

    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print_commit()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_data(Path(tmp) / "skewed", args.seq)
        pool = RankPool(4)
        try:
            rows = pool.run(job, path, args.seq, args.layers, args.repeats, timeout=3600)[0]
        finally:
            pool.close()
    ratios = [r["dynamic"] / r["static"] for r in rows]
    for name in ("static", "dynamic"):
        print(f"{name:8s} step median {statistics.median(r[name] for r in rows):.3f} s")
    imb = statistics.median(r["imbalance"] for r in rows)
    static_imb = statistics.median(r["static_imbalance"] for r in rows)
    print(f"dynamic / static step time: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}) over {len(rows)} steps; attention-work imbalance (max/mean rank): "
          f"dynamic {imb:.3f}, static {static_imb:.3f}")
    print(f"RESULT dynamic-cp ratio={statistics.median(ratios):.3f} spread={min(ratios):.3f}-{max(ratios):.3f} "
          f"imbalance={imb:.3f} static_imbalance={static_imb:.3f}")


if __name__ == "__main__":
    main()
