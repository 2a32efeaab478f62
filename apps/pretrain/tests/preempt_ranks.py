"""Rank entry for the pre-emption tests: pretrain's own ``run_rank``, held before step ``GATE_STEP + 1``
until the test has signalled every rank, so where the run stops does not depend on timing.

Each rank writes ``gate_<pid>`` when it reaches the gate (the test learns the pids from them) and
appends every signal its stop handler receives to ``signals_<pid>``; it passes the gate once the
test creates ``open``. The patches live in the rank processes only.
"""

import os
import time
from pathlib import Path

GATE_STEP = 2  # ranks wait after two steps


def train(test_dir: str, overrides: list[str]) -> dict:
    from pretrain.runtime.preempt import StopRequests
    from pretrain.training.run import run_rank
    from pretrain.training.train_loop import Trainer

    folder = Path(test_dir)
    on_signal, train_step = StopRequests._on_signal, Trainer.train_step

    def noted(self, signum, frame):
        with open(folder / f"signals_{os.getpid()}", "a") as f:
            f.write(f"{signum}\n")
        on_signal(self, signum, frame)

    def gated(self, step):
        if step == GATE_STEP:
            (folder / f"gate_{os.getpid()}").touch()
            while not (folder / "open").exists():
                time.sleep(0.01)
        return train_step(self, step)

    StopRequests._on_signal, Trainer.train_step = noted, gated
    return run_rank(None, overrides, "cpu")


def train_cli(test_dir: str, config, overrides, device=None, force=False) -> dict:
    """:func:`train` in place of ``run_rank`` under `pretrain train` (which passes the CLI's arguments)."""
    return train(test_dir, list(overrides))
