"""Pre-emption: the first SIGTERM or Ctrl-C, sent to the whole process group (SLURM, Kubernetes, a
terminal) or to the launcher alone, saves at the next step boundary and exits 0, and resuming gives
bitwise the uninterrupted run's losses (fp32, same layout), with checkpoint.async_save off and on.
A second Ctrl-C, or ranks still running [train].preempt_timeout_s after the signal, end the run at
once with one line. SIGHUP (a closed terminal, a dropped ssh session) is a SIGTERM: closing the
terminal of a real `pretrain train` saves at the next step, exits 0 and resumes bitwise.

The launcher is this process (signals to it are caught around each launch, so none reaches
pytest); the ranks wait at a gate (``preempt_ranks``) until the test has signalled them, so where
the run stops does not depend on timing.
"""

import json
import os
import pty
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from pretrain.runtime.launch import LAUNCHER_ENV, Aborted, launch
from pretrain.training.run import run_rank

TESTS = Path(__file__).parent
BASE = ["train.steps=5", "train.warmup_steps=1", "train.eval_every=0", "model.layers=2", "log.progress=false"]
TERM, INT, HUP = str(int(signal.SIGTERM)), str(int(signal.SIGINT)), str(int(signal.SIGHUP))
# what the test sends: (signal, also to every rank as a process-group signal does)
SENDS = {"group SIGTERM": (signal.SIGTERM, True), "launcher SIGTERM": (signal.SIGTERM, False),
         "Ctrl-C": (signal.SIGINT, True)}


@pytest.fixture(scope="module")
def ranks_module():
    sys.path.insert(0, str(TESTS))  # the rank processes import it by name
    import preempt_ranks

    yield preempt_ranks
    sys.path.remove(str(TESTS))


def _losses(log_dir: Path) -> dict:
    lines = map(json.loads, (log_dir / "log.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    log = tmp_path_factory.mktemp("full")
    launch(run_rank, (None, BASE + [f"log.dir={log}"]), nproc=4)
    return _losses(log)


def _wait_for(condition, what: str, timeout: float = 600.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _rank_pids(folder: Path, nproc: int) -> list[int]:
    _wait_for(lambda: len(list(folder.glob("gate_*"))) == nproc, "the ranks at the gate")
    return [int(p.name.split("_")[1]) for p in folder.glob("gate_*")]


def _seen(folder: Path, pids: list[int], signals: list[str]) -> bool:
    """Every rank's stop handler received exactly these signals."""
    files = [folder / f"signals_{pid}" for pid in pids]
    return all(f.exists() and sorted(f.read_text().split()) == sorted(signals) for f in files)


def _send(folder: Path, how: str, nproc: int) -> None:
    """Signal like ``how`` once the ranks wait at the gate; open it when every rank got what it should."""
    sig, group = SENDS[how]
    pids = _rank_pids(folder, nproc)
    if group:  # the ranks' copy first, so the launcher's forwarded SIGTERM is a second delivery
        for pid in pids:
            os.kill(pid, sig)
        _wait_for(lambda: _seen(folder, pids, [str(int(sig))]), "the group's signal in every rank")
    os.kill(os.getpid(), sig)
    _wait_for(lambda: _seen(folder, pids, [TERM] + ([str(int(sig))] if group else [])), "the forwarded SIGTERM")


@contextmanager
def _signals_caught():
    """Signals sent to this process while (or just after) it launches never reach pytest's handlers."""
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _launch_signalled(ranks_module, folder: Path, overrides: list[str], nproc: int, sender, **kw):
    errors = []

    def run_sender():
        try:
            sender()
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)

    thread = threading.Thread(target=run_sender, daemon=True)
    with _signals_caught():
        thread.start()
        try:
            return launch(ranks_module.train, (str(folder), overrides), nproc=nproc, **kw)
        finally:
            thread.join(timeout=60)
            assert not errors, errors


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("how", list(SENDS))
def test_a_signal_saves_at_the_next_step_and_resuming_gives_the_uninterrupted_losses(
        how, async_save, uninterrupted, ranks_module, tmp_path):
    ck = [f"checkpoint.dir={tmp_path / 'ck'}", f"checkpoint.async_save={str(async_save).lower()}"]

    def send_then_open():
        _send(tmp_path, how, 4)
        (tmp_path / "open").touch()

    # a generous deadline: this checks the save, the deadline has its own test below
    out = _launch_signalled(ranks_module, tmp_path, BASE + ck + [f"log.dir={tmp_path / 'a'}"], 4, send_then_open,
                            preempt_timeout_s=600)
    stop = ranks_module.GATE_STEP + 1  # the step the ranks were in when signalled
    assert [r["steps"] for r in out] == [stop] * 4
    assert (tmp_path / "ck" / "latest").read_text().strip() == f"step_{stop}"
    a = _losses(tmp_path / "a")
    assert a == {s: uninterrupted[s] for s in range(1, stop + 1)}
    if how == "group SIGTERM":  # how the signal came does not change what is saved: resume once per save mode
        launch(run_rank, (None, BASE + ck + ["checkpoint.resume=true", f"log.dir={tmp_path / 'b'}"]), nproc=4)
        assert a | _losses(tmp_path / "b") == uninterrupted  # bitwise equal floats, steps 1..5


def test_a_second_ctrl_c_stops_the_ranks_at_once_without_saving(ranks_module, tmp_path):
    def ctrl_c_twice():  # the gate never opens: only the second Ctrl-C ends the run
        _send(tmp_path, "Ctrl-C", 2)
        os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(Aborted) as e:
        _launch_signalled(ranks_module, tmp_path, BASE + [f"log.dir={tmp_path}"], 2, ctrl_c_twice)
    # "at once": this line, not the one a rank still running past preempt_timeout_s would end with (counted, not timed)
    assert str(e.value) == "interrupted again (SIGINT): stopped the ranks without saving" and e.value.exit_code == 130
    for pid in _rank_pids(tmp_path, 2):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    saved = [p.name for p in (tmp_path / "checkpoints").glob("*") if p.name != "manifest.json"]
    assert saved == [], saved  # no step_N, step_N.tmp or latest: only the run's (empty) manifest


def test_ranks_still_running_after_preempt_timeout_are_stopped_with_one_line(ranks_module, tmp_path):
    with pytest.raises(Aborted) as e:  # the gate never opens
        _launch_signalled(ranks_module, tmp_path, BASE + [f"log.dir={tmp_path}"], 2,
                          lambda: _send(tmp_path, "launcher SIGTERM", 2), preempt_timeout_s=2)
    assert str(e.value) == ("SIGTERM: the ranks did not save and exit within [train].preempt_timeout_s=2 s; "
                            "stopped them") and e.value.exit_code == 1


def stop_requests_job():
    from pretrain.runtime.preempt import StopRequests

    outcomes = {}
    for launcher in ("other", "self"):  # a rank started by a launcher, or its own launcher (--nproc 1)
        os.environ[LAUNCHER_ENV] = str(os.getpid()) if launcher == "self" else "1"
        stops, seen = StopRequests(30), []
        try:  # a SIGHUP (as torchrun forwards it), a SIGTERM, a repeated SIGTERM, then Ctrl-C
            for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGTERM, signal.SIGINT):
                os.kill(os.getpid(), sig)
                seen.append(stops.signal)
            outcomes[launcher] = (seen, stops.agreed())
        except Aborted as e:
            outcomes[launcher] = (seen, str(e), e.exit_code)
        finally:
            stops.close()
            del os.environ[LAUNCHER_ENV]
    return outcomes


def test_a_ctrl_c_after_the_first_signal_aborts_only_a_rank_that_is_its_own_launcher(dist_run):
    assert dist_run(1, stop_requests_job)[0] == {
        "other": (["SIGHUP"] * 4, True),
        "self": (["SIGHUP"] * 3, "interrupted again (SIGINT): stopped without saving", 130)}


@pytest.mark.timeout(300)  # a whole `pretrain train` in its own process
# extended tier: closing the terminal below signals the same process group of a real `pretrain train`
# (SIGHUP, handled as SIGTERM) and also resumes bitwise
@pytest.mark.extended
def test_sigterm_to_the_process_group_of_pretrain_train_saves_and_exits_0(tmp_path):
    ck, log = tmp_path / "ck", tmp_path / "log"
    cmd = [sys.executable, "-m", "pretrain", "train", "--nproc", "2", "--set", "train.steps=300", "--set",
           "train.eval_every=0", "--set", "model.layers=2", "--set", "log.progress=false", "--set",
           f"checkpoint.dir={ck}", "--set", f"log.dir={log}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        jsonl = log / "log.jsonl"
        _wait_for(lambda: jsonl.exists() and jsonl.read_text().count("\n") >= 2 or proc.poll() is not None, "step 2")
        os.killpg(proc.pid, signal.SIGTERM)  # launcher, forkserver and ranks, as SLURM and Kubernetes do
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    step = int((ck / "latest").read_text().strip().split("_")[1])
    assert 2 <= step < 300 and f"SIGTERM: stopped after step {step}, checkpoint written" in out, out
    assert "Traceback" not in out and "error" not in out, out


@pytest.mark.timeout(300)  # a whole `pretrain train` in its own process
def test_closing_the_terminal_of_pretrain_train_saves_at_the_next_step_exits_0_and_resumes_bitwise(
        uninterrupted, ranks_module, tmp_path):
    """The run's terminal (a pty the launcher holds as its controlling terminal) is closed while the ranks wait
    at the gate: the kernel sends SIGHUP to the launcher (the session's leader), a shell sends it to its job's
    process group (launcher, forkserver, ranks), and writing to the terminal fails from then on."""
    ck = [f"checkpoint.dir={tmp_path / 'ck'}"]
    sets = [a for o in BASE + ck + [f"log.dir={tmp_path / 'a'}"] for a in ("--set", o)]
    code = ("import fcntl, functools, termios, preempt_ranks, pretrain.training.run as run; "
            "fcntl.ioctl(0, termios.TIOCSCTTY, 0); "  # stdin, the pty, becomes this new session's terminal
            f"run.run_rank = functools.partial(preempt_ranks.train_cli, {str(tmp_path)!r}); "
            "from pretrain.cli import main; main()")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    terminal, tty = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code, "train", "--nproc", "4", *sets], stdin=tty, stdout=tty,
                            stderr=tty, start_new_session=True, env=env)
    os.close(tty)
    try:
        pids = _rank_pids(tmp_path, 4)
        os.set_blocking(terminal, False)
        try:
            shown = os.read(terminal, 1 << 16).decode(errors="replace")  # what the terminal showed so far
        except BlockingIOError:
            shown = ""
        os.close(terminal)  # the terminal goes: the kernel's SIGHUP to the launcher
        os.killpg(proc.pid, signal.SIGHUP)  # and a shell's to its job
        _wait_for(lambda: _seen(tmp_path, pids, [HUP, TERM]) or proc.poll() is not None, "the signals in every rank")
        (tmp_path / "open").touch()
        assert proc.wait(timeout=300) == 0, shown  # not -SIGHUP: the signal ended no process of the run
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stop = ranks_module.GATE_STEP + 1
    assert (tmp_path / "ck" / "latest").read_text().strip() == f"step_{stop}"
    a = _losses(tmp_path / "a")
    assert a == {s: uninterrupted[s] for s in range(1, stop + 1)}
    launch(run_rank, (None, BASE + ck + ["checkpoint.resume=true", f"log.dir={tmp_path / 'b'}"]), nproc=4)
    assert a | _losses(tmp_path / "b") == uninterrupted  # bitwise equal floats, steps 1..5


def test_the_callers_own_handler_hears_the_signal_once_the_ranks_stopped():
    """pytest's (the suite's conftest) ends the run on SIGTERM: a launcher inside a test must pass it on.
    The defaults are not called: a pre-empted `pretrain train` saved and ends normally."""
    from pretrain.runtime.local_launcher import _pass_on

    heard = []
    _pass_on(signal.SIGTERM, lambda signum, frame: heard.append(signum))
    _pass_on(None, lambda signum, frame: heard.append("no signal"))
    for default in (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler, None):
        _pass_on(signal.SIGINT, default)  # neither raises KeyboardInterrupt nor kills this process
    assert heard == [signal.SIGTERM]
