"""One :class:`Topology` from the ranks' NVML views: this host's (:func:`detect`), or every rank's, all-gathered.

The views come from :mod:`.nvml`; a rank without NVML is described by its hostname only, and the
topology's notes and ``source`` say so.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Mapping, Sequence

from .model import Gpu, Topology, compact
from .nvml import HOW_TO_DESCRIBE, local_view, probe_host

# NVML cannot see the NICs; assume one 400 Gb/s NIC per GPU unless told otherwise.
DEFAULT_NETWORK_GBPS = 50.0
DEFAULT_PCIE_GBPS = 32.0
DEFAULT_NVLINK_GBPS = 300.0


def merge_views(views: Sequence[dict], bandwidth: Mapping[str, float] | None = None, name: str = "detected") -> Topology:
    """One topology from every rank's local view (in global-rank order)."""
    hosts: list[str] = []
    domains: list[tuple] = []
    gpus, notes = [], []
    errors: dict[str, list[int]] = {}
    for rank, v in enumerate(views):
        if v["hostname"] not in hosts:
            hosts.append(v["hostname"])
        g = v["gpu"] or {}
        key = tuple(v["domain"]) if v["domain"] is not None else None
        if key is not None and key not in domains:
            domains.append(key)
        if v["error"]:
            errors.setdefault(v["error"], []).append(rank)
        gpus.append(Gpu(node=hosts.index(v["hostname"]), local=g.get("index", v["local_rank"]),
                        domain=None if key is None else domains.index(key), name=g.get("name", "unknown"),
                        memory_gb=g.get("memory_gb", 0.0), uuid=g.get("uuid", ""), pci_bus=g.get("pci_bus", ""),
                        numa=g.get("numa"), nvlinks=g.get("nvlinks", 0)))
    for error, ranks in errors.items():
        notes.append(f"rank{'s' if len(ranks) > 1 else ''} {compact(ranks)}: {error}")
    if notes:
        notes.append("without NVML, GPUs on one host are taken to share PCIe and hosts the network; " + HOW_TO_DESCRIBE)
    views_ok = [v["gpu"] for v in views if v["gpu"]]
    bw = {"nvlink": min((g["nvlink_gbps"] for g in views_ok if g["nvlink_gbps"]), default=None),
          "pcie": min((g["pcie_gbps"] for g in views_ok if g["pcie_gbps"]), default=DEFAULT_PCIE_GBPS),
          "network": DEFAULT_NETWORK_GBPS}
    if domains and bw["nvlink"] is None:
        bw["nvlink"] = DEFAULT_NVLINK_GBPS
    bw = {k: val for k, val in {**bw, **(bandwidth or {})}.items() if val}
    labels = {}
    for a, va in enumerate(views):
        for b, vb in enumerate(views):
            if a != b and va["gpu"] and vb["gpu"] and va["hostname"] == vb["hostname"]:
                labels[(a, b)] = va["gpu"]["paths"][vb["gpu"]["index"]]
    source = "nvml" if not notes else ("fallback" if not views_ok else "nvml+fallback")
    return Topology(name=name, nodes=tuple(hosts), gpus=tuple(gpus), bandwidth=bw, source=source,
                    notes=tuple(notes), labels=labels)


def detect(nvml=None, hostname: str | None = None, bandwidth: Mapping[str, float] | None = None) -> Topology:
    """This host's GPUs as one node (rank i = NVML index i); raises :class:`NvmlUnavailable`."""
    hv = probe_host(nvml, hostname)
    keys = hv.domain_keys()
    views = [{"hostname": hv.hostname, "local_rank": g.index, "gpu": asdict(g), "domain": k, "error": None}
             for g, k in zip(hv.gpus, keys)]
    return merge_views(views, bandwidth, name=f"detected:{hv.hostname}")


def gather_topology(group=None, local_rank: int | None = None, nvml=None,
                    bandwidth: Mapping[str, float] | None = None, hostname: str | None = None) -> Topology:
    """All-gather every rank's local view over ``group`` (default: world) into one topology.

    Call on every rank at start-up; ``topology.gpus[r]`` is then the GPU of rank ``r`` of the
    group. ``local_rank`` defaults to $LOCAL_RANK (torchrun sets it). Never raises for lack of
    NVML: such ranks are described by hostname only (``topology.source`` says so).
    """
    import torch.distributed as dist

    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    view = local_view(local_rank, nvml, hostname)
    views = gather_views(view, group) if dist.is_initialized() else [view]  # one process: itself
    return merge_views(views, bandwidth)


def gather_views(view: dict, group=None) -> list[dict]:
    """Every rank's :func:`local_view` (plain JSON data), through the counted comm layer (sizes first,
    then padded bytes). JSON, not pickle: nothing a peer sends can run code here."""
    import torch
    import torch.distributed as dist

    from .. import comm

    # NCCL moves CUDA tensors only (this rank's current GPU, as torch's all_gather_object does)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    payload = torch.frombuffer(bytearray(json.dumps(view).encode()), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    comm.all_gather_into_tensor(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group=group)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    out = torch.zeros(world * longest, dtype=torch.uint8, device=device)
    comm.all_gather_into_tensor(out, padded, group=group)
    out, sizes = out.cpu(), sizes.cpu()
    return [json.loads(out[r * longest: r * longest + int(sizes[r])].numpy().tobytes()) for r in range(world)]
