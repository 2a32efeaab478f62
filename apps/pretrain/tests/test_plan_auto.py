"""`pretrain plan --auto` gives the known answers (each search well under 60 s).

* Llama-3-8B on one DGX-H100 keeps tp inside the node; Llama-3-70B on 8 nodes never puts tp
  across nodes; a 1B model trains with plain data parallelism (ZeRO-1 at most);
* DeepSeek-V3 on 2048 GPUs of DGX-H100 keeps every ep group inside a node (NVLink), with the
  pipeline deep enough that a node holds the experts of its stage.
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


@pytest.mark.timeout(300)  # minutes under load on 2 cores: beyond the suite's 60 s bound
def test_deepseek_v3_keeps_ep_inside_the_nvlink_domain_where_the_experts_fit():
    best = plan("deepseek-v3", 2048, "dgx-h100")["best"]
    # 61 layers: pp 16 with uneven first / last stages leaves few enough experts per rank for one node
    assert best[0]["layout"]["ep"] > 1 and best[0]["layout"]["pp"] > 1, best[0]
    for row in best:
        assert row["links"].get("ep", "nvlink") == "nvlink" and row["memory_gb"] <= 72, row


def test_cli_auto_prints_json_for_a_described_cluster_and_bad_input_is_one_line(tmp_path):
    runner = CliRunner()
    path = tmp_path / "gb200-64.toml"
    path.write_text(GB200_64)
    res = runner.invoke(app, ["plan", "llama3.2-1b", "--world", "128", "--topology", str(path), "--auto", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert "2 NVLink domain(s) of [64] GPUs" in out["topology"] and out["assumptions"]["efficiency"] == 0.6
    assert "--set parallel.zero=" in out["best"][0]["set"] and out["best"][0]["step_s"] > 0
    for args, needle in ((["--auto", "--world", "8"], "--topology"), (["--auto", "--world", "8", "--topology", "dgx"], "dgx")):
        res = runner.invoke(app, ["plan", "llama3.2-1b", *args])
        assert res.exit_code == 2 and res.stderr.count("\n") == 1 and needle in res.stderr, res.output


def test_auto_says_how_it_judged_memory_and_simulate_measures_the_first_choice():
    estimated = auto_plan(load_config(None), 8, "dgx-h100")["memory_check"]
    assert estimated["method"] == "estimated" and "--simulate" in estimated["note"] and not estimated["simulated"]
    check = auto_plan(load_config(None), 8, "dgx-h100", simulate=True)["memory_check"]
    (first,) = check["simulated"]  # it fits, so no other choice is simulated
    assert check["method"] == "simulated" and first["index"] == 0 and first["fits"]
    assert first["measured_gb"] == pytest.approx(first["estimated_gb"], rel=0.10)


def _policy_plan(tmp_path, pcie: float) -> tuple[dict, dict, dict]:
    """The tiny model at seq 4096 on one GPU of 0.09 GB (its activations do not fit without a policy):
    --auto --auto-policy's first choice, and `plan` of its layout with that policy and without."""
    import shlex

    path = tmp_path / f"small-{pcie:g}.toml"
    path.write_text(f'preset = "dgx-h100"\ngpu_memory_gb = 0.09\n[bandwidth]\nnvlink = 450\npcie = {pcie}\nnetwork = 50\n')
    first = auto_plan(load_config(None, ["train.seq_len=4096"]), 1, str(path), policies=True)["best"][0]
    flags = ["plan", "--world", "1", "--gpu-memory", "0.09", "--json", "--set", "train.seq_len=4096"]
    flags += shlex.split(first["set"])
    chosen, bare = (json.loads(CliRunner().invoke(app, flags + extra).stdout)
                    for extra in ([], ["--set", "model.recompute=none", "--set", "model.offload=[]"]))
    return first, chosen, bare


@pytest.mark.parametrize("pcie, offloads", [(200.0, True), (100.0, False)])
def test_auto_policy_fits_what_no_policy_fits_and_its_step_time_counts_the_reruns_and_copies(tmp_path, pcie, offloads):
    """A host link fast enough makes offloading the first layers cheaper than recomputing; a slower one
    does not. Either way the chosen layout does not fit policy-free and fits with the policy, its compute
    is the model FLOPs plus the plan's recomputed FLOPs at the planner's rate, and its offload time is
    what the plan's offloaded bytes take over the host link beyond the forward / backward windows."""
    from pretrain.planner.estimate import host_seconds

    first, chosen, bare = _policy_plan(tmp_path, pcie)
    zero, lay = first["layout"]["zero"], first["layout"]
    assert bare["peak_gb"][zero] > bare["budget_gb"]  # the same layout without a policy does not fit
    assert chosen["peak_gb"][zero] == pytest.approx(first["memory_gb"], rel=1e-9) and first["memory_gb"] <= chosen["budget_gb"]
    stage = chosen["activation_policy"]["stages"][0]
    rate = 989e12 * 0.6  # H100 bf16 peak x the default efficiency
    model = chosen["flops"]["per_rank_per_step"]
    assert stage["model_flops_per_step"] == pytest.approx(model, rel=1e-9)
    assert first["compute_s"] == pytest.approx((model + stage["recompute_flops_per_step"]) / rate, rel=1e-9)
    assert bool(lay.get("offload")) == offloads
    if offloads:
        moved = stage["offloaded_bytes_per_step"]
        exposed = host_seconds(moved, pcie, model / 3 / rate, first["compute_s"] - model / 3 / rate)
        assert moved > 0 and first["comm_s"]["offload"] == pytest.approx(exposed, rel=1e-9) and exposed > 0
        assert "--set model.offload='[\"layers:" in first["set"]
    else:
        assert stage["recompute_flops_per_step"] > 0 and "offload" not in first["comm_s"]
