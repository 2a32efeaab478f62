"""`pretrain topo`: detected or described topology, placement report, JSON, one-line errors."""

import json

from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.commands import topo as topo_cmd
from par_groups.topology import NvmlUnavailable, detect
from par_groups.topology import fake_nvml as fake

runner = CliRunner()


def no_gpu(*args, **kwargs):
    raise NvmlUnavailable("NVML could not start on ci (NVML Shared Library Not Found): no NVIDIA driver or GPU")


def test_without_gpus_exits_0_and_says_how_to_describe_a_topology(monkeypatch):
    monkeypatch.setattr(topo_cmd, "detect", no_gpu)  # also where a GPU exists
    res = runner.invoke(app, ["topo"])
    assert res.exit_code == 0, res.output
    assert "no NVIDIA GPUs found" in res.stdout and "--topology" in res.stdout and "--topology-file" in res.stdout
    res = runner.invoke(app, ["topo", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["topology"] is None
    res = runner.invoke(app, ["topo", "--tp", "2"])  # a layout needs a topology: one-line error
    assert res.exit_code == 2 and res.stderr.startswith("error: no NVIDIA GPUs found")


def test_detected_topology_is_summarised(monkeypatch):
    monkeypatch.setattr(topo_cmd, "detect", lambda: detect(fake.dgx_h100_node(), hostname="dgx0"))
    res = runner.invoke(app, ["topo"])
    assert res.exit_code == 0, res.output
    assert "NV18" in res.stdout and "node 0 (dgx0)" in res.stdout and "GPU7" in res.stdout


def test_preset_summary_and_json():
    res = runner.invoke(app, ["topo", "--topology", "nvl72"])
    assert res.exit_code == 0 and "NVLink domain 0: ranks 0-71 on node(s) 0-17" in res.stdout
    res = runner.invoke(app, ["topo", "--topology", "dgx-h100", "--nodes", "2", "--json"])
    out = json.loads(res.stdout)
    assert len(out["gpus"]) == 16 and out["hosts"] == ["node0", "node1"]


def test_layout_json_has_order_groups_links_and_warnings():
    res = runner.invoke(app, ["topo", "--topology", "dgx-h100", "--nodes", "2", "--tp", "8", "--pp", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["order"] == "tp-cp-ep-dp-pp" and out["warnings"] == []
    assert out["groups"]["tp"] == {**out["groups"]["tp"], "ranks": [list(range(8)), list(range(8, 16))], "link": "nvlink"}
    assert out["groups"]["pp"]["link"] == "network" and out["groups"]["pp"]["ranks"][0] == [0, 8]
    assert out["permutation"] == list(range(16))


def test_layout_infers_nodes_and_warns_in_text():
    res = runner.invoke(app, ["topo", "--topology", "dgx-h100", "--tp", "16"])  # 2 nodes are needed
    assert res.exit_code == 0, res.output
    assert "world=16" in res.stdout and "warnings:" in res.stdout and "--tp 8" in res.stdout


def test_hcp_and_expert_layout_on_nvl72():
    res = runner.invoke(app, ["topo", "--topology", "nvl72", "--ep", "36", "--json"])
    out = json.loads(res.stdout)
    assert out["groups"]["ep"]["link"] == "nvlink" and len(out["groups"]["ep"]["ranks"][0]) == 36
    res = runner.invoke(app, ["topo", "--topology", "dgx-h100", "--nodes", "2", "--tp", "2", "--cp", "8",
                              "--hcp", "4,2", "--json"])
    assert json.loads(res.stdout)["groups"]["hcp0"]["link"] == "nvlink"


def test_topology_file_and_save_round_trip(tmp_path):
    f = tmp_path / "rack.toml"
    f.write_text('preset = "nvl72"\nnodes = 2\n')
    res = runner.invoke(app, ["topo", "--topology-file", str(f), "--save", str(tmp_path / "saved.toml")])
    assert res.exit_code == 0, res.output
    assert "2 node(s) x 4 GPUs = 8 GPUs" in res.stdout
    res = runner.invoke(app, ["topo", "--topology-file", str(tmp_path / "saved.toml"), "--ep", "8", "--json"])
    assert json.loads(res.stdout)["groups"]["ep"]["link"] == "nvlink"


def test_bad_input_is_one_line_and_exit_code_2(tmp_path):
    cases = [
        (["topo", "--topology", "dgx-h999"], "error: unknown topology preset 'dgx-h999'; use one of dgx-a100, dgx-h100, nvl72, pcie-8gpu"),
        (["topo", "--topology", "dgx-h100", "--nodes", "2", "--world", "32"],
         "error: the layout has world_size=32 but topology 'dgx-h100' has 16 GPUs; describe 4 node(s) (--nodes) or change the layout"),
        (["topo", "--topology", "dgx-h100", "--world", "10", "--tp", "4"], "error: world_size=10 is not divisible by tp*cp*pp=4*1*1=4"),
        (["topo", "--topology-file", str(tmp_path / "none.toml")], f"error: topology file '{tmp_path / 'none.toml'}' does not exist"),
        (["topo", "--topology", "dgx-h100", "--tp", "2", "--cp", "2", "--cp-comm", "ring"],
         "error: cp_comm='ring'; use one of p2p, a2a, allgather"),
    ]
    for args, message in cases:
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert res.stderr.strip() == message and "Traceback" not in res.output
