"""Detecting the topology with NVML (nvidia-ml-py's ``pynvml``), one host at a time, then globally.

Each rank asks NVML about its host's GPUs: name, memory, UUID, PCI bus, NUMA node, NVLink peers
(active links whose remote PCI bus is another local GPU, or ``nvmlDeviceGetP2PStatus`` with the
NVLink index when links go to NVSwitches), the PCIe path to every other GPU
(``nvmlDeviceGetTopologyCommonAncestor``) and the multi-node NVLink fabric
(``nvmlDeviceGetGpuFabricInfoV``: GPUs sharing cluster UUID and clique id are one NVLink domain
even across hosts). :func:`gather_topology` all-gathers every rank's local view into one
:class:`Topology`. No pynvml, no driver, no GPU: a clear fallback (hostnames only), never a crash.

Every function takes ``nvml`` (a module answering the pynvml calls; default: ``import pynvml``)
so tests can hand in a stand-in.
"""

from __future__ import annotations

import ctypes
import os
import json
import socket
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from .describe import preset_names
from .model import Gpu, Topology, compact

HOW_TO_DESCRIBE = (
    f"describe the cluster instead: --topology {{{','.join(preset_names())}}} --nodes N, "
    "or --topology-file cluster.toml"
)
# nvidia-smi's names for nvmlDeviceGetTopologyCommonAncestor levels (the PCIe path between GPUs).
ANCESTOR_LABELS = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
# GB/s per link, one direction, by NVLink version (2: V100, 3: A100, 4: H100, 5: B200).
NVLINK_GBPS_PER_LINK = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 1.0, 4: 2.0, 5: 4.0, 6: 8.0}
# NVML cannot see the NICs; assume one 400 Gb/s NIC per GPU unless told otherwise.
DEFAULT_NETWORK_GBPS = 50.0
DEFAULT_PCIE_GBPS = 32.0
DEFAULT_NVLINK_GBPS = 300.0


class NvmlUnavailable(RuntimeError):
    """NVML cannot describe this machine (no pynvml, no driver, no GPU); the message says why."""


@dataclass(frozen=True)
class GpuView:
    """What NVML says about one GPU of a host (``index`` is its NVML index)."""

    index: int
    name: str
    memory_gb: float
    uuid: str
    pci_bus: str
    numa: int | None
    nvlinks: int  # active NVLink links
    nvlink_peers: tuple[int, ...]  # local GPUs reachable over NVLink
    paths: tuple[str, ...]  # nvidia-smi label to every local GPU: X, NV<n>, PIX ... SYS
    fabric: tuple[str, int] | None  # (cluster UUID, clique id) of a completed multi-node fabric
    nvlink_gbps: float | None
    pcie_gbps: float | None


@dataclass(frozen=True)
class HostView:
    hostname: str
    gpus: tuple[GpuView, ...]

    def domain_keys(self) -> list[tuple | None]:
        """Per GPU, a key equal for GPUs of one NVLink domain: the fabric clique, else the NVLink component."""
        component = list(range(len(self.gpus)))

        def root(i: int) -> int:
            while component[i] != i:
                i = component[i]
            return i

        for g in self.gpus:
            for p in g.nvlink_peers:
                a, b = root(g.index), root(p)
                component[max(a, b)] = min(a, b)
        keys: list[tuple | None] = []
        for g in self.gpus:
            if g.fabric is not None:
                keys.append(("fabric",) + tuple(g.fabric))
            elif g.nvlink_peers:
                keys.append(("host", self.hostname, root(g.index)))
            else:
                keys.append(None)
        return keys


def load_nvml():
    try:
        import pynvml
    except ImportError as e:
        raise NvmlUnavailable(f"nvidia-ml-py (pynvml) is not installed ({e})")
    return pynvml


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _bus(pci: Any) -> str:
    """Normalized PCI bus id: NVML pads the domain to 8 digits in some calls and 4 in others."""
    bus = _text(getattr(pci, "busId", pci)).strip().upper()
    parts = bus.split(":")
    if len(parts) == 3 and len(parts[0]) > 4:
        parts[0] = parts[0][-4:]
    return ":".join(parts)


def _try(nvml, fn: str, *args, default=None):
    """Call an optional NVML query; missing in old drivers / pynvml or NOT_SUPPORTED -> default."""
    f = getattr(nvml, fn, None)
    if f is None:
        return default
    try:
        return f(*args)
    except nvml.NVMLError:
        return default


def _fabric(nvml, handle) -> tuple[str, int] | None:
    struct = getattr(nvml, "c_nvmlGpuFabricInfoV_t", None)
    if struct is None or not hasattr(nvml, "nvmlDeviceGetGpuFabricInfoV"):
        return None
    info = struct()
    try:
        nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
    except nvml.NVMLError:
        return None
    uuid = bytes(info.clusterUuid)
    completed = info.state == getattr(nvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3)
    if not completed or info.status != 0 or not any(uuid):
        return None
    return uuid.hex(), int(info.cliqueId)


def probe_host(nvml=None, hostname: str | None = None) -> HostView:
    """Every GPU NVML sees on this host; raises :class:`NvmlUnavailable` saying why it cannot."""
    nvml = nvml if nvml is not None else load_nvml()
    host = hostname or socket.gethostname()
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        raise NvmlUnavailable(f"NVML could not start on {host} ({_text(e)}): no NVIDIA driver or GPU")
    try:
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            raise NvmlUnavailable(f"NVML found no GPUs on {host}")
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        buses = [_bus(nvml.nvmlDeviceGetPciInfo(h)) for h in handles]
        links = [_links(nvml, h) for h in handles]
        gpus = []
        for i, h in enumerate(handles):
            active, remote_buses, version = links[i]
            peers = {buses.index(b) for b in remote_buses if b in buses and b != buses[i]}
            for j, other in enumerate(handles):  # NVSwitch systems: links end at switches, ask P2P
                if j != i and active and _try(nvml, "nvmlDeviceGetP2PStatus", h, other,
                                              nvml.NVML_P2P_CAPS_INDEX_NVLINK) == nvml.NVML_P2P_STATUS_OK:
                    peers.add(j)
            paths = []
            for j, other in enumerate(handles):
                if j == i:
                    paths.append("X")
                elif j in peers:
                    direct = sum(b == buses[j] for b in remote_buses)
                    paths.append(f"NV{direct or active}")
                else:
                    level = _try(nvml, "nvmlDeviceGetTopologyCommonAncestor", h, other)
                    paths.append(ANCESTOR_LABELS.get(level, "PCIe"))
            gen = _try(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", h)
            width = _try(nvml, "nvmlDeviceGetMaxPcieLinkWidth", h)
            gpus.append(GpuView(
                index=i,
                name=_text(nvml.nvmlDeviceGetName(h)),
                memory_gb=round(nvml.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1),
                uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                pci_bus=buses[i],
                numa=_try(nvml, "nvmlDeviceGetNumaNodeId", h),
                nvlinks=active,
                nvlink_peers=tuple(sorted(peers)),
                paths=tuple(paths),
                fabric=_fabric(nvml, h),
                nvlink_gbps=active * NVLINK_GBPS_PER_LINK.get(version, 25.0) if active else None,
                pcie_gbps=PCIE_GBPS_PER_LANE[gen] * width if gen in PCIE_GBPS_PER_LANE and width else None,
            ))
        return HostView(hostname=host, gpus=tuple(gpus))
    except nvml.NVMLError as e:
        raise NvmlUnavailable(f"NVML failed on {host}: {_text(e)}")
    finally:
        _try(nvml, "nvmlShutdown")


def _links(nvml, handle) -> tuple[int, list[str], int | None]:
    """Active NVLink count, the PCI bus at the far end of each, and the NVLink version."""
    active, remote, version = 0, [], None
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        if not _try(nvml, "nvmlDeviceGetNvLinkState", handle, link):
            continue
        active += 1
        pci = _try(nvml, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        if pci is not None:
            remote.append(_bus(pci))
        if version is None:
            version = _try(nvml, "nvmlDeviceGetNvLinkVersion", handle, link)
    return active, remote, version


def visible_index(local_rank: int, host: HostView, env: Mapping[str, str] | None = None) -> int:
    """NVML index of the GPU a local rank drives: CUDA_VISIBLE_DEVICES (indices or UUIDs) or itself."""
    env = os.environ if env is None else env
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if local_rank < len(visible):
        v = visible[local_rank]
        if v.isdigit():
            return int(v)
        for g in host.gpus:
            if g.uuid.startswith(v) or v.startswith(g.uuid):
                return g.index
    return local_rank % len(host.gpus)


def local_view(local_rank: int = 0, nvml=None, hostname: str | None = None, env=None) -> dict:
    """What one rank contributes to the global topology; never raises (errors go into ``error``)."""
    host = hostname or socket.gethostname()
    view = {"hostname": host, "local_rank": local_rank, "gpu": None, "domain": None, "error": None}
    try:
        hv = probe_host(nvml, host)
    except NvmlUnavailable as e:
        view["error"] = str(e)
        return view
    index = visible_index(local_rank, hv, env)
    view["gpu"] = asdict(hv.gpus[index])
    view["domain"] = hv.domain_keys()[index]
    return view


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
