"""Asking NVML (nvidia-ml-py's ``pynvml``) about one host's GPUs, and what one rank contributes.

Each rank asks NVML about its host's GPUs: name, memory, UUID, PCI bus, NUMA node, NVLink peers
(active links whose remote PCI bus is another local GPU, or ``nvmlDeviceGetP2PStatus`` with the
NVLink index when links go to NVSwitches), the PCIe path to every other GPU
(``nvmlDeviceGetTopologyCommonAncestor``) and the multi-node NVLink fabric
(``nvmlDeviceGetGpuFabricInfoV``: GPUs sharing cluster UUID and clique id are one NVLink domain
even across hosts). :mod:`.gather` makes one :class:`Topology` of every rank's :func:`local_view`.
No pynvml, no driver, no GPU: a clear fallback (hostnames only), never a crash.

Every function takes ``nvml`` (a module answering the pynvml calls; default: ``import pynvml``)
so tests can hand in a stand-in.
"""

from __future__ import annotations

import ctypes
import os
import socket
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from .describe import preset_names

HOW_TO_DESCRIBE = (
    f"describe the cluster instead: --topology {{{','.join(preset_names())}}} --nodes N, "
    "or --topology-file cluster.toml"
)
# nvidia-smi's names for nvmlDeviceGetTopologyCommonAncestor levels (the PCIe path between GPUs).
ANCESTOR_LABELS = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
# GB/s per link, one direction, by NVLink version (2: V100, 3: A100, 4: H100, 5: B200).
NVLINK_GBPS_PER_LINK = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 1.0, 4: 2.0, 5: 4.0, 6: 8.0}
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
