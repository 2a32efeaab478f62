"""`pretrain groups`: JSON of every group, a per-node table, one-line errors with exit code 2."""

import json

from typer.testing import CliRunner

from pretrain.cli import app

runner = CliRunner()


def test_json_prints_dense_expert_and_hcp_groups():
    res = runner.invoke(app, ["groups", "--world", "16", "--tp", "2", "--cp", "2", "--pp", "2", "--ep", "2", "--etp", "1", "--hcp", "2,1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out) == {"dense", "expert", "hcp"}
    assert set(out["dense"]) == {"tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-cp", "tp-dp-cp"}
    assert set(out["expert"]) == {"tp", "ep", "dp", "tp-ep", "tp-ep-pp"}
    assert out["dense"]["tp"][0] == [0, 1] and out["dense"]["pp"][0] == [0, 8]
    assert out["expert"]["ep"][0] == [0, 1] and out["expert"]["dp"][0] == [0, 2, 4, 6]
    assert out["hcp"][0][0] == [0, 2]


def test_table_groups_ranks_by_node():
    res = runner.invoke(app, ["groups", "--world", "16", "--tp", "2", "--pp", "2", "--gpus-per-node", "8"])
    assert res.exit_code == 0
    assert "node 0:" in res.stdout and "node 1:" in res.stdout and "hcp" not in res.stdout


def test_bad_layout_is_one_line_and_exit_code_2():
    res = runner.invoke(app, ["groups", "--world", "10", "--tp", "4"])
    assert res.exit_code == 2
    assert res.stderr.strip() == "error: world_size=10 is not divisible by tp*cp*pp=4*1*1=4"
    assert "Traceback" not in res.output
