"""Detection through a stand-in NVML: a DGX-H100 node, a PCIe box, a 2-tray NVL72 fabric, no NVML.

The stand-in states raw NVML facts (where each NVLink ends, P2P status, PCIe ancestors, fabric
clique); the expected conclusions below are written from the hardware, not from the code.
"""

import builtins

import pytest
import torch.distributed as dist

from par_groups import CommRecorder
from par_groups.topology import NvmlUnavailable, detect, gather_topology, local_view, merge_views
from par_groups.topology import fake_nvml as fake
from par_groups.topology.nvml import load_nvml, probe_host, visible_index


def test_dgx_h100_node_is_one_nvlink_domain_found_through_p2p_status():
    nvml = fake.dgx_h100_node()
    topo = detect(nvml, hostname="dgx0")
    assert topo.source == "nvml" and topo.nodes == ("dgx0",) and topo.world_size == 8
    assert [g.name for g in topo.gpus] == ["NVIDIA H100 80GB HBM3"] * 8
    assert topo.gpus[3].uuid == "GPU-h100-0-3" and topo.gpus[3].pci_bus == "0000:48:00.0"
    assert [g.numa for g in topo.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.gpus[0].memory_gb == pytest.approx(79.6, abs=0.1)
    assert topo.domain_ranks() == [list(range(8))]  # links end at NVSwitches: peers come from P2PStatus
    assert topo.bandwidth["nvlink"] == 18 * 25.0  # 18 NVLink4 links
    assert topo.label(0, 7) == "NV18" and topo.group_link(range(8)) == "nvlink"
    assert "nvmlDeviceGetP2PStatus" in nvml.calls and "nvmlDeviceGetGpuFabricInfoV" in nvml.calls
    assert nvml.calls[-1] == "nvmlShutdown"


def test_pcie_box_has_no_nvlink_and_reports_pcie_paths():
    topo = detect(fake.pcie_box(), hostname="box")
    assert topo.domain_ranks() == [] and topo.largest_domain() == 1
    assert topo.group_link(range(8)) == "pcie"
    assert [topo.label(0, j) for j in range(8)] == ["X", "PIX", "PHB", "PHB", "SYS", "SYS", "SYS", "SYS"]
    assert topo.bandwidth["pcie"] == 32.0  # gen4 x16
    assert "nvlink" not in topo.bandwidth


def test_nvlink_bridged_pairs_are_found_from_the_remote_pci_bus():
    nvml = fake.pcie_box(nvlink_bridges=True)
    topo = detect(nvml, hostname="box")
    assert topo.domain_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.link(0, 1) == "nvlink" and topo.link(1, 2) == "pcie"
    assert topo.label(2, 3) == "NV4"
    assert "nvmlDeviceGetNvLinkRemotePciInfo" in nvml.calls


def _two_trays(**kw):
    views = [local_view(i, fake.nvl72_tray(t, **kw), hostname=f"tray{t}", env={}) for t in (0, 1) for i in range(4)]
    return merge_views(views)


def test_nvl72_fabric_clique_makes_one_domain_across_hosts():
    topo = _two_trays()
    assert topo.nodes == ("tray0", "tray1") and [g.node for g in topo.gpus] == [0] * 4 + [1] * 4
    assert topo.domain_ranks() == [list(range(8))]
    assert topo.link(0, 7) == "nvlink"  # different hosts, same NVLink domain
    assert topo.bandwidth["nvlink"] == 18 * 50.0  # NVLink5


def test_fabric_not_completed_or_other_clique_splits_the_domain():
    unfinished = _two_trays(completed=False)  # falls back to each host's own NVLink component
    assert unfinished.domain_ranks() == [[0, 1, 2, 3], [4, 5, 6, 7]] and unfinished.link(0, 4) == "network"
    views = [local_view(i, fake.nvl72_tray(t, clique=t), hostname=f"tray{t}", env={}) for t in (0, 1) for i in range(4)]
    assert merge_views(views).domain_ranks() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_no_driver_is_a_clear_error_and_a_fallback_view():
    with pytest.raises(NvmlUnavailable, match="no NVIDIA driver or GPU"):
        detect(fake.no_driver(), hostname="ci")
    view = local_view(0, fake.no_driver(), hostname="ci")
    assert view["gpu"] is None and "NVML could not start" in view["error"]
    topo = merge_views([view, local_view(1, fake.no_driver(), hostname="ci"), local_view(0, fake.no_driver(), hostname="ci2")])
    assert topo.source == "fallback" and topo.world_size == 3
    assert topo.link(0, 1) == "pcie" and topo.link(0, 2) == "network"
    assert any("--topology" in n for n in topo.notes)


def test_real_pynvml_without_a_driver_does_not_crash():
    # This machine has pynvml but no libnvidia-ml: NVML fails to start. Where a GPU exists, skip.
    try:
        topo = detect()
    except NvmlUnavailable as e:
        assert "NVML" in str(e)
    else:
        assert topo.world_size >= 1


def test_missing_pynvml_module_is_reported(monkeypatch):
    real_import = builtins.__import__

    def no_pynvml(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    with pytest.raises(NvmlUnavailable, match="nvidia-ml-py"):
        load_nvml()
    assert "not installed" in local_view(0)["error"]


def test_cuda_visible_devices_maps_local_rank_to_nvml_index():
    host = probe_host(fake.dgx_h100_node(), "dgx0")
    assert visible_index(1, host, {"CUDA_VISIBLE_DEVICES": "4,5"}) == 5
    assert visible_index(0, host, {"CUDA_VISIBLE_DEVICES": "GPU-h100-0-6"}) == 6
    assert visible_index(3, host, {}) == 3
    view = local_view(1, fake.dgx_h100_node(), hostname="dgx0", env={"CUDA_VISIBLE_DEVICES": "6,7"})
    assert view["gpu"]["index"] == 7


def gather_on_two_trays():
    """Ranks 0-1 on tray0, 2-3 on tray1 of one NVL72 fabric; rank 3 has no driver."""
    rank = dist.get_rank()
    nvml = fake.no_driver() if rank == 3 else fake.nvl72_tray(rank // 2)
    with CommRecorder() as rec:
        topo = gather_topology(local_rank=rank % 2, nvml=nvml, hostname=f"tray{rank // 2}")
    return {"nodes": topo.nodes, "node": [g.node for g in topo.gpus], "local": [g.local for g in topo.gpus],
            "domains": topo.domain_ranks(), "source": topo.source, "gathers": rec.count("all_gather")}


def test_gather_topology_all_gathers_every_rank_view(dist_run):
    results = dist_run(4, gather_on_two_trays, timeout=300)  # slow start under load
    assert all(r == results[0] for r in results)  # every rank builds the same topology
    r = results[0]
    assert r["nodes"] == ("tray0", "tray1") and r["node"] == [0, 0, 1, 1] and r["local"] == [0, 1, 0, 1]
    assert r["domains"] == [[0, 1, 2]]  # rank 3 could not see its GPU: no domain
    assert r["source"] == "nvml+fallback" and r["gathers"] == 2  # sizes, then the padded payloads


def test_gather_without_a_process_group_describes_this_process():
    topo = gather_topology(local_rank=2, nvml=fake.dgx_h100_node(), hostname="dgx0")
    assert topo.world_size == 1 and topo.gpus[0].local == 2 and topo.nodes == ("dgx0",)
