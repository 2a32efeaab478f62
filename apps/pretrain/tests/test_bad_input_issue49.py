"""Issue 49's bad inputs, as the bad-input sweep runs them: exit 2, exactly one ``error:`` line naming
the value (the words listed with each case), no traceback, no hang, and no file in the prepared
directory changed (names and bytes; a secret file outside the run included)."""

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pretrain.cli import app

from one_error_line import assert_one_error_line, invoke_within_limit, snapshot

runner = CliRunner()
TRAIN = ["train", "--nproc", "1", "--set", "model.layers=1", "--set", "train.steps=2", "--set", "train.warmup_steps=1",
         "--set", "train.eval_every=0", "--set", "log.progress=false", "--set", "log.dir=run"]
HF = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 8,
      "num_key_value_heads": 4, "intermediate_size": 128}


def _retarget(ck: Path, data_path: str) -> None:
    """Point checkpoint ``ck``'s recorded config at ``data_path`` (its checksums rewritten to match)."""
    from pretrain.checkpoint.integrity import digests, write_checksums

    state = json.loads((ck / "trainer_state.json").read_text())
    state["config"]["data"]["path"] = data_path
    (ck / "trainer_state.json").write_text(json.dumps(state))
    (ck / "checksums.json").unlink()
    write_checksums(ck, digests(ck, sorted(p.name for p in ck.glob("*.distcp"))))


def _hf_dir(w: Path, name: str, config: dict, weights: bool = True) -> Path:
    from safetensors.torch import save_file

    from pretrain.config import load_config
    from pretrain.model.initial_state import init_full_state

    (w / name).mkdir()
    (w / name / "config.json").write_text(json.dumps(config))
    if weights:
        model = load_config(None, ["model.layers=1", "model.vocab_size=256"]).model
        save_file(dict(init_full_state(model, 1)), str(w / name / "model.safetensors"))
    return w / name


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from pretrain.checkpoint.hf import import_hf
    from pretrain.data import write_dataset

    w = tmp_path_factory.mktemp("issue49")
    (w / "secret.txt").write_text("API_KEY=do-not-export\n")
    write_dataset(w / "data" / "good", [list(range(1, 200))] * 10, 256)
    write_dataset(w / "data" / "evil", [list(range(1, 200))] * 10, 256)
    header = json.loads((w / "data" / "evil.json").read_text())
    (w / "data" / "evil.json").write_text(json.dumps(header | {"tokenizer": str(w / "secret.txt")}))
    import_hf(_hf_dir(w, "hf_good", HF), w / "ck_evil")
    _retarget(w / "ck_evil", str(w / "data" / "evil"))
    _checkpoints(w)
    rope = {"rope_type": "llama3", "factor": float("inf"), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    for name, cfg in {"hf_rope_inf": HF | {"rope_scaling": rope}, "hf_eps_nan": HF | {"rms_norm_eps": float("nan")},
                      "hf_layer_types_5": HF | {"layer_types": 5}}.items():
        _hf_dir(w, name, cfg, weights=name == "hf_rope_inf")  # weights: main imported it (exit 0)
    _hf_dir(w, "hf_theta_1e400", HF, weights=False)
    (w / "hf_theta_1e400" / "config.json").write_text(json.dumps(HF)[:-1] + ', "rope_theta": 1e400}')
    _later_items(w)
    _other_surfaces(w)
    return w


def _other_surfaces(w: Path) -> None:
    """Beyond the list: damaged safetensors in an HF import; flight records that are missing, empty or garbage."""
    import struct

    good = (w / "hf_good" / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", good[:8])[0]
    header = good[8:8 + n].decode()
    damage = {"hf_st_truncated": good[: len(good) // 2], "hf_st_header_len": struct.pack("<Q", 1 << 62) + good[8:],
              "hf_st_header_cut": good[: 8 + n // 2], "hf_st_empty": b"",
              "hf_st_dtype": good[:8] + header.replace('"F32"', '"F64"').encode() + good[8 + n:],
              "hf_st_offsets": good[:8] + header.replace('"data_offsets":[0,', '"data_offsets":[4,', 1).encode()
              + good[8 + n:]}
    for name, data in damage.items():
        _hf_dir(w, name, HF, weights=False)
        (w / name / "model.safetensors").write_bytes(data)
    for name, records in {"hang_empty": {}, "hang_garbage": {"rank_0.json": b"not json"},
                          "hang_binary": {"rank_0.json": bytes(range(256))},
                          "hang_list": {"rank_0.json": b"[1, 2]"},
                          "hang_entries": {"rank_0.json": b'{"rank": 0, "time": 1, "entries": 5}'},
                          "hang_huge_rank": {"rank_0.json": json.dumps({"rank": 0, "time": 1, "entries": [], "in_flight": {
                              "seq": 1, "op": "all_reduce", "group": "world", "ranks": [0, 10**9], "bytes": 4, "peer": None}}).encode()}
                          }.items():
        (w / name / "flight").mkdir(parents=True)
        for file, data in records.items():
            (w / name / "flight" / file).write_bytes(data)


def _later_items(w: Path) -> None:
    """Items 12-14: a flight directory that is a file or a symlink, JSONL that is no text, logs that are no logs."""
    (w / "run_flight_file").mkdir()
    (w / "run_flight_file" / "flight").write_text("a file where the flight records go\n")
    (w / "run_flight_link").mkdir()
    (w / "run_flight_link" / "flight").symlink_to(w / "data")
    (w / "deep.jsonl").write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    (w / "surrogate.jsonl").write_text('{"text": "fine"}\n{"text": "a\\ud800b"}\n')
    for name, content in {"rep_binary": bytes(range(256)) * 4, "rep_string_loss": b'{"step": 1, "loss": "abc"}\n',
                          "rep_null_loss": b'{"step": 1, "loss": 2.0}\n{"step": 2, "loss": null}\n',
                          "rep_string_step": b'{"step": "1", "loss": 2.0}\n'}.items():
        (w / name).mkdir()
        (w / name / "log.jsonl").write_bytes(content)


def _checkpoints(w: Path) -> None:
    """Items 3 and 4: checksums naming a file outside the checkpoint; a checkpoint without checksums."""
    import shutil

    from pretrain.checkpoint.integrity import digest

    (w / "outside.txt").write_text("not the checkpoint's\n")
    for name in ("ck_sums_escape", "ck_sums_absolute", "ck_no_sums"):
        shutil.copytree(w / "ck_evil", w / name)
        _retarget(w / name, str(w / "data" / "good"))
    for name, entry in (("ck_sums_escape", "../outside.txt"), ("ck_sums_absolute", str(w / "outside.txt"))):
        sums = json.loads((w / name / "checksums.json").read_text())
        sums["files"][entry] = digest(w / "outside.txt")
        (w / name / "checksums.json").write_text(json.dumps(sums))
    (w / "ck_no_sums" / "checksums.json").unlink()


CASES = {  # name -> (arguments, words the one line must hold)
    # 2: a dataset header naming a file outside the run as its tokenizer
    "export copies a header's secret file": (["convert", "--to-hf", "out_hf", "--checkpoint", "ck_evil"],
                                             "secret.txt' named by"),
    # 3: checksums.json naming files outside the checkpoint
    "verify checksums naming ../": (["verify", "ck_sums_escape"], "names '../outside.txt', which is not a file inside"),
    "verify checksums naming /abs": (["verify", "ck_sums_absolute"], "outside.txt', which is not a file inside"),
    "train init_from checksums naming ../": (TRAIN + ["ck_evil/config.toml", "--set", "checkpoint.init_from=ck_sums_escape"],
                                             "names '../outside.txt'"),
    # 4: a checkpoint whose checksums.json is gone
    "train init_from without checksums": (TRAIN + ["ck_evil/config.toml", "--set", "checkpoint.init_from=ck_no_sums"],
                                          "checksums.json is missing, so its files cannot be verified"),
    # 9, 15: Hugging Face configs with non-finite numbers, a layer_types that is no list
    "import RoPE factor Infinity": (["convert", "--from-hf", "hf_rope_inf", "--out", "ck_new"],
                                    "rope_scaling.factor=Infinity is not a finite number"),
    "import rms_norm_eps NaN": (["convert", "--from-hf", "hf_eps_nan", "--out", "ck_new"], "rms_norm_eps=NaN is not a"),
    "import rope_theta 1e400": (["convert", "--from-hf", "hf_theta_1e400", "--out", "ck_new"], "rope_theta=1e400 is not"),
    "import layer_types 5": (["convert", "--from-hf", "hf_layer_types_5", "--out", "ck_new"],
                             "layer_types=5 must be a list of layer type names"),
    # 10, 11: plan's numeric options finite and in range; absurd model sizes refused before any work
    "plan gpu-memory inf": (["plan", "--gpu-memory", "inf"], "--gpu-memory inf must be a finite number in (0, "),
    "plan gpu-memory nan": (["plan", "--gpu-memory", "nan"], "--gpu-memory nan must be a finite number"),
    "plan peak-tflops nan": (["plan", "--auto", "--world", "8", "--topology", "dgx-h100", "--peak-tflops", "nan"],
                             "--peak-tflops nan must be a finite number in [0, "),
    "plan efficiency 0": (["plan", "--auto", "--world", "8", "--topology", "dgx-h100", "--efficiency", "0"],
                          "--efficiency 0 must be a finite number in (0, 1]"),
    "plan expert-imbalance nan": (["plan", "--simulate", "--expert-imbalance", "nan"], "--expert-imbalance nan must be"),
    "plan layers 1e12": (["plan", "--world", "8", "--set", "model.layers=1000000000000"],
                         "[model].layers=1000000000000 is more than 10,000"),
    "plan hidden 2**40": (["plan", "--set", "model.hidden=1099511627776"], "[model].hidden=1099511627776 is more than"),
    # 12: the flight-record directory checked before launch, like log.dir
    "train flight dir is a file": (TRAIN[:-1] + ["log.dir=run_flight_file"], "'run_flight_file/flight' is not a writable"),
    "train flight dir is a symlink": (TRAIN[:-1] + ["log.dir=run_flight_link"], "'run_flight_link/flight' is a symlink"),
    # 13: prepare, JSONL that is no text
    "prepare deeply nested jsonl": (["prepare", "deep.jsonl", "--out", "data/x"], "deep.jsonl:1 is nested too deeply"),
    "prepare lone surrogate": (["prepare", "surrogate.jsonl", "--out", "data/x"],
                               "surrogate.jsonl:2: field \"text\" holds a lone surrogate '\\ud800'"),
    # 14: report, logs that are no logs
    "report binary log": (["report", "rep_binary"], "log.jsonl is not UTF-8 text (byte 128)"),
    "report string loss": (["report", "rep_string_loss"], "log.jsonl:1 has loss='abc', step=1"),
    "report null loss": (["report", "rep_null_loss"], "log.jsonl:2 has loss=None, step=2"),
    "report string step": (["report", "rep_string_step"], "log.jsonl:1 has loss=2.0, step='1'"),
    # beyond the list: damaged safetensors in an HF import
    "import truncated safetensors": (["convert", "--from-hf", "hf_st_truncated", "--out", "ck_new"],
                                     "hf_st_truncated/model.safetensors"),
    "import safetensors header length 2**62": (["convert", "--from-hf", "hf_st_header_len", "--out", "ck_new"],
                                               "hf_st_header_len/model.safetensors"),
    "import safetensors header cut": (["convert", "--from-hf", "hf_st_header_cut", "--out", "ck_new"],
                                      "hf_st_header_cut/model.safetensors"),
    "import empty safetensors": (["convert", "--from-hf", "hf_st_empty", "--out", "ck_new"], "hf_st_empty/model.safetensors"),
    "import safetensors dtype lies": (["convert", "--from-hf", "hf_st_dtype", "--out", "ck_new"],
                                      "hf_st_dtype/model.safetensors"),
    "import safetensors offsets shifted": (["convert", "--from-hf", "hf_st_offsets", "--out", "ck_new"],
                                           "hf_st_offsets/model.safetensors"),
    # beyond the list: `pretrain hang` on missing or garbage records
    "hang missing dir": (["hang", "nosuch"], "'nosuch' is not a directory"),
    "hang garbage record": (["hang", "hang_garbage"], "rank_0.json is not a flight record pretrain wrote"),
    "hang binary record": (["hang", "hang_binary"], "rank_0.json is not a flight record pretrain wrote"),
    "hang list record": (["hang", "hang_list"], "rank_0.json is not a flight record pretrain wrote"),
    "hang entries not a list": (["hang", "hang_entries"], "rank_0.json is not a flight record pretrain wrote"),
    "hang rank 10**9": (["hang", "hang_huge_rank"], "rank_0.json is not a flight record pretrain wrote"),
    # 8: evaluating on training data
    "eval_blend is the training blend": (TRAIN + ["--set", 'data.blend=[[1, "data/good"], [2, "data/evil"]]', "--set",
                                                  'data.eval_blend=[[1, "data/good"], [2, "data/evil"]]'],
                                         "[data].eval_blend source 'data/good' is also a training source"),
    "eval_path is the training path": (TRAIN + ["--set", "data.path=data/good", "--set", "data.eval_path=./data/../data/good"],
                                       "[data].eval_path source './data/../data/good' is also a training source"),
    "eval_path is one blend source": (TRAIN + ["--set", 'data.blend=[[1, "data/good"], [2, "data/evil"]]', "--set",
                                               "data.eval_path=data/evil"], "'data/evil' is also a training source"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_exit_2(workspace, monkeypatch, name):
    args, words = CASES[name]
    monkeypatch.chdir(workspace)
    before = snapshot(workspace)
    res = invoke_within_limit(runner, app, args)  # a hang fails this case instead of the whole run
    assert_one_error_line(res, name, words)
    assert snapshot(workspace) == before, name


def test_export_copies_the_tokenizer_prepare_recorded(workspace, tmp_path):
    from pretrain.checkpoint.hf import export_hf, import_hf

    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"a tokenizer": true}')
    header = json.loads((workspace / "data" / "good.json").read_text())
    header |= {"tokenizer": str(tok), "tokenizer_sha256": hashlib.sha256(tok.read_bytes()).hexdigest()}
    (tmp_path / "data.json").write_text(json.dumps(header))
    for name in ("bin", "idx"):
        (tmp_path / f"data.{name}").write_bytes((workspace / "data" / f"good.{name}").read_bytes())
    import_hf(workspace / "hf_good", tmp_path / "ck")
    _retarget(tmp_path / "ck", str(tmp_path / "data"))
    assert (export_hf(tmp_path / "ck", tmp_path / "out")[0] / "tokenizer.json").read_bytes() == tok.read_bytes()
    tok.write_text('{"another tokenizer": true}')
    res = runner.invoke(app, ["convert", "--to-hf", str(tmp_path / "out2"), "--checkpoint", str(tmp_path / "ck")])
    assert res.exit_code == 2 and "does not match the sha256" in res.stderr, res.output
    res = runner.invoke(app, ["convert", "--to-hf", str(tmp_path / "out2"), "--checkpoint", str(tmp_path / "ck"),
                              "--no-tokenizer"])
    assert res.exit_code == 0 and not (tmp_path / "out2" / "tokenizer.json").exists(), res.output


def test_blend_weights_too_large_to_sum_keep_their_shares(workspace, monkeypatch):
    """Item 7: [1e308, 1e308] overflowed the sum and trained on source A only (share 1.0 / 0.0)."""
    import warnings

    from pretrain.data.blend import normalised

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow RuntimeWarning included
        assert normalised([1e308, 1e308]) == [0.5, 0.5]
        assert normalised([1.7e308, 1.7e308, 1e308]) == pytest.approx([1.7 / 4.4, 1.7 / 4.4, 1 / 4.4])
    assert normalised([0.3, 0.7]) == [0.3, 0.7]  # unchanged where the sum is finite
    monkeypatch.chdir(workspace)
    res = runner.invoke(app, ["train", *TRAIN[1:-2], "--set", "log.dir=run_blend", "--set", "train.steps=4", "--set",
                              "model.vocab_size=256", "--set", 'data.blend=[[1e308, "data/good"], [1e308, "data/evil"]]'])
    assert res.exit_code == 0, res.output
    last = json.loads((workspace / "run_blend" / "log.jsonl").read_text().splitlines()[-1])
    assert last["data_share"] == pytest.approx({"data/good": 0.5, "data/evil": 0.5}, abs=0.13), last


def test_report_draws_a_log_whose_lines_carry_part_of_the_timing_keys(tmp_path):
    """Item 14: a line with only part of the timing keys was a KeyError; now the plot has no breakdown."""
    lines = [{"step": 1, "loss": 3.0, "step_time_s": 0.1, "time_data_s": 0.01, "time_fwd_bwd_s": 0.08,
              "tokens_per_s": "fast", "mfu": None},
             {"step": 2, "loss": 2.5, "step_time_s": 0.1, "time_fwd_bwd_s": 0.07}]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 0 and "2 steps, loss 3.0000 -> 2.5000" in res.stdout, (res.output, res.exception)
    assert (tmp_path / "report.png").stat().st_size > 0 and (tmp_path / "report.html").is_file()


def test_wandb_without_a_key_is_one_line_before_launch(workspace, tmp_path, monkeypatch):
    """Item 16: was `rank 0 failed: UsageError: No API key configured`, exit 1."""
    pytest.importorskip("wandb")
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.chdir(workspace)
    before = snapshot(workspace)
    res = runner.invoke(app, TRAIN[:-1] + ["log.dir=run_wandb", "--set", "log.wandb=true"])
    lines = res.stderr.splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.output, (res.output, res.exception)
    assert "no W&B API key is configured" in lines[0] and "WANDB_MODE=offline" in lines[0]
    assert snapshot(workspace) == before
    (tmp_path / "no-netrc").write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    (tmp_path / "no-netrc").chmod(0o600)
    from pretrain.training.preflight import _wandb_can_log

    assert _wandb_can_log()
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert _wandb_can_log()


def test_hang_on_an_empty_flight_dir_says_no_hang(workspace):
    res = runner.invoke(app, ["hang", str(workspace / "hang_empty")])
    assert res.exit_code == 0 and res.stdout.startswith("no hang recorded (no flight records in"), res.output
