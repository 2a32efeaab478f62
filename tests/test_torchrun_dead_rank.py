"""A dead rank is named under torchrun: two torchrun agents on 127.0.0.1 started as a cluster starts them
(tools/cluster/node.sh, one per "node"), one worker SIGKILLed mid-run. The survivor's console ends with one
line naming the dead rank and its host, no C++ frame reaches it (torchrun's own report goes to the run's log
dir), and `pretrain hang` names the dead rank from the records. The naming logic's cheap tests:
apps/pretrain/tests/test_dead_rank.py."""

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--set", "train.steps=400", "--set", "train.eval_every=0", "--set", "log.progress=false",
         "--set", "log.every=1", "--set", "model.layers=2"]


def _workers(marker: str) -> dict[int, int]:
    """RANK -> pid of this test's torchrun workers (the marker and RANK in their environment)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        rank = [v for v in env if v.startswith(b"RANK=")]
        if f"DEAD_RANK_TEST={marker}".encode() in env and rank and any(v.startswith(b"TORCHELASTIC_") for v in env):
            found[int(rank[0][5:])] = int(proc.name)
    return found


def _doing(log_dir: Path, rank: int) -> str:
    try:
        return json.loads((log_dir / "flight" / f"alive_{rank}.json").read_text())["doing"]
    except (OSError, ValueError):
        return ""


def _steps(log: Path) -> int:
    return sum('"loss"' in line for line in log.read_text().splitlines()) if log.exists() else 0


@pytest.mark.extended  # two agents and two ranks, each an interpreter importing torch
@pytest.mark.timeout(600)
def test_a_sigkilled_worker_under_two_torchrun_agents_is_named_on_the_survivors_console_and_by_pretrain_hang(tmp_path):
    from pretrain.cli import app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")} | {
        "PRETRAIN_PYTHON": str(ROOT / ".venv/bin/python"), "NNODES": "2", "GPUS_PER_NODE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RUN_ID": "dead-rank", "PREEMPT_TIMEOUT_S": "30",
        "OMP_NUM_THREADS": "1", "DEAD_RANK_TEST": str(tmp_path)}
    node = [str(ROOT / "tools/cluster/node.sh"), str(ROOT / "apps/pretrain/configs/tiny.toml"),
            "--set", f"log.dir={log_dir}", *SHORT]
    consoles = [tmp_path / f"node{n}.txt" for n in (0, 1)]
    agents = []
    try:
        for n, console in enumerate(consoles):
            with open(console, "wb") as out:
                agents.append(subprocess.Popen(node, env=env | {"NODE_RANK": str(n)}, cwd=tmp_path, stdout=out,
                                               stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 500
        while _steps(log_dir / "log.jsonl") < 2 or "on dp" not in _doing(log_dir, 1):  # its heartbeat in the steps
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), consoles[0].read_text()
            time.sleep(0.1)
        workers = _workers(str(tmp_path))
        assert set(workers) == {0, 1}, workers
        os.kill(workers[1], signal.SIGKILL)
        for agent in agents:
            agent.wait(timeout=120)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
        for pid in _workers(str(tmp_path)).values():
            os.kill(pid, signal.SIGKILL)
    # the console filter (node.sh's) holds the pipe until torchrun's last word: wait for it to finish writing
    deadline = time.monotonic() + 30
    while not consoles[0].read_text().rstrip().splitlines()[-1].startswith("error: ") and time.monotonic() < deadline:
        time.sleep(0.1)
    survivor = consoles[0].read_text()
    assert agents[0].returncode != 0
    host = socket.gethostname()
    last = survivor.rstrip().splitlines()[-1]
    assert last.startswith(f"error: rank 1 failed on host {host}: its process {workers[1]} died without exiting"), survivor
    assert re.search(r"its last heartbeat, [\d.]+ s before: (in|computing after) \w+ #\d+ on dp", last), last
    assert "rank 0 lost it in " in last and f"(traceback in {log_dir / 'error.log'})" in last
    assert not re.search(r"^(frame #\d+: |Exception raised from )", survivor, re.M), survivor
    if "torchrun: its messages after the error" in survivor:  # what torchrun's agent said after the rank's error
        assert any(p.read_text() for p in log_dir.glob("torchrun_*.log"))

    res = CliRunner().invoke(app, ["hang", str(log_dir)])
    assert res.exit_code == 0, res.output
    assert f"not arrived: rank 1 (dead on host {host}: its process {workers[1]} died without exiting" in res.output
    verdict = json.loads((log_dir / "flight" / "dead.json").read_text())
    assert verdict["seen_by"] == 0 and [d["rank"] for d in verdict["dead"]] == [1]
