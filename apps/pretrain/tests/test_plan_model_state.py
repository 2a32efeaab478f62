"""`pretrain plan --params N --dp D`: the explainer's worked ZeRO example (issue 54), the trainer's
default, the HSDP row, bad values, and the README's copy of the example's output."""

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pretrain.cli import app

runner = CliRunner()
README = Path(__file__).resolve().parents[3] / "README.md"
EXPLAINER = ["--params", "7e9", "--dp", "8", "--param-bytes", "2", "--grad-bytes", "2", "--optim-bytes", "8"]


def plan_rows(*args):
    """{label: (GB, percent of DDP)} as printed."""
    res = runner.invoke(app, ["plan", *args])
    assert res.exit_code == 0, res.output
    rows = re.findall(r"^  (\S+(?: \S+)?) \(\S+\)\s+(\S+) GB\s+(\S+) % of DDP", res.stdout, flags=re.M)
    return {label: (gb, pct) for label, gb, pct in rows}


def test_the_explainers_7b_example_at_d8():
    # P = 14, G = 14, O = 56 GB: baseline 84, ZeRO-1/2/3 35 / 22.75 / 10.5 GB = 41.7 / 27.1 / 12.5 %
    assert plan_rows(*EXPLAINER) == {"DDP": ("84", "100"), "ZeRO-1": ("35", "41.7"), "ZeRO-2": ("22.75", "27.1"),
                                     "ZeRO-3": ("10.5", "12.5")}


@pytest.mark.parametrize("dp, replicas", [(8, 1), (64, 8), (16, 2)])
def test_hsdp_fraction_is_one_over_h_at_h8(dp, replicas):
    args = [*EXPLAINER[:2], "--dp", str(dp), *EXPLAINER[4:], "--hsdp-replicas", str(replicas)]
    rows = plan_rows(*args)
    assert rows[f"HSDP {replicas}x8"] == ("10.5", "12.5") and rows["DDP"] == ("84", "100")
    out = json.loads(runner.invoke(app, ["plan", *args, "--json"]).stdout)
    assert out["detail"]["hsdp"]["fraction"] == 1 / 8 and out["model_state_gb"]["hsdp"] == 10.5


def test_the_default_keeps_the_trainers_convention():
    assert plan_rows("--params", "7e9", "--dp", "8") == {"DDP": ("126", "100"), "ZeRO-1": ("52.5", "41.7"),
                                                         "ZeRO-2": ("28", "22.2"), "ZeRO-3": ("15.75", "12.5")}
    explicit = plan_rows("--params", "7e9", "--dp", "8", "--param-bytes", "2", "--grad-bytes", "4", "--optim-bytes", "12")
    assert explicit == plan_rows("--params", "7e9", "--dp", "8")
    out = json.loads(runner.invoke(app, ["plan", "--params", "7e9", "--dp", "8", "--json"]).stdout)
    assert out["model_state_gb"] == {"no_shard": 126, "optim": 52.5, "optim_grads": 28, "optim_grads_params": 15.75}
    assert out["bytes_per_param"] == {"params": 2, "grads": 4, "optim": 12} and "hsdp" not in out["detail"]


def test_the_readme_shows_the_explainers_example_and_its_real_output():
    block = re.search(r"```bash\nuv run pretrain plan (--params 7e9 --dp 8 --param-bytes [^\n]*)\n```\n\n```text\n(.*?)```",
                      README.read_text(), flags=re.S)
    assert block, "README: the explainer's example and its output"
    res = runner.invoke(app, ["plan", *block.group(1).split()])
    assert res.exit_code == 0 and res.stdout == block.group(2)
    assert "35 GB  41.7 %" in res.stdout and "22.75 GB  27.1 %" in res.stdout and "HSDP 1x8 (h=8)" in res.stdout


@pytest.mark.parametrize("args, message", [
    (["--param-bytes", "-2"], "--param-bytes -2 must be a finite number > 0"),
    (["--param-bytes", "0"], "--param-bytes 0 must be a finite number > 0"),
    (["--grad-bytes", "nan"], "--grad-bytes nan must be a finite number >= 0"),
    (["--optim-bytes", "inf"], "--optim-bytes inf must be a finite number >= 0"),
    (["--optim-bytes", "-1"], "--optim-bytes -1 must be a finite number >= 0"),
    (["--hsdp-replicas", "3"], "--hsdp-replicas 3 must be >= 1 and divide --dp 8"),
    (["--hsdp-replicas", "0"], "--hsdp-replicas 0 must be >= 1 and divide --dp 8"),
    (["--hsdp-replicas", "-8"], "--hsdp-replicas -8 must be >= 1 and divide --dp 8"),
    (["--params", "nan"], "--params nan must be a finite number in (0, 1e+16]"),
    (["--params", "inf"], "--params inf must be a finite number in (0, 1e+16]"),
    (["--dp", "0"], "--dp 0 must be a finite number in [1, 131072]"),
])
def test_bad_values_are_one_error_line_and_exit_2(args, message):
    base = {"--params": "7e9", "--dp": "8"}
    base.update(zip(args[::2], args[1::2]))
    res = runner.invoke(app, ["plan", *[w for kv in base.items() for w in kv]])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and lines == [f"error: {message}"], res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("args", [["--hsdp-replicas", "2"], ["--grad-bytes", "2"], ["tiny", "--optim-bytes", "8"]])
def test_bytes_and_hsdp_options_need_the_params_form(args):
    res = runner.invoke(app, ["plan", *args])
    assert res.exit_code == 2 and res.stderr.startswith("error: --param-bytes, --grad-bytes, --optim-bytes and "
                                                        "--hsdp-replicas go with --params N --dp D")
    assert len(res.stderr.strip().splitlines()) == 1
