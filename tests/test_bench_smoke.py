"""The benchmark that drives pretrain's Trainer through its public step result runs at a tiny size, so
an app refactor cannot break it unnoticed (bench_dynamic_cp once read a Trainer attribute that a
redesign removed, and failed only when run_all ran it); bench_gdn_cp too (opt-in), which builds the app's GDN layer."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench"


def _bench(name: str):
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))  # the benches import their helpers (commit, paired_timing) by name
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def dynamic_cp_job(*args):
    """bench_dynamic_cp.job on a rank (whose worker process may predate any sys.path change here)."""
    return _bench("bench_dynamic_cp").job(*args)


def test_bench_dynamic_cp_runs_a_step_of_both_trainers(dist_run, tmp_path):
    seq = 256
    path = _bench("bench_dynamic_cp").write_data(tmp_path / "skewed", seq)
    rows = dist_run(4, dynamic_cp_job, path, seq, 1, 1, timeout=300)[0]
    assert len(rows) == 1 and rows[0]["static"] > 0 and rows[0]["dynamic"] > 0
    assert rows[0]["imbalance"] >= 1.0 and rows[0]["static_imbalance"] >= 1.0  # max / mean over the ranks


def gdn_cp_job(args):
    """bench_gdn_cp._measure on a rank (its summaries as ratios: this process cannot import paired_timing)."""
    import torch.distributed as dist

    r = _bench("bench_gdn_cp")._measure(dist.get_rank(), dist.get_world_size(), args)
    return {k: getattr(v, "ratio", v) for k, v in r.items()}


@pytest.mark.extended
def test_bench_gdn_cp_measures_both_peers(dist_run):
    from types import SimpleNamespace

    args = SimpleNamespace(seq=128, batch=1, hidden=64, key_heads=2, value_heads=4, head_dim=8, repeats=1, warmup=0,
                           threads=1)
    r = dist_run(2, gdn_cp_job, args, timeout=300)[0]
    assert r["err"] <= 1e-5 and r["bytes"] == 2 * (4 * 8 * 8 * 4 + 3 * (2 * 2 * 8 + 4 * 8) * 4)
    assert r["one"] > 0 and r["allgather"] > 0 and r["allgather_bytes"] > r["bytes"]
