"""tools/cluster/pretrain.sbatch as shipped, on this machine: stub ``sbatch``, ``srun`` and ``scontrol``
(tests/slurm_stub) on PATH give it SLURM's variables and run its step once per "node" (two torchrun agents on
127.0.0.1). The README's cluster section is run as written (its lines extracted); ``PRETRAIN_SET`` shortens
the run as in tests/test_readme_commands.py.

The job is pre-empted as ``--signal=B:TERM@S`` does it: SIGTERM to the batch script alone, which passes it
through srun and torchrun to the ranks; they save, the script requeues the job and the stub sbatch runs it
again under the same SLURM_JOB_ID; the file's grace (the S of --signal) after the SIGTERM, what is left of the
attempt is killed, as the time limit does. The signal is sent once step 2 is logged; the ranks agree on a stop
at every step (log.every=1), so the run stops a step or two later, well before its 40 steps, and the losses
are compared whichever step that is. A lock file left by an earlier attempt of this job on another node is
in the run directory from the start: the job takes it over.
"""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
import traceback
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
STUBS = Path(__file__).parent / "slurm_stub"
JOB = "4242"
SHORT = "train.steps=40 train.warmup_steps=1 train.eval_every=0 log.progress=false log.every=1 model.layers=2"
SECTION = "### Launching on a cluster (SLURM, Kubernetes, SkyPilot)"


def cluster_commands() -> list[str]:
    """The command lines of the README's cluster section's ```bash blocks, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split(SECTION, 1)[1]
    section = re.split(r"\n#{2,3} ", section, maxsplit=1)[0]
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        lines += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return lines


def _losses(log: Path) -> dict:
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r}


def _wait_for(condition, what: str, timeout: float = 500.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _ranks(stub_dir: Path) -> list[int]:
    """The PIDs of this job's rank processes (torchrun's workers: RANK and our stub directory in their environment)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"SLURM_STUB_DIR={stub_dir}".encode() in env and any(v.startswith(b"RANK=") for v in env):
            found.append(int(proc.name))
    return found


def _preempt(stub_dir: Path, log: Path, errors: list, grace_s: float, job: subprocess.Popen) -> None:
    """After step 2: SIGTERM to the batch script as --signal=B:TERM does; the file's grace later (the time limit),
    SLURM kills what is left of the attempt (here: the stub's session and the ranks)."""
    try:
        _wait_for(lambda: log.exists() and len(_losses(log)) >= 2, "step 2 of the first attempt")
        batch = int((stub_dir / "batch.0.pid").read_text())
        os.kill(batch, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while Path(f"/proc/{batch}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if Path(f"/proc/{batch}").exists() and not (stub_dir / "batch.1.pid").exists():
            _kill_job(job, stub_dir)
            errors.append(f"the first attempt was still running {grace_s:g} s after SIGTERM: killed, as SLURM would")
    except BaseException:  # noqa: BLE001 -- reported by the test
        errors.append(traceback.format_exc())


def _kill_job(job: subprocess.Popen, stub_dir: Path) -> None:
    """The stubs and agents (the job's session) and the ranks (torchrun starts each in a session of its own)."""
    for kill in (lambda: os.killpg(job.pid, signal.SIGKILL), *(lambda pid=pid: os.kill(pid, signal.SIGKILL)
                                                                for pid in _ranks(stub_dir))):
        try:
            kill()
        except ProcessLookupError:
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.extended  # four interpreters importing torch per attempt, two attempts
@pytest.mark.timeout(900)
def test_the_readme_cluster_lines_train_as_nproc_2_and_a_preempted_job_requeues_and_continues_bitwise(
        tmp_path, monkeypatch):
    from pretrain.cli import app
    from pretrain.config.launch_files import read_launch_file

    for name in ("apps", "packages", "tools", "README.md", ".venv"):
        (tmp_path / name).symlink_to(ROOT / name)
    shutil.copy(ROOT / "apps/pretrain/configs/tiny.toml", tmp_path / "my.toml")
    stub_dir = tmp_path / "stub"
    stub_dir.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PRETRAIN_SET", SHORT)
    runner = CliRunner()
    ref = runner.invoke(app, ["train", "my.toml", "--nproc", "2", "--set", f"log.dir={tmp_path / 'ref'}"])
    assert ref.exit_code == 0, ref.output
    reference = _losses(tmp_path / "ref" / "log.jsonl")

    commands = cluster_commands()
    submits = [c for c in commands if c.startswith("sbatch ")]
    assert len(submits) == 1, commands
    log_dir = tmp_path / dict(s.split("=", 1) for s in shlex.split(submits[0]) if s.startswith("log.dir="))["log.dir"]
    log_dir.mkdir(parents=True)  # an earlier attempt of this job, SIGKILLed on another node, left its lock
    (log_dir / "pretrain.pid").write_text(json.dumps({"pid": 12345, "host": "node-gone", "job": f"SLURM_JOB_ID={JOB}",
                                                      "token": "earlier-attempt"}) + "\n")
    env = os.environ | {"PATH": f"{STUBS}{os.pathsep}{os.environ['PATH']}", "SLURM_STUB_DIR": str(stub_dir),
                        "SLURM_STUB_JOB_ID": JOB, "MASTER_PORT": str(_free_port()), "UV_PROJECT": str(ROOT),
                        "PRETRAIN_SET": SHORT}
    errors: list = []
    grace_s = read_launch_file(str(ROOT / "tools/cluster/pretrain.sbatch")).grace_s  # --signal=B:TERM@180
    for line in commands:
        words = shlex.split(line, comments=True)
        if words[:3] == ["uv", "run", "pretrain"]:  # the checks before the queue: in this process
            res = runner.invoke(app, words[3:])
            assert res.exit_code == 0, (line, res.output)
            continue
        job = subprocess.Popen(["bash", "-c", line], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
        sender = threading.Thread(target=_preempt, args=(stub_dir, log_dir / "log.jsonl", errors, grace_s, job),
                                  daemon=True)
        sender.start()
        try:
            stdout, _ = job.communicate(timeout=800)
        finally:
            if job.poll() is None:
                _kill_job(job, stub_dir)
        sender.join(timeout=grace_s + 60)
        out = (tmp_path / f"slurm-{JOB}.out").read_text()
        assert job.returncode == 0 and not errors, (line, stdout, errors, out[-4000:])

    calls = (stub_dir / "calls").read_text().splitlines()
    assert f"scontrol requeue {JOB}" in calls and calls.count("batch exit 0") == 2, calls  # one requeue, two attempts
    assert f"scontrol show hostnames 127.0.0.[1-2]" in calls, calls  # MASTER_ADDR: the first compute node
    stopped = re.findall(r"SIGTERM: stopped after step (\d+), checkpoint written", out)
    assert len(stopped) == 1 and 2 <= int(stopped[0]) < 40, out[-4000:]
    assert f"requeueing job {JOB}" in out, out[-4000:]
    assert _losses(log_dir / "log.jsonl") == reference  # both attempts: bitwise the --nproc 2 run's losses, steps 1..40
    assert not (log_dir / "pretrain.pid").exists()  # the lock taken over, and released at the end
