"""Seconds to place a 3-source blend far into the stream: the samples of one step at
``--step`` x ``--global-batch`` (a resume at step 100,000 with a global batch of 1024 by default).

    uv run python tools/bench/bench_blend_place.py [--step 100000] [--global-batch 1024] [--weights 0.3 0.5 0.2]
        [--repeats 7] [--walk-samples 1000000] [--peer]

* ``ours``: ``BlendSchedule(weights).take(n, n + global_batch)`` on a fresh schedule (what a resumed rank
  does): a numpy search for a forced anchor a few samples back, then the step's samples.
* ``walk``: the placement before (walking every sample from 0 in Python, ``BlendSchedule._advance``),
  timed over ``--walk-samples`` and scaled to ``n`` (it is linear in the samples walked).
* ``--peer``: megatron-core's ``build_blending_indices`` over all ``n + global_batch`` samples (C++,
  the indices Megatron builds once per run), if installed.

The choices are checked equal to the walk's over the step (and to the peer's with ``--peer``).
Anchors thin out with the number of sources (see ``BlendSchedule``): with 16 or more sources of
generic weights there are none and ``ours`` walks like before.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from pretrain.data.blend import BlendSchedule, normalised


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", type=int, default=100_000)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--weights", type=float, nargs="+", default=[0.3, 0.5, 0.2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--walk-samples", type=int, default=1_000_000)
    ap.add_argument("--peer", action="store_true")
    args = ap.parse_args()
    n, g = args.step * args.global_batch, args.global_batch

    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        source, index = BlendSchedule(args.weights).take(n, n + g)
        times.append(time.perf_counter() - t0)
    ours = statistics.median(times)

    walker = BlendSchedule(args.weights)
    t0 = time.perf_counter()
    walker._advance(args.walk_samples)  # the old placement: every sample from 0, in Python
    per_sample = (time.perf_counter() - t0) / args.walk_samples
    walk = per_sample * (n + g)

    near = BlendSchedule(args.weights)
    near.counts_at(args.walk_samples)  # the walk's choices, checked where it can reach
    assert all(np.array_equal(a, b) for a, b in zip(near.take(args.walk_samples, args.walk_samples + g),
                                                    _walked(args.weights, args.walk_samples, g)))
    print(f"placing step {args.step} x {g} (samples {n} .. {n + g - 1}), weights {args.weights}")
    print(f"ours  {ours:.6f} s  (median of {args.repeats}; min {min(times):.6f}, max {max(times):.6f})")
    print(f"walk  {walk:.1f} s  (from 0 in Python: {per_sample * 1e6:.2f} us a sample x {n + g} samples, "
          f"timed over {args.walk_samples})")
    print(f"walk / ours = {walk / ours:.0f}x")
    if args.peer:
        from megatron.core.datasets import helpers_cpp

        w = np.asarray(normalised(args.weights))
        peer_source, peer_index = np.zeros(n + g, dtype=np.int16), np.zeros(n + g, dtype=np.int64)
        t0 = time.perf_counter()
        helpers_cpp.build_blending_indices(peer_source, peer_index, w, len(w), n + g, False)
        peer = time.perf_counter() - t0
        assert np.array_equal(source, peer_source[n:]) and np.array_equal(index, peer_index[n:])
        print(f"peer  {peer:.2f} s  (megatron-core build_blending_indices over {n + g} samples; equal choices)")


def _walked(weights, start: int, count: int):
    s = BlendSchedule(weights)
    s._advance(start)  # walk, no anchor
    record: list = []
    s._advance(start + count, record)
    out = np.asarray(record, dtype=np.int64)
    return out[:, 0], out[:, 1]


if __name__ == "__main__":
    main()
