"""A real ``pretrain train`` whose ranks run with a fault injected (``PAR_INJECT``, observe/inject.py):
shared by the straggler and the silent-corruption tests."""

import functools
import json

import pytest
from typer.testing import CliRunner

from pretrain.cli import app


def injected_train(tmp_path, fault_ranks, spec: str, nproc: int, base: list[str], sets=()) -> tuple:
    """``pretrain train --nproc nproc *base --set s...`` with ``fault_ranks.injected(spec)`` as its ranks'
    entry, logging to ``tmp_path``: (the CLI result, log.jsonl's records; none if it wrote no log)."""
    mp = pytest.MonkeyPatch()
    mp.setattr("pretrain.training.run.run_rank", functools.partial(fault_ranks.injected, spec))
    args = ["train", "--nproc", str(nproc), *base, "--set", f"log.dir={tmp_path}"]
    for s in sets:
        args += ["--set", s]
    try:
        res = CliRunner().invoke(app, args)
    finally:
        mp.undo()
    log = tmp_path / "log.jsonl"
    return res, [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
