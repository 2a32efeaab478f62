"""A training step reads no tensor value on the host outside log steps (issue 47): on a GPU each
``.item()`` / ``float(t)`` / ``.tolist()`` stops the CPU from queueing kernels until the stream drains.
Counted in every rank of a real ``pretrain train`` (host_reads.py): a step that is neither a log
step nor the last one (nor an eval or checkpoint step) reads nothing."""

import functools
import json

import pytest
from typer.testing import CliRunner

from pretrain.cli import app

STEPS, EVERY = 8, 4  # logged: steps 4 and 8 (the last); counted: the other six
BASE = ["--set", "model.layers=2", "--set", f"train.steps={STEPS}", "--set", "train.warmup_steps=1",
        "--set", "train.eval_every=0", "--set", "log.progress=false", "--set", f"log.every={EVERY}"]
LAYOUTS = {  # name: (config, nproc, overrides)
    "dp2": (None, 2, []),
    # saved at a log step, written and published in the background during the steps that follow
    "dp2-async-save": (None, 2, ["checkpoint.async_save=true", f"checkpoint.every={EVERY}"]),
    "tp2-sp": (None, 2, ["parallel.tp=2"]),
    "cp2": (None, 2, ["parallel.cp=2"]),
    "pp2-1f1b": (None, 2, ["parallel.pp=2"]),
    "pp2-zb-v": (None, 2, ["parallel.pp=2", "parallel.schedule=zb-v", "model.layers=4"]),
    "zero3": (None, 2, ["parallel.zero=optim_grads_params"]),
    "cp2-muon-qk_clip": (None, 2, ["parallel.cp=2", "train.optimizer=muon", "train.muon_qk_clip=0.05"]),
    # activations out to the host and back (model/offload.py), and a module recomputed
    "dp2-offload-recompute": (None, 2, ['model.offload=["layers:1", "mlp"]', 'model.recompute=["core_attn"]']),
}
# MoE at ep2: the all-to-all's split sizes are read once per MoE layer per micro-batch (their
# tensor sizes follow the routing); the static-shape dispatch reads none.
MOE = ("tiny-moe", 2, ["parallel.ep=2", "model.layers=3", "train.micro_batch=2"])


def reads_per_step(monkeypatch, tmp_path, config, nproc, overrides) -> list[list[int]]:
    """Each rank's host reads per step of a ``pretrain train`` (see host_reads.py)."""
    import host_reads

    out = tmp_path / "reads"
    monkeypatch.setattr("pretrain.training.run.run_rank", functools.partial(host_reads.counting_host_reads, str(out)))
    args = ["train"] + ([config] if config else []) + ["--nproc", str(nproc), *BASE, "--set", f"log.dir={tmp_path}"]
    for o in overrides:
        args += ["--set", o]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    return [json.loads((tmp_path / f"reads.{r}").read_text()) for r in range(nproc)]


def unlogged(per_step: list[int]) -> list[int]:
    """The counts of the steps that are not log steps (nor the last)."""
    return [n for s, n in enumerate(per_step) if (s + 1) % EVERY and s + 1 != STEPS]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.extended) if "offload" in n else n for n in LAYOUTS])
def test_no_host_read_outside_log_steps(monkeypatch, tmp_path, fault_ranks, name):
    config, nproc, overrides = LAYOUTS[name]
    reads = reads_per_step(monkeypatch, tmp_path, config, nproc, overrides)
    print(name, reads)
    for rank, per_step in enumerate(reads):
        assert len(per_step) == STEPS
        assert unlogged(per_step) == [0] * (STEPS - STEPS // EVERY), f"{name} rank {rank}: reads per step {per_step}"


@pytest.mark.parametrize("balance", ["none", "replicate", "replicate-allgather"])
def test_moe_reads_its_split_sizes_once_per_layer_and_micro_batch(monkeypatch, tmp_path, fault_ranks, balance):
    """expert_balance = "replicate" too: its plan comes from the one read of the gathered counts (under the
    all-gather dispatcher, counted from the gathered routing)."""
    config, nproc, overrides = MOE
    balanced = ["model.expert_balance=replicate", "model.dispatcher=allgather"] if balance == "replicate-allgather" \
        else [f"model.expert_balance={balance}"]
    reads = reads_per_step(monkeypatch, tmp_path, config, nproc, overrides + balanced)
    print("ep2", balance, reads)
    moe_layers, micro_batches = 2, 8 // 2 // 2  # layers 1-2 of 3; global batch 8 over dp 2 in micro-batches of 2
    for rank, per_step in enumerate(reads):
        assert unlogged(per_step) == [moe_layers * micro_batches] * (STEPS - STEPS // EVERY), (rank, per_step)


def test_the_static_shape_moe_dispatch_reads_nothing(monkeypatch, tmp_path, fault_ranks):
    config, nproc, overrides = MOE
    reads = reads_per_step(monkeypatch, tmp_path, config, nproc, overrides + ["model.dispatcher=alltoall_padded"])
    print("ep2 padded", reads)
    for rank, per_step in enumerate(reads):
        assert unlogged(per_step) == [0] * (STEPS - STEPS // EVERY), (rank, per_step)


def test_expert_replacement_reads_once_at_its_step_and_is_logged(monkeypatch, tmp_path, fault_ranks):
    """expert_balance = "replicate+replace", replace_every=3: the load counted on the device is read once,
    at the re-placement steps (3 and 6) only; log.jsonl has a record of each (experts moved, bytes moved)."""
    config, nproc, overrides = MOE
    sets = overrides + ["model.expert_balance=replicate+replace", "model.replace_every=3"]
    reads = reads_per_step(monkeypatch, tmp_path, config, nproc, sets)
    print("ep2 replicate+replace", reads)
    per_step = 2 * (8 // 2 // 2)  # as test_moe_reads_its_split_sizes_once_per_layer_and_micro_batch
    for rank, counts in enumerate(reads):
        assert unlogged(counts) == [per_step + (s + 1 in (3, 6)) for s in range(STEPS) if (s + 1) % EVERY and s + 1 != STEPS], \
            (rank, counts)
    events = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    events = [e for e in events if e.get("event") == "expert_placement"]
    assert [e["step"] for e in events] == [3, 6] and all({"experts_moved", "bytes_moved"} <= e.keys() for e in events)
