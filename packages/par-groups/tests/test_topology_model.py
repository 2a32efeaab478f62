"""The topology model: presets, TOML descriptions, link classes between GPUs and groups."""

import pytest

from par_groups.topology import LINK_CLASSES, TopologyError, from_dict, load_toml, preset, render_topology, to_toml


def test_dgx_h100_preset_has_nvlink_inside_nodes_and_network_between():
    topo = preset("dgx-h100", nodes=2)
    assert topo.world_size == 16 and len(topo.nodes) == 2
    assert topo.link(0, 7) == "nvlink" and topo.link(7, 8) == "network"
    assert topo.group_link([0, 3]) == "nvlink" and topo.group_link([0, 8]) == "network"
    assert topo.group_link([5]) is None
    assert topo.bandwidth["nvlink"] > topo.bandwidth["network"]


def test_pcie_preset_has_no_nvlink():
    topo = preset("pcie-8gpu")
    assert topo.world_size == 8 and topo.domain_ranks() == []
    assert topo.group_link(range(8)) == "pcie"


def test_nvl72_preset_is_one_domain_over_18_nodes_of_4():
    topo = preset("nvl72")
    assert topo.world_size == 72 and len(topo.nodes) == 18
    assert topo.domain_ranks() == [list(range(72))]
    assert topo.link(0, 71) == "nvlink" and topo.gpus[71].node == 17
    two_racks = preset("nvl72", nodes=36)
    assert [len(d) for d in two_racks.domain_ranks()] == [72, 72] and two_racks.link(71, 72) == "network"


def test_multi_rail_bandwidth_counts_members_per_node_for_gradient_groups():
    topo = preset("dgx-h100", nodes=2)
    assert topo.group_gbps([0, 8]) == topo.group_gbps([0, 8], multi_rail=True) == 50.0
    assert topo.group_gbps([0, 1, 2, 3, 8, 9, 10, 11], multi_rail=True) == 4 * 50.0
    assert topo.group_gbps(list(range(16)), multi_rail=True) == min(8 * 50.0, 450.0)


def test_compact_toml_with_preset_and_overrides(tmp_path):
    f = tmp_path / "cluster.toml"
    f.write_text('preset = "dgx-h100"\nnodes = 3\n[bandwidth]\nnetwork = 25\n')
    topo = load_toml(f)
    assert topo.name == "cluster" and topo.world_size == 24 and topo.bandwidth["network"] == 25
    assert topo.bandwidth["nvlink"] == preset("dgx-h100").bandwidth["nvlink"]
    assert load_toml(f, nodes=1).world_size == 8  # --nodes wins


def test_compact_toml_bridged_pairs(tmp_path):
    f = tmp_path / "pairs.toml"
    f.write_text('gpus_per_node = 4\nnvlink_domain_gpus = 2\n[bandwidth]\nnvlink = 100\npcie = 25\nnetwork = 12.5\n')
    topo = load_toml(f, nodes=2)
    assert topo.domain_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.link(1, 2) == "pcie" and topo.link(3, 4) == "network"


def test_explicit_form_round_trips_through_toml(tmp_path):
    spec = {"name": "odd", "hosts": ["a", "b"], "bandwidth": {"nvlink": 300, "pcie": 30, "network": 20},
            "gpus": [{"node": 0, "local": 0, "domain": 0}, {"node": 1, "local": 0, "domain": 1},
                     {"node": 0, "local": 1, "domain": 0}, {"node": 1, "local": 1}]}
    topo = from_dict(spec)
    assert topo.link(0, 2) == "nvlink" and topo.link(0, 1) == "network" and topo.link(1, 3) == "pcie"
    f = tmp_path / "odd.toml"
    f.write_text(to_toml(topo))
    again = load_toml(f)
    assert again.gpus == topo.gpus and again.nodes == topo.nodes and dict(again.bandwidth) == dict(topo.bandwidth)


@pytest.mark.parametrize("spec, message", [
    ({"preset": "dgx-h999"}, "unknown topology preset 'dgx-h999'; use one of"),
    ({"gpus_per_node": 8}, "lacks ['nvlink_domain_gpus']"),
    ({"gpus_per_node": 8, "nvlink_domain_gpus": 3, "bandwidth": {"nvlink": 1, "pcie": 1, "network": 1}},
     "nvlink_domain_gpus=3 must be 0"),
    ({"gpus_per_node": 8, "nvlink_domain_gpus": 8, "bandwidth": {"pcie": 1, "network": 1}}, "missing ['nvlink']"),
    ({"preset": "dgx-h100", "gpu_count": 8}, "unknown topology key(s) ['gpu_count']"),
])
def test_bad_descriptions_say_what_is_valid(spec, message):
    with pytest.raises(TopologyError) as e:
        from_dict(spec)
    assert message in str(e.value)


def test_bad_toml_file_names_the_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("nodes = [")
    with pytest.raises(TopologyError, match="bad.toml' is not valid TOML"):
        load_toml(f)
    with pytest.raises(TopologyError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")


def test_summary_shows_a_matrix_and_domains_like_nvidia_smi():
    text = render_topology(preset("nvl72"))
    assert "NV18" in text and "NVLink domain 0: ranks 0-71 on node(s) 0-17" in text
    assert "except NV to ranks 4-71" in text
    assert set(LINK_CLASSES) == {"nvlink", "pcie", "network"}
