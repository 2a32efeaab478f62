"""The benchmark that drives pretrain's Trainer through its public step result runs at a tiny size, so
an app refactor cannot break it unnoticed (bench_dynamic_cp once read a Trainer attribute that a
redesign removed, and failed only when run_all ran it)."""

import importlib.util
import sys
from pathlib import Path

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
