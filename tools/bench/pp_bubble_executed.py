"""The pipeline executor's measured bubble against the simulator's prediction (par-pp), 4 gloo ranks.

    uv run python tools/bench/pp_bubble_executed.py [--unit 0.08] [--repeats 3]

Each chunk sleeps a known time (F = unit / vpp forward, 2F backward), so the executed timeline's
bubble (1 - busy / makespan, averaged over ranks) can be set beside ``par_pp.simulate``'s for the
same schedule, given the p2p latency measured by ping-pong. A wall-clock figure: other work on the
machine only delays actions (a larger executed bubble), so it lives here, not in the suite (where
``test_every_schedule_matches_single_device_losses_and_grads`` checks the executed order of
actions against the schedule instead). Prints one line per repeat and schedule, then
``RESULT <schedule> executed= simulated= off=`` with the run closest to the simulation.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from commit import print_commit
from par_groups.testing import RankPool
from par_pp import Costs, PipelineExecutor, build_schedule, chunks_on_rank, simulate


class _Sleep(torch.autograd.Function):
    """Identity that sleeps `f` seconds forward and `b` seconds backward: a stage of known cost."""

    @staticmethod
    def forward(ctx, x, f, b):
        import time

        time.sleep(f)
        ctx.b = b
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        import time

        time.sleep(ctx.b)
        return grad, None, None


class SleepyLayer(nn.Module):
    def __init__(self, f, b):
        super().__init__()
        self.linear, self.f, self.b = nn.Linear(4, 4), f, b

    def forward(self, x):
        return _Sleep.apply(self.linear(x), self.f, self.b)


def one_way_latency(rounds=10):
    """Median one-way time of a header + small payload message between ranks 0 and 1 (ping-pong)."""
    import statistics
    import time

    rank, times = dist.get_rank(), []
    msg = [torch.zeros(10, dtype=torch.int64), torch.zeros(2, 4)]
    for _ in range(rounds):
        dist.barrier()
        t = time.perf_counter()
        for turn in (0, 1):
            if rank in (0, 1):
                op = dist.isend if rank == turn else dist.irecv
                for w in dist.batch_isend_irecv([dist.P2POp(op, x, 1 - rank) for x in msg]):
                    w.wait()
        times.append((time.perf_counter() - t) / 2)
    latency = torch.tensor([statistics.median(times) if rank == 0 else 0.0])
    dist.broadcast(latency, 0)
    return latency.item()


def run_timed(cases, unit):
    """Run each (schedule, vpp, m) with chunks sleeping F = unit/v, full B = 2 unit/v; gather
    timings, and the measured p2p latency the simulator is given."""
    rank = dist.get_rank()
    out = {"latency": one_way_latency()}
    for name, vpp, m in cases:
        schedule = build_schedule(name, dist.get_world_size(), m, vpp)
        f = unit / schedule.vpp
        chunks = {c: SleepyLayer(f, 2 * f) for c in chunks_on_rank(schedule, rank)}
        inputs = [torch.randn(2, 4, requires_grad=False) for _ in range(m)]
        executor = PipelineExecutor(schedule, chunks, None, loss_fn=lambda y, t: (y - t).pow(2).mean())
        executor.step(inputs, [torch.zeros(2, 4)] * m)  # warm-up: first-call costs are not the schedule's
        dist.barrier()
        executor.step(inputs, [torch.zeros(2, 4)] * m)
        records = [(r.start, r.end) for r in executor.records]
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records)
        out[(name, m)] = gathered
    return out


def bubbles(timings, cases, unit):
    """{schedule: (executed bubble, simulated bubble)} of one timed run."""
    out = {}
    for name, vpp, m in cases:
        ranks = timings[(name, m)]
        begin = min(s for row in ranks for s, _ in row)
        makespan = max(e for row in ranks for _, e in row) - begin
        executed = sum(1 - sum(e - s for s, e in row) / makespan for row in ranks) / len(ranks)
        costs = Costs(f=1 / vpp, full_backward=2 / vpp, p2p=timings["latency"] / unit)  # slots of `unit` seconds
        out[name] = executed, simulate(build_schedule(name, 4, m, vpp), costs).bubble_fraction
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--unit", type=float, default=0.08, help="seconds of one forward of a whole stage")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print_commit()
    cases = [("1f1b", 1, 4), ("interleaved", 2, 4)]
    pool = RankPool(4)
    seen = {name: [] for name, _, _ in cases}
    try:
        for repeat in range(args.repeats):
            for name, (executed, simulated) in bubbles(pool.run(run_timed, cases, args.unit, timeout=300)[0],
                                                       cases, args.unit).items():
                seen[name].append((abs(executed - simulated) / simulated, executed, simulated))
                print(f"repeat {repeat} {name}: executed bubble {executed:.3f}, simulated {simulated:.3f}")
    finally:
        pool.close()
    for name, runs in seen.items():
        off, executed, simulated = min(runs)
        print(f"RESULT {name} executed={executed:.3f} simulated={simulated:.3f} off={off:.1%}")


if __name__ == "__main__":
    main()
