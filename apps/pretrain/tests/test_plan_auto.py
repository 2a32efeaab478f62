"""`pretrain plan --auto` gives the known answers (each search well under 60 s).

* Llama-3-8B on one DGX-H100 keeps tp inside the node; Llama-3-70B on 8 nodes never puts tp
  across nodes; a 1B model trains with plain data parallelism (ZeRO-1 at most);
* DeepSeek-V3 on 2048 GPUs keeps every ep group inside an NVLink domain where the experts fit
  in one (GB200 racks run as 64-GPU domains); on DGX-H100 nodes 8 GPUs cannot hold the experts
  without ZeRO-3, and it crosses the network, as DeepSeek's own run did (ep 64 over 8 nodes).
"""

import json

import pytest
from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.config import load_config
from pretrain.planner.auto import auto_plan

GB200_64 = """# GB200 NVL72 racks run as 64-GPU NVLink domains (16 trays of 4 GPUs; the spare trays idle)
preset = "nvl72"
gpus_per_node = 4
nvlink_domain_gpus = 64
"""


def plan(name, world, topology):
    result = auto_plan(load_config(name), world, topology)
    assert result["search_seconds"] < 60 and len(result["best"]) == 5
    return result


def test_llama3_8b_on_one_node_keeps_tp_inside_it():
    best = plan("llama3-8b", 8, "dgx-h100")["best"]
    for row in best:
        assert row["layout"]["tp"] <= 8 and row["links"].get("tp", "nvlink") == "nvlink"
        assert row["memory_gb"] <= 72


def test_llama3_70b_on_eight_nodes_never_puts_tp_across_nodes():
    best = plan("llama3-70b", 64, "dgx-h100")["best"]
    for row in best:
        assert row["layout"]["tp"] <= 8 and row["links"].get("tp", "nvlink") == "nvlink", row
    assert best[0]["step_s"] <= best[-1]["step_s"] and "slower" in best[1]["why"]


def test_1b_model_trains_with_plain_data_parallelism():
    first = plan("llama3.2-1b", 8, "dgx-h100")["best"][0]["layout"]
    assert (first["tp"], first["cp"], first["pp"], first["dp"]) == (1, 1, 1, 8)
    assert first["zero"] in ("no_shard", "optim")


def test_deepseek_v3_keeps_ep_inside_nvlink_domains_that_hold_the_experts(tmp_path):
    path = tmp_path / "gb200-64.toml"
    path.write_text(GB200_64)
    first = plan("deepseek-v3", 2048, str(path))["best"][0]
    assert first["layout"]["ep"] > 1 and first["links"]["ep"] == "nvlink", first


def test_deepseek_v3_on_dgx_h100_crosses_nodes_because_8_gpus_cannot_hold_the_experts():
    from pretrain.planner.estimate import Shape
    from pretrain.planner.search import model_state

    cfg = load_config("deepseek-v3")
    result = plan("deepseek-v3", 2048, "dgx-h100")
    budget = result["assumptions"]["memory_budget_gb"] * 1e9
    for tp in (1, 2, 4, 8):  # every ep <= 8 layout needs ZeRO-3 to hold its 256 / ep experts per layer
        state = model_state(cfg, Shape(tp=tp, cp=1, pp=1, ep=8 // tp, etp=1, schedule="1f1b", vpp=1, world=2048))
        assert state["optim_grads"]["total"] > budget
    assert result["best"][0]["links"]["ep"] == "network"


def test_cli_auto_prints_json_and_bad_input_is_one_line():
    runner = CliRunner()
    res = runner.invoke(app, ["plan", "llama3.2-1b", "--world", "8", "--topology", "dgx-h100", "--auto", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["best"][0]["set"].startswith("--set parallel.zero=") and out["assumptions"]["efficiency"] == 0.6
    for args, needle in ((["--auto", "--world", "8"], "--topology"), (["--auto", "--world", "8", "--topology", "dgx"], "dgx")):
        res = runner.invoke(app, ["plan", "llama3.2-1b", *args])
        assert res.exit_code == 2 and res.stderr.count("\n") == 1 and needle in res.stderr, res.output
