"""Zero-bubble's B + W against one full backward of the same stage, one process, CPU.

    uv run python tools/bench/bench_split_backward.py [--hidden 512] [--tokens 512] [--layers 4] [--repeats 9] [--threads 1]

The stage is ``layers`` transformer-style MLP blocks (LayerNorm, Linear 4h, GELU, Linear h,
residual). Per repeat, in turn on the same inputs (the order reversed every other repeat): a full backward (weights and input), par-pp's
split B then W (``par_pp.split_backward``), and the split before it (the W walking the whole
graph again with ``backward(inputs=params)``). The first repeat warms up and is dropped. One
intra-op thread by default: on a small shared machine a second thread's preemption stalls every
parallel kernel, noise that drowned the few-percent difference this bench measures. Prints
the median ratio to the full backward and its min/max over repeats, ending with
``RESULT split-backward ratio= spread= replay_ratio=``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from commit import print_commit
from par_pp.split_backward import backward_input, backward_weight


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    print_commit()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    stage = nn.Sequential(*[Block(args.hidden) for _ in range(args.layers)])
    params = list(stage.parameters())
    x0, dy = torch.randn(args.tokens, args.hidden), torch.randn(args.tokens, args.hidden)

    def forward():
        for p in params:  # every variant writes fresh grads (accumulating would cost an add)
            p.grad = None
        x = x0.clone().requires_grad_(True)
        return x, (stage(x) * dy).sum()

    def full():
        x, out = forward()
        return timed(lambda: torch.autograd.backward(out, inputs=params + [x]))

    def split():
        x, out = forward()
        pending = []
        t_b = timed(lambda: pending.append(backward_input(out, x, params)[1]))
        return t_b + timed(lambda: backward_weight(pending[0]))

    def replay():
        x, out = forward()
        t_b = timed(lambda: torch.autograd.grad(out, [x], retain_graph=True))
        return t_b + timed(lambda: torch.autograd.backward(out, inputs=params))

    rows = []
    for i in range(args.repeats + 1):
        order = [("full", full), ("split", split), ("replay", replay)]
        t = {name: fn() for name, fn in (order if i % 2 else order[::-1])}  # alternate who runs first
        if i:  # the first repeat warms up
            rows.append(t)
    ratios = [r["split"] / r["full"] for r in rows]
    replay = [r["replay"] / r["full"] for r in rows]
    for name in ("full", "split", "replay"):
        print(f"{name:7s} median {1000 * statistics.median(r[name] for r in rows):8.2f} ms")
    print(f"B+W / full backward: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) "
          f"over {len(rows)} repeats; the old W replay: {statistics.median(replay):.3f}")
    print(f"RESULT split-backward ratio={statistics.median(ratios):.3f} spread={min(ratios):.3f}-{max(ratios):.3f} "
          f"replay_ratio={statistics.median(replay):.3f}")


if __name__ == "__main__":
    main()
