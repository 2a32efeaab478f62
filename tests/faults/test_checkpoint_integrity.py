"""A damaged checkpoint is never trained from (issue 38): every file a save writes is in its
``checksums.json``; a load checks the files each rank reads (only those) and refuses a mismatch on
every rank alike, in one line naming the file; ``[checkpoint].fallback`` resumes from the newest
intact checkpoint instead, and the resumed losses are bitwise the uninterrupted run's; a checkpoint
from before checksums still loads; ``pretrain verify`` checks offline (exit 0, or one line and 2; 3
for a checkpoint without checksums)."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from pretrain.cli import app

CONFIG = ["model.layers=2", "train.steps=4", "train.warmup_steps=1", "train.eval_every=0", "log.progress=false",
          "parallel.zero=optim_grads_params"]


def train_and_save(root: str) -> list[float]:
    """4 steps at every rank; step_2 saved in the background, step_4 synchronously. The 4 losses."""
    from pretrain.checkpoint import CheckpointSaver
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    trainer, background = Trainer(load_config(None, CONFIG)), CheckpointSaver(True)
    losses = []
    for step in range(4):
        losses.append(trainer.train_step(step).loss)
        if step == 1:
            background.save(trainer.checkpointed(), root, 2, keep=5)
    background.finish()
    trainer.save_checkpoint(root, 4, keep=5)
    return losses


def resume_and_train(root: str, fallback: bool, extra: tuple = ()) -> dict:
    """Resume from ``root`` as `pretrain train` does; the checkpoint taken, its note, the losses to step 4,
    and which files this rank hashed; or the error."""
    from pretrain.checkpoint import integrity
    from pretrain.checkpoint.resume import resume_latest
    from pretrain.config import load_config
    from pretrain.errors import UsageError
    from pretrain.training.train_loop import Trainer

    trainer, hashed, new_hash = Trainer(load_config(None, CONFIG + list(extra))), [], integrity.new_hash
    integrity.new_hash = lambda file: hashed.append(str(file.relative_to(root))) or new_hash(file)
    try:
        path, step, note = resume_latest(trainer.checkpointed(), __import__("pathlib").Path(root), fallback)
    except UsageError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        integrity.new_hash = new_hash
    return {"taken": path.name, "note": note, "hashed": hashed,
            "losses": [trainer.train_step(s).loss for s in range(step, 4)]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, dist_run):
    root = tmp_path_factory.mktemp("ck")
    losses = dist_run(2, train_and_save, str(root))
    assert losses[0] == losses[1]
    return root, losses[0]


def _copy(saved, tmp_path):
    root = tmp_path / "ck"
    shutil.copytree(saved[0], root)
    return root


def _flip_bit(file, at=0.5):
    data = bytearray(file.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    file.write_bytes(bytes(data))


def test_both_saves_list_every_file_and_an_intact_resume_hashes_only_what_the_rank_reads(saved, dist_run, tmp_path):
    root = _copy(saved, tmp_path)
    for step in (2, 4):
        files = json.loads((root / f"step_{step}" / "checksums.json").read_text())["files"]
        on_disk = sorted(str(p.relative_to(root / f"step_{step}")) for p in (root / f"step_{step}").rglob("*")
                         if p.is_file() and p.name != "checksums.json")
        assert sorted(files) == on_disk and "__1_0.distcp" in files and "rng/rank_1.pt" in files
    got = dist_run(2, resume_and_train, str(root), False)
    assert [g.get("taken") for g in got] == ["step_4", "step_4"] and got[0]["note"] == "", got
    index = {"trainer_state.json", ".metadata"}  # every rank checks the small index files
    own = [index | {f"__{r}_0.distcp", f"rng/rank_{r}.pt"} for r in range(2)]
    assert [sorted(g["hashed"]) for g in got] == [sorted(f"step_4/{n}" for n in names) for names in own]  # each rank reads its own ZeRO shard only


DAMAGE = {  # what is done to step_4 -> what the one line says
    "bit flipped in a shard": (lambda d: _flip_bit(d / "__1_0.distcp"), "__1_0.distcp does not match its sha256"),
    "bit flipped in a shard's first bytes (not deserialisable)": (lambda d: _flip_bit(d / "__1_0.distcp", 0.0),
                                                                 "__1_0.distcp does not match its sha256"),
    "truncated shard": (lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:-1]),
                        "__0_0.distcp has "),
    "missing RNG file": (lambda d: (d / "rng" / "rank_1.pt").unlink(), "rng/rank_1.pt is missing"),
    "foreign shard (another save's)": (lambda d: shutil.copy(d.parent / "step_2" / "__1_0.distcp", d / "__1_0.distcp"),
                                       "__1_0.distcp "),
    "bit flipped in trainer_state.json": (lambda d: _flip_bit(d / "trainer_state.json", 0.3),
                                          "trainer_state.json does not match"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damage_is_refused_in_one_line_or_falls_back_to_the_intact_checkpoint(saved, dist_run, tmp_path, case):
    root = _copy(saved, tmp_path)
    damage, words = DAMAGE[case]
    damage(root / "step_4")
    refused = dist_run(2, resume_and_train, str(root), False)
    assert refused[0] == refused[1], refused  # every rank stops alike, whichever rank read the file
    error = refused[0]["error"]
    assert error.startswith(f"DamagedCheckpoint: checkpoint {root / 'step_4'} is damaged: ") and words in error, error
    assert "\n" not in error and "fallback = true" in error
    took = dist_run(2, resume_and_train, str(root), True)
    assert [t["taken"] for t in took] == ["step_2", "step_2"] and words in took[0]["note"], took
    assert took[0]["losses"] == took[1]["losses"] == saved[1][2:]  # bitwise the uninterrupted run's steps 3, 4


def test_no_intact_checkpoint_to_fall_back_to_is_one_line(saved, dist_run, tmp_path):
    root = _copy(saved, tmp_path)
    _flip_bit(root / "step_4" / "__0_0.distcp")
    _flip_bit(root / "step_2" / ".metadata")
    error = dist_run(2, resume_and_train, str(root), True)[0]["error"]
    assert "step_4 is damaged: __0_0.distcp" in error and "no intact checkpoint" in error and "(nor is step_2)" in error


def test_a_checkpoint_without_checksums_is_refused_unless_verify_is_off_then_loads_and_says_so(saved, dist_run,
                                                                                                   tmp_path):
    root, off = _copy(saved, tmp_path), ("checkpoint.verify=false",)
    (root / "step_4" / "checksums.json").unlink()
    error = dist_run(2, resume_and_train, str(root), False)[0]["error"]  # issue 49: it used to load, unverified
    assert "step_4 is damaged: checksums.json is missing" in error and "[checkpoint].verify = false" in error, error
    assert "\n" not in error
    got = dist_run(2, resume_and_train, str(root), False, off)
    assert got[0]["taken"] == "step_4" and "loaded unverified" in got[0]["note"] and got[0]["hashed"] == []
    (root / "step_4" / "__1_0.distcp").write_bytes((root / "step_4" / "__1_0.distcp").read_bytes()[:1000])
    error = dist_run(2, resume_and_train, str(root), False, off)[0]["error"]
    assert "step_4 is damaged: __1_0.distcp has 1000 bytes, its index needs" in error and "\n" not in error


def test_verify_checks_offline_exit_0_or_one_line_and_2(saved, tmp_path):
    root, runner = _copy(saved, tmp_path), CliRunner()
    res = runner.invoke(app, ["verify", str(root)])
    assert res.exit_code == 0 and res.stdout.count("ok: ") == 2 and "match their sha256 checksums" in res.stdout
    _flip_bit(root / "step_4" / "rng" / "rank_0.pt")
    res = runner.invoke(app, ["verify", str(root / "step_4")])
    assert res.exit_code == 2 and res.stdout == "", res.output
    assert res.stderr == f"error: checkpoint {root / 'step_4'} is damaged: rng/rank_0.pt does not match its sha256 " \
                         f"checksum\n"
    (root / "step_2" / "checksums.json").unlink()
    res = runner.invoke(app, ["verify", str(root / "step_2")])
    assert res.exit_code == 3 and res.stdout == "" and res.stderr.count("\n") == 1, res.output  # never "ok:"
    assert res.stderr.startswith("error: ") and "no checksums.json" in res.stderr and "not verified" in res.stderr
    res = runner.invoke(app, ["verify", str(tmp_path)])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "not a checkpoint" in res.stderr
