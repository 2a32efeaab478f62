"""`pretrain schedule`: the explainer's tables verbatim, JSON fields, one-line errors."""

import json

import pytest
from typer.testing import CliRunner

from pretrain.cli import app

runner = CliRunner()

EXPLAINER_1F1B_P4_M7 = """\
Time:   00 01 02 03 04 05 06 07 08 09 10 11 12 13 14 15 16 17 18 19
GPU 0:  F0 F1 F2 F3 .. .. .. B0 F4 B1 F5 B2 F6 B3 .. B4 .. B5 .. B6
GPU 1:  .. F0 F1 F2 .. .. B0 F3 B1 F4 B2 F5 B3 F6 B4 .. B5 .. B6 ..
GPU 2:  .. .. F0 F1 .. B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 .. B6 .. ..
GPU 3:  .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 .. .. .."""

EXPLAINER_1F1B_P4_M1 = """\
Time:   00 01 02 03 04 05 06 07
GPU 0:  F0 .. .. .. .. .. .. B0
GPU 1:  .. F0 .. .. .. .. B0 ..
GPU 2:  .. .. F0 .. .. B0 .. ..
GPU 3:  .. .. .. F0 B0 .. .. .."""

EXPLAINER_GPIPE_P4_M4 = """\
Time:   00 01 02 03 04 05 06 07 08 09 10 11 12 13
GPU 0:  F0 F1 F2 F3 .. .. .. .. .. .. B3 B2 B1 B0
GPU 1:  .. F0 F1 F2 F3 .. .. .. .. B3 B2 B1 B0 ..
GPU 2:  .. .. F0 F1 F2 F3 .. .. B3 B2 B1 B0 .. ..
GPU 3:  .. .. .. F0 F1 F2 F3 B3 B2 B1 B0 .. .. .."""


@pytest.mark.parametrize(
    "name,m,table", [("1f1b", 7, EXPLAINER_1F1B_P4_M7), ("1f1b", 1, EXPLAINER_1F1B_P4_M1), ("gpipe", 4, EXPLAINER_GPIPE_P4_M4)]
)
def test_prints_the_explainer_tables_exactly(name, m, table):
    res = runner.invoke(app, ["schedule", "--pp", "4", "--microbatches", str(m), "--schedule", name])
    assert res.exit_code == 0, res.output
    assert "\n" + table + "\n" in res.stdout


def test_bubble_and_peak_activations_lines():
    res = runner.invoke(app, ["schedule", "--pp", "4", "--microbatches", "7", "--schedule", "1f1b"])
    assert "bubble fraction: 0.300 (per rank: 0.300 0.300 0.300 0.300)" in res.stdout  # 3/(7+3)
    assert "peak activations per rank: 4 3 2 1" in res.stdout


def test_json_object_with_timeline_per_rank():
    res = runner.invoke(app, ["schedule", "--pp", "2", "--microbatches", "4", "--schedule", "zb-h1", "--costs", "f=1,b=1,w=1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["makespan"] == 13  # 3m + (p-1)(F+B-W) = 12 + 1
    assert out["bubble_fraction"] == pytest.approx(1 / 13)
    assert out["peak_activations"] == [2, 1]
    first = out["ranks"][0][0]
    assert {k: first[k] for k in ("type", "microbatch", "chunk", "start", "end")} == {"type": "F", "microbatch": 0, "chunk": 0, "start": 0, "end": 1}
    assert sum(a["type"] == "W" for a in out["ranks"][1]) == 4


def test_interleaved_uses_vpp_and_bad_input_is_one_line_exit_2():
    res = runner.invoke(app, ["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved", "--vpp", "2", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["vpp"] == 2
    res = runner.invoke(app, ["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved"])
    assert res.exit_code == 2
    assert res.stderr.strip() == "error: interleaved needs vpp >= 2 chunks per rank (got vpp=1); use 1f1b for vpp=1"
    res = runner.invoke(app, ["schedule", "--pp", "4", "--microbatches", "8", "--costs", "f=x"])
    assert res.exit_code == 2 and "Traceback" not in res.output and res.stderr.strip() == "error: cost f='x' is not a number"
