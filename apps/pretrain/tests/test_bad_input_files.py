"""Files a command reads back, as a user or a file system can leave them, run as the bad-input sweeps
run (one_error_line.py): exit 2 (3 for `verify` of bytes it cannot check), exactly one ``error:``
line, no traceback, no hang, no file changed.

- ``pretrain verify`` never calls unverifiable data ok: a checkpoint without ``checksums.json``
  (even with a corrupted byte), and a run directory where one checkpoint has none, exit 3.
- Every JSON the trainer reads back, edited by hand (its checksums rewritten to match, as a user
  who edits it would): ``trainer_state.json`` field by field (wrong types, missing keys, NaN/inf,
  negative, huge ints, nested garbage), ``checksums.json``, ``manifest.json``, ``latest``.
- Configs of extreme size and depth: a TOML nested 10000 deep, a 50 MB TOML, a key with a 1 MB
  name, ``--set`` with huge ints or a value nested 10000 deep.
- The run lock file as anything a file system can hold: a directory, a symlink, a FIFO (also while
  the directory's flock is held), garbage, empty, huge, another host's, nested 4096 deep, a PID no
  process can have. A lock file whose holder is known to be gone is taken over (the run starts).
"""

import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.training.preflight import PID_FILE

from one_error_line import assert_one_error_line, invoke_within_limit, snapshot

runner = CliRunner()
TRAIN = ["train", "--nproc", "1", "--set", "model.layers=1", "--set", "train.steps=2", "--set", "train.warmup_steps=1",
         "--set", "train.eval_every=0", "--set", "log.progress=false"]
DEEP = 10000


def _resume(ck: str) -> list[str]:
    return TRAIN + ["--set", "checkpoint.resume=true", "--set", f"checkpoint.dir={ck}", "--set", "log.dir=run"]


def _rechecksum(step: Path) -> None:
    """The checksums rewritten for the files as they now are (a user who edits a file would)."""
    from pretrain.checkpoint.integrity import CHECKSUMS, digests, write_checksums

    (step / CHECKSUMS).unlink()
    write_checksums(step, digests(step, sorted(str(p.relative_to(step)) for p in step.rglob("*")
                                               if p.is_file() and p.name != ".metadata")))


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


# trainer_state.json: each field a load, a resume or an export reads, as a hand edit can leave it
MISSING = object()
STATE_EDITS = {
    "step missing": ("step", MISSING), "step string": ("step", "1"), "step negative": ("step", -1),
    "step huge": ("step", 2**80), "step float": ("step", 1.5), "step NaN": ("step", float("nan")),
    "step inf": ("step", float("inf")), "step null": ("step", None), "step list": ("step", [1]),
    "step bool": ("step", True),
    "optimizer_steps negative": ("optimizer_steps", -3), "optimizer_steps huge": ("optimizer_steps", 10**30),
    "optimizer_steps string": ("optimizer_steps", "x"),
    "config missing": ("config", MISSING), "config list": ("config", []),
    "config.model number": ("config", {"model": 5}),
    "optimizer string": ("optimizer", "yes"), "optimizer_name list": ("optimizer_name", ["adamw"]),
    "optimizer_kinds string": ("optimizer_kinds", "exp_avg"), "optimizer_kinds ints": ("optimizer_kinds", [1, 2]),
    "optimizer_scalars list": ("optimizer_scalars", [1]),
    "optimizer_scalars NaN": ("optimizer_scalars", {"step": float("nan")}),
    "world_size string": ("world_size", "1"), "world_size zero": ("world_size", 0), "layout number": ("layout", 5),
    "layout negative tp": ("layout", {"tp": -1}),
    "expert_placement number": ("expert_placement", 5),
    "expert_placement ep string": ("expert_placement", {"ep": "x", "layers": {}}),
    "expert_placement garbage layer": ("expert_placement", {"ep": 1, "layers": {"layers.0": {"expert_at": "x"}}}),
    "expert_placement load inf": ("expert_placement", {"ep": 1, "layers": {"layers.0": {"expert_at": [0],
                                                                                          "load": [float("inf")]}}}),
    "run_id nested": ("run_id", {"a": [{"b": None}]}), "format number": ("format", 1),
    "tokenizer_vocab negative": ("tokenizer_vocab", -5),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    w = tmp_path_factory.mktemp("files")
    res = runner.invoke(app, TRAIN + ["--set", "train.steps=1", "--set", f"log.dir={w / 'trained'}"])
    assert res.exit_code == 0, res.output
    good = w / "trained" / "checkpoints"
    _verify_cases(w, good)
    for name, (key, value) in STATE_EDITS.items():
        ck = w / name.replace(" ", "_")
        shutil.copytree(good, ck)
        state = json.loads((ck / "step_1" / "trainer_state.json").read_text())
        if key == "config" and isinstance(value, dict):
            value = state["config"] | value
        state = {k: v for k, v in (state | {key: value}).items() if v is not MISSING}
        (ck / "step_1" / "trainer_state.json").write_text(json.dumps(state))
        _rechecksum(ck / "step_1")
    _whole_files(w, good)
    (w / "deep.toml").write_text("[model]\nhidden = " + "[" * DEEP + "]" * DEEP + "\n")
    (w / "deep_tables.toml").write_text("[" + ".".join(["model"] * DEEP) + "]\nx = 1\n")
    with open(w / "huge.toml", "w") as f:  # 50 MB of keys
        f.write("[train]\n")
        line = "# " + "x" * 98 + "\n"
        f.write(line * (50 * 10**6 // len(line)))
        f.write("steps = 2\n")
    (w / "long_key.toml").write_text("[train]\n" + "k" * 2**20 + " = 1\n")
    (w / "long_section.toml").write_text("[" + "s" * 2**20 + "]\nx = 1\n")
    return w


def _verify_cases(w: Path, good: Path) -> None:
    shutil.copytree(good, w / "ck_unverifiable")
    (w / "ck_unverifiable" / "step_1" / "checksums.json").unlink()
    shutil.copytree(w / "ck_unverifiable", w / "ck_unverifiable_corrupt")
    _flip_byte(next((w / "ck_unverifiable_corrupt" / "step_1").glob("*.distcp")))
    shutil.copytree(good, w / "ck_run_one_unverifiable")
    shutil.copytree(good / "step_1", w / "ck_run_one_unverifiable" / "step_2")
    (w / "ck_run_one_unverifiable" / "step_2" / "checksums.json").unlink()


def _whole_files(w: Path, good: Path) -> None:
    """checksums.json, manifest.json and latest as whole files that are not what they claim."""
    def copy(name: str) -> Path:
        shutil.copytree(good, w / name)
        return w / name

    sums = json.loads((good / "step_1" / "checksums.json").read_text())
    first = next(iter(sums["files"]))
    def entry(**fields) -> str:
        return json.dumps(sums | {"files": sums["files"] | {first: sums["files"][first] | fields}})

    for name, text in {"sums_list": "[]", "sums_deep": "[" * DEEP + "]" * DEEP, "sums_size_bool": entry(size=True),
                       "sums_size_negative": entry(size=-1), "sums_nan": entry(size=float("nan"))}.items():
        (copy(name) / "step_1" / "checksums.json").write_text(text)
    manifest = json.loads((good / "manifest.json").read_text())
    for name, text in {"manifest_deep": '{"run_id": "a", "saves": ' + "[" * DEEP + "]" * DEEP + "}",
                       "manifest_list": "[]", "manifest_run_id_number": json.dumps(manifest | {"run_id": 5}),
                       "manifest_nan": json.dumps(manifest | {"saves": [float("nan")]})}.items():
        (copy(name) / "manifest.json").write_text(text)
    (copy("latest_garbage") / "latest").write_bytes(b"\xff\xfe\x00garbage\n")
    (copy("latest_empty") / "latest").write_text("")
    (copy("latest_huge") / "latest").write_text("step_1" * 2 * 10**6)
    (copy("state_deep") / "step_1" / "trainer_state.json").write_text("[" * DEEP + "]" * DEEP)
    _rechecksum(w / "state_deep" / "step_1")
    (copy("state_list") / "step_1" / "trainer_state.json").write_text("[1, 2]")
    _rechecksum(w / "state_list" / "step_1")


CASES = {
    # verify never says ok of bytes it could not check: exit 3
    "verify without checksums": (["verify", "ck_unverifiable/step_1"], "not verified", 3),
    "verify without checksums, a byte corrupted": (["verify", "ck_unverifiable_corrupt/step_1"], "not verified", 3),
    "verify a run with one unverifiable": (["verify", "ck_run_one_unverifiable"], "step_2 is not verified", 3),
    # trainer_state.json, field by field
    **{f"resume {name}": (_resume(name.replace(" ", "_")), "trainer_state.json", 2) for name in STATE_EDITS},
    "resume state nested 10000 deep": (_resume("state_deep"), "trainer_state.json", 2),
    "resume state a list": (_resume("state_list"), "trainer_state.json", 2),
    "verify state step huge": (["verify", "step_huge/step_1"], "step", 2),
    "convert state config list": (["convert", "--to-hf", "out_hf", "--checkpoint", "config_list"], "config", 2),
    # checksums.json
    **{f"resume checksums {name}": (_resume(name), "checksums.json", 2)
       for name in ("sums_list", "sums_deep", "sums_size_bool", "sums_size_negative", "sums_nan")},
    "verify checksums a list": (["verify", "sums_list/step_1"], "checksums.json", 2),
    "verify checksums nested 10000 deep": (["verify", "sums_deep/step_1"], "checksums.json", 2),
    # manifest.json and latest
    **{f"resume {name}": (_resume(name), "manifest.json", 2)
       for name in ("manifest_deep", "manifest_list", "manifest_run_id_number", "manifest_nan")},
    "new run manifest nested 10000 deep": (TRAIN + ["--set", "checkpoint.dir=manifest_deep", "--set", "log.dir=run"],
                                           "manifest.json", 2),
    **{f"resume {name}": (_resume(name), "latest", 2) for name in ("latest_garbage", "latest_empty", "latest_huge")},
    # configs of extreme size and depth
    "config nested 10000 deep": (TRAIN + ["deep.toml"], "deep.toml", 2),
    "config tables 10000 deep": (TRAIN + ["deep_tables.toml"], "[model]", 2),
    "config of 50 MB": (TRAIN + ["huge.toml"], "huge.toml", 2),
    "config key of 1 MB": (TRAIN + ["long_key.toml"], "unknown key [train].kkkk", 2),
    "config section of 1 MB": (TRAIN + ["long_section.toml"], "unknown section [ssss", 2),
    "--set key of 1 MB": (TRAIN + ["--set", "train." + "k" * 2**20 + "=1"], "unknown key [train].kkkk", 2),
    "--set value nested 10000 deep": (TRAIN + ["--set", "model.hidden=" + "[" * DEEP + "]" * DEEP], "model.hidden=", 2),
    "--set layers 2**63": (TRAIN + ["--set", "model.layers=9223372036854775807"], "layers", 2),
    "--set layers 10**30": (TRAIN + ["--set", "model.layers=" + "9" * 30], "layers", 2),
    "--set hidden 2**62": (TRAIN + ["--set", "model.hidden=4611686018427387904"], "hidden", 2),
    "--set vocab 2**62": (TRAIN + ["--set", "model.vocab_size=4611686018427387904"], "vocab_size", 2),
    "--set seq_len 2**62": (TRAIN + ["--set", "train.seq_len=4611686018427387904"], "seq_len", 2),
    "--set micro_batch 2**62": (TRAIN + ["--set", "train.micro_batch=4611686018427387904"], "micro_batch", 2),
    "--set heads 2**62": (TRAIN + ["--set", "model.heads=4611686018427387904"], "heads", 2),
    "--set experts 2**62": (TRAIN + ["--set", "model.num_experts=4611686018427387904"], "num_experts", 2),
    "--set pp 2**62": (TRAIN + ["--set", "parallel.pp=4611686018427387904"], "pp", 2),
    "--set vpp 2**62": (TRAIN + ["--set", "parallel.vpp=4611686018427387904"], "vpp", 2),
    "--set microbatches 2**62": (TRAIN + ["--set", "parallel.microbatches=4611686018427387904"], "microbatches", 2),
    "--set global_batch 2**62": (TRAIN + ["--set", "train.global_batch=4611686018427387904"], "global_batch", 2),
    "plan layers 2**62": (["plan", "--set", "model.layers=4611686018427387904"], "layers", 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_file_read_back_is_one_line_never_a_traceback(workspace, monkeypatch, name):
    args, words, code = CASES[name]
    monkeypatch.chdir(workspace)
    before = snapshot(workspace)
    res = invoke_within_limit(runner, app, args)
    assert_one_error_line(res, name[:200], words, code)
    assert len(res.stderr) < 2000, (name[:200], res.stderr[:2000])  # names the value, not a megabyte of it
    assert snapshot(workspace) == before, name[:200]


# the run lock file: (what stands at pretrain.pid, "refused" or "taken" over by the new run)
def _lock_cases():
    other_host = json.dumps({"pid": 4242, "host": "node-b", "job": "SLURM_JOB_ID=17", "token": "x"})
    return {
        "a directory": (lambda p: p.mkdir(), "refused"),
        "a symlink": (lambda p: p.symlink_to(p.parent / "elsewhere"), "refused"),
        "a FIFO": (lambda p: os.mkfifo(p), "refused"),
        "another host's": (lambda p: p.write_text(other_host), "refused"),
        "empty": (lambda p: p.write_text(""), "taken"),
        "garbage bytes": (lambda p: p.write_bytes(b"\xff\x00\x80garbage"), "taken"),
        "huge (20 MB)": (lambda p: p.write_bytes(b"9" * 20 * 10**6), "taken"),
        "nested 4096 deep": (lambda p: p.write_text("[" * 4096), "taken"),
        "a PID beyond any process": (lambda p: p.write_text(json.dumps({"pid": 10**30})), "taken"),
        "a bare PID beyond any process": (lambda p: p.write_text("9" * 40), "taken"),
        "a bare PID in non-ASCII digits": (lambda p: p.write_text("\u00b2\u0663"), "taken"),
        "a PID of nested garbage": (lambda p: p.write_text(json.dumps({"pid": [{"a": None}], "host": {"x": 1}})),
                                    "taken"),
    }


LOCK_CASES = _lock_cases()


@pytest.mark.parametrize("flock", ["flock", "no flock", "flock held"])
@pytest.mark.parametrize("kind", list(LOCK_CASES))
def test_a_lock_file_of_any_kind_is_refused_in_one_line_or_taken_over(tmp_path, monkeypatch, kind, flock):
    """The run stops once the lock is taken (the ranks are not started): the lock alone is under test.
    ``flock held``: another process holds the directory's flock, so the lock file is only read to name it."""
    import errno

    import pretrain.runtime.launch as launch

    started = []
    monkeypatch.setattr(launch, "launch", lambda *a, **k: started.append(1))
    log = tmp_path / "run"
    log.mkdir()
    plant, outcome = LOCK_CASES[kind]
    plant(log / PID_FILE)
    held = None
    if flock == "no flock":
        def refuse(*args):
            raise OSError(errno.ENOLCK, "No locks available")

        monkeypatch.setattr(fcntl, "flock", refuse)
    elif flock == "flock held":
        held = os.open(log, os.O_RDONLY)  # another open file description: as another process's flock
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        outcome = "refused"
    try:
        before = snapshot(tmp_path)
        res = invoke_within_limit(runner, app, TRAIN + ["--set", f"log.dir={log}"])
    finally:
        if held is not None:
            os.close(held)
    if outcome == "refused":
        assert_one_error_line(res, kind)
        assert not started and snapshot(tmp_path) == before and os.path.lexists(log / PID_FILE)
    else:
        assert res.exit_code == 0 and started, (kind, res.output[-3000:])
        assert not os.path.lexists(log / PID_FILE)  # taken over, and released at the end


def test_a_metrics_log_edited_by_hand_keeps_its_lines_up_to_the_checkpoint_on_resume(workspace, tmp_path):
    """``log.jsonl`` is read back on resume (the steps up to the checkpoint are kept): lines that are not a
    step's record (wrong types, nested 10000 deep, not UTF-8) are dropped, never a traceback."""
    run = tmp_path / "run"
    shutil.copytree(workspace / "trained", run)
    good = (run / "log.jsonl").read_bytes()
    garbage = [b'{"step": "x"}', b"[" * DEEP, b"[1, 2]", b'{"step": [1]}', b'{"step": 9, "loss": NaN}', b"\xff\xfe"]
    (run / "log.jsonl").write_bytes(good + b"\n".join(garbage) + b"\n")
    res = invoke_within_limit(runner, app, TRAIN + ["--set", "checkpoint.resume=true", "--set", f"log.dir={run}"])
    assert res.exit_code == 0, res.output[-3000:]
    log = (run / "log.jsonl").read_bytes()
    assert log.startswith(good) and not any(g in log for g in garbage), log[-2000:]
    assert b'"step": 2' in log[len(good):]


@pytest.mark.parametrize("flock", ["flock", "no flock", "flock held"])
def test_a_lock_file_we_cannot_read_is_taken_over_only_under_flock(tmp_path, monkeypatch, flock):
    """Another user's lock file (mode 000; simulated: this test runs as root). Its holder cannot be told:
    the directory's flock says whether it is gone; without flock the run refuses in one line."""
    import errno

    import pretrain.runtime.launch as launch

    real_open, started = os.open, []

    def unreadable(path, flags, *args):  # the planted file (by its token), wherever it is renamed to
        fd = real_open(path, flags, *args)
        if PID_FILE in os.fspath(path) and not flags & os.O_CREAT and b'"token": "theirs"' in os.pread(fd, 4096, 0):
            os.close(fd)
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return fd

    monkeypatch.setattr(launch, "launch", lambda *a, **k: started.append(1))
    log = tmp_path / "run"
    log.mkdir()
    (log / PID_FILE).write_text(json.dumps({"pid": 1, "host": "here", "job": None, "token": "theirs"}))
    held = None
    if flock == "no flock":
        monkeypatch.setattr(fcntl, "flock", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOLCK, "No locks")))
    elif flock == "flock held":
        held = os.open(log, os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    monkeypatch.setattr(os, "open", unreadable)
    try:
        before = snapshot(tmp_path)
        res = invoke_within_limit(runner, app, TRAIN + ["--set", f"log.dir={log}"])
    finally:
        monkeypatch.setattr(os, "open", real_open)
        if held is not None:
            os.close(held)
    if flock == "flock":
        assert res.exit_code == 0 and started and not (log / PID_FILE).exists(), res.output[-3000:]
    else:
        assert_one_error_line(res, flock, "pretrain.pid is not readable by us")
        assert not started and snapshot(tmp_path) == before
