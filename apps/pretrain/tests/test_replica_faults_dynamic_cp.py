"""``[train].fault_tolerance = "replica"`` with ``[parallel].dynamic_cp = true``: dynamic CP plans every step's
global batch over all the dp x cp ranks at once (dynamic_cp.py), so after a real SIGKILL the survivors read the
whole global batch and plan it again over their own, fewer dp x cp ranks (more rounds, other blocks), in groups
of the new generation; every step's loss and grad norm are the uninterrupted run's (fp32, 1e-6), every piece of
every sample trained exactly once, and after a rejoin the replicas are bitwise equal.

The data mixes documents of 2 to 16 tokens (EOS included) in windows of 16 at 8 tokens per rank: a window's pieces go on one
rank or ring over two, and each step's plan differs (the sample log names each piece, its span and the ranks
planned over). Planted: survivors that keep the lost generation's dp x cp rank set for the plan (the pieces on
the lost ranks' places trained by no one) are caught by the curve and by the pieces. In the default tier: the
layout is no longer refused, and an uneven share takes no participants' weight on top of the kept-count division.
"""

import functools
import json
import math

import numpy as np
import pytest

from test_replica_faults import _check_fault_run, _curve, _records, _run

EOS = 255
SEQ = 16


def _dataset(prefix) -> str:
    from pretrain.data import write_dataset

    rng = np.random.default_rng(3)
    lengths = rng.choice([1, 2, 3, 5, 9, 12, 15], size=400)  # pieces of 1..8 tokens on one rank, 9..16 over two
    write_dataset(prefix, [rng.integers(0, EOS, size=int(n)).tolist() for n in lengths], vocab_size=256, eos=EOS)
    return str(prefix)


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory):
    """The layout (dp2 x cp2, dynamic CP over this module's documents) and its uninterrupted run's curve."""
    root = tmp_path_factory.mktemp("dynamic_cp")
    layout = ("--set", "parallel.cp=2", "--set", "parallel.dynamic_cp=true", "--set", "parallel.max_seq_per_rank=8",
              "--set", "data.document_mask=true", "--set", f"data.path={_dataset(root / 'docs')}")
    res = _run(root / "reference", 2, layout=layout)
    assert res.exit_code == 0, res.output
    curve = _curve(root / "reference" / "log")
    return layout, lambda dp, tp=1, layout=(): curve


def _plans(log) -> dict[int, list[dict]]:
    """Each step's records of the generation whose gradient it is (the latest that trained it)."""
    records = [json.loads(line) for f in (log / "samples").iterdir() for line in f.read_text().splitlines()]
    latest = {s: max(r["generation"] for r in records if r["step"] == s) for s in {r["step"] for r in records}}
    return {s: [r for r in records if r["step"] == s and r["generation"] == g] for s, g in sorted(latest.items())}


def _check_pieces(log) -> dict[int, int]:
    """Every sample of every step cut into pieces that cover its window once; each step's dp x cp ranks planned
    over. The plans differ between steps (spans 1 and 2 both chosen)."""
    plans, widths, splits = _plans(log), {}, set()
    for s, records in plans.items():
        pieces = sorted(tuple(p) for r in records for p in r["pieces"])
        for sample in range((s - 1) * 4, s * 4):
            mine = [(a, b) for i, a, b, _ in pieces if i == sample]
            assert [a for a, _ in mine] == [0] + [b for _, b in mine[:-1]] and mine[-1][1] == SEQ, (s, sample, mine)
        assert {i for i, *_ in pieces} == set(range((s - 1) * 4, s * 4)), (s, pieces)
        widths[s] = {r["width"] for r in records}.pop()
        splits.add(tuple((i - (s - 1) * 4, a, b, span) for i, a, b, span in pieces))
    assert len(splits) == len(plans) and {p[3] for split in splits for p in split} == {1, 2}, splits
    return widths


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank,phase,admit_before", [(3, "backward", 0), (0, "reduction", 4)])
def test_dp2_x_cp2_dynamic_cp_a_replica_killed_replans_over_the_survivors(tmp_path, dynamic, fault_ranks, rank, phase,
                                                                            admit_before):
    """Killed at step 2: the survivors (one replica, 2 dp x cp ranks) plan the redone step 2 and step 3 over their 2
    ranks; with a rejoin before step 4 it is planned over 4 again, and the joiner's every owned piece is bitwise."""
    layout, reference = dynamic
    _check_fault_run(tmp_path, 2, rank, 2, phase, reference, layout=layout, admit_before=admit_before)
    widths = _check_pieces(tmp_path / "log")
    assert widths == {1: 4, 2: 2, 3: 2, 4: 4 if admit_before else 2}, widths


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_survivors_planning_over_the_lost_generations_ranks_are_caught(tmp_path, dynamic, fault_ranks):
    """Planted: after the loss the plan keeps generation 0's four dp x cp ranks; the pieces placed on the two lost
    places are trained by no one: the loss from step 2 on is not the uninterrupted run's, and pieces are missing."""
    import dynamic_cp_plants

    layout, reference = dynamic
    pids = tmp_path / "pids"
    pids.mkdir()
    entry = functools.partial(dynamic_cp_plants.stale_plan_width, 3, 2, "backward", str(pids))
    with pytest.MonkeyPatch.context() as m:
        m.setattr("pretrain.training.run.run_rank", entry)
        res = _run(tmp_path, 2, "--set", "train.fault_tolerance=replica", "--set", "train.respawn=false",
                   "--set", "log.sample_ids=true", layout=layout)
    assert res.exit_code == 0, res.output
    expected, got = reference(2), _curve(tmp_path / "log")
    assert [s for s in expected if not math.isclose(got[s][0], expected[s][0], rel_tol=1e-6)] == [2, 3, 4], (got, expected)
    assert [r["event"] for r in _records(tmp_path / "log") if "event" in r] == ["replica_lost"]
    with pytest.raises(AssertionError):
        _check_pieces(tmp_path / "log")


def test_dynamic_cp_runs_under_replica_fault_tolerance_once_a_window_fits_one_replica():
    """No longer refused (the refusal named "[parallel].dynamic_cp=true"); a window longer than one replica's
    dp x cp ranks hold is (test_replica_refusals.py)."""
    from pretrain.config import load_config

    cfg = load_config(None, ["train.fault_tolerance=replica", "parallel.cp=2", "parallel.dynamic_cp=true",
                             "parallel.max_seq_per_rank=32", "data.document_mask=true"])
    assert cfg.validate_world(4).dp == 2


def test_dynamic_cp_losses_take_no_participants_weight():
    """Dynamic CP divides each round's loss by the global batch's kept count already, so a replica's uneven share
    (3 micro-batches over 2 replicas: weights 2/3 and 4/3 without dynamic CP) must not weight it again."""
    from types import SimpleNamespace

    from pretrain.training.fault_replica import ReplicaShare, ReplicaTrainer

    cfg = SimpleNamespace(data=SimpleNamespace(eod_mask_loss=False), train=SimpleNamespace(buddy_shards=0),
                          parallel=SimpleNamespace(zero="no_shard"))
    for index, weight in ((0, 2 / 3), (1, 4 / 3)):
        share = ReplicaShare(3, 1, 2, index)
        assert ReplicaTrainer.loss_weight.fget(SimpleNamespace(cfg=cfg, share=share, span_groups=None)) == weight
        assert ReplicaTrainer.loss_weight.fget(SimpleNamespace(cfg=cfg, share=share, span_groups=object())) == 1.0
