"""A stand-in for the ``pynvml`` module, answering the calls detection makes from a few raw facts.

It knows nothing of :class:`Topology`: each machine is described the way NVML reports it (PCI
bus ids, where each NVLink ends, P2P status, common PCIe ancestor, fabric cluster UUID and
clique), so tests of detection compare its conclusions with facts stated independently.
Builders for the machines of the tests: :func:`dgx_h100_node`, :func:`pcie_box`,
:func:`nvl72_tray` and :func:`no_driver`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_INVALID_ARGUMENT = 2
_ERROR_NAMES = {2: "Invalid Argument", 3: "Not Supported", 9: "Driver Not Loaded",
                12: "NVML Shared Library Not Found"}


class FakeNvmlError(Exception):
    def __init__(self, value: int):
        self.value = value
        super().__init__(_ERROR_NAMES.get(value, f"NVML error {value}"))


@dataclass
class FakeGpu:
    name: str
    memory_gb: float
    uuid: str
    bus: str
    numa: int | None = None
    links: tuple[str, ...] = ()  # remote PCI bus id at the end of each active NVLink (a GPU or an NVSwitch)
    nvlink_version: int = 4
    pcie: tuple[int, int] = (5, 16)  # max generation, width
    fabric: tuple[bytes, int, int] | None = None  # (cluster UUID, clique id, state); None: not supported


@dataclass
class FakeNvml:
    """Module-like object: ``FakeNvml(gpus).nvmlDeviceGetCount()`` etc., like ``import pynvml``."""

    gpus: list[FakeGpu]
    p2p_nvlink: set[frozenset[int]] = field(default_factory=set)  # pairs P2PStatus(NVLINK) says OK
    ancestor: dict[frozenset[int], int] = field(default_factory=dict)  # pair -> NVML_TOPOLOGY_* level
    init_error: int | None = None
    calls: list[str] = field(default_factory=list)

    NVMLError = FakeNvmlError
    NVML_NVLINK_MAX_LINKS = 18
    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0
    NVML_P2P_STATUS_NOT_SUPPORTED = 5
    NVML_TOPOLOGY_SYSTEM = 50
    NVML_GPU_FABRIC_STATE_COMPLETED = 3

    @property
    def c_nvmlGpuFabricInfoV_t(self):
        import pynvml  # the real structure, so the call looks exactly like pynvml's

        return pynvml.c_nvmlGpuFabricInfoV_t

    def _log(self, name: str) -> None:
        self.calls.append(name)

    def _gpu(self, handle) -> FakeGpu:
        return self.gpus[handle.index]

    def nvmlInit(self):
        self._log("nvmlInit")
        if self.init_error is not None:
            raise FakeNvmlError(self.init_error)

    def nvmlShutdown(self):
        self._log("nvmlShutdown")

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < len(self.gpus):
            raise FakeNvmlError(NVML_ERROR_INVALID_ARGUMENT)
        return SimpleNamespace(index=i)

    def nvmlDeviceGetName(self, h):
        return self._gpu(h).name

    def nvmlDeviceGetUUID(self, h):
        return self._gpu(h).uuid

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=int(self._gpu(h).memory_gb * 2**30), free=0, used=0)

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self._gpu(h).bus.encode())

    def nvmlDeviceGetNumaNodeId(self, h):
        numa = self._gpu(h).numa
        if numa is None:
            raise FakeNvmlError(NVML_ERROR_NOT_SUPPORTED)
        return numa

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._gpu(h).pcie[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._gpu(h).pcie[1]

    def _link(self, h, link) -> str:
        self._log("nvmlDeviceGetNvLinkState")
        gpu = self._gpu(h)
        if not gpu.links:
            raise FakeNvmlError(NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < self.NVML_NVLINK_MAX_LINKS:
            raise FakeNvmlError(NVML_ERROR_INVALID_ARGUMENT)
        return gpu.links[link] if link < len(gpu.links) else ""

    def nvmlDeviceGetNvLinkState(self, h, link):
        return 1 if self._link(h, link) else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        self._log("nvmlDeviceGetNvLinkRemotePciInfo")
        remote = self._link(h, link)
        if not remote:
            raise FakeNvmlError(NVML_ERROR_INVALID_ARGUMENT)
        return SimpleNamespace(busId=remote.encode())

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        return self._gpu(h).nvlink_version

    def nvmlDeviceGetP2PStatus(self, h1, h2, index):
        self._log("nvmlDeviceGetP2PStatus")
        if index != self.NVML_P2P_CAPS_INDEX_NVLINK:
            raise FakeNvmlError(NVML_ERROR_INVALID_ARGUMENT)
        ok = frozenset((h1.index, h2.index)) in self.p2p_nvlink
        return self.NVML_P2P_STATUS_OK if ok else self.NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, h1, h2):
        self._log("nvmlDeviceGetTopologyCommonAncestor")
        return self.ancestor.get(frozenset((h1.index, h2.index)), self.NVML_TOPOLOGY_SYSTEM)

    def nvmlDeviceGetGpuFabricInfoV(self, h, ref):
        self._log("nvmlDeviceGetGpuFabricInfoV")
        fabric = self._gpu(h).fabric
        if fabric is None:
            raise FakeNvmlError(NVML_ERROR_NOT_SUPPORTED)
        info = getattr(ref, "_obj", ref)  # ctypes.byref(struct) -> struct
        uuid, clique, state = fabric
        for k, byte in enumerate(uuid.ljust(16, b"\0")[:16]):
            info.clusterUuid[k] = byte
        info.status, info.cliqueId, info.state = NVML_SUCCESS, clique, state
        return NVML_SUCCESS


def _bus(i: int) -> str:
    return f"00000000:{0x18 + 0x10 * i:02X}:00.0"


def _switch_bus(s: int) -> str:
    return f"00000000:{0xC0 + s:02X}:00.0"


def dgx_h100_node(host: int = 0) -> FakeNvml:
    """8 H100 on 4 NVSwitches: each GPU's 18 links end at switches, so only P2PStatus shows peers."""
    gpus = [FakeGpu(name="NVIDIA H100 80GB HBM3", memory_gb=79.6, uuid=f"GPU-h100-{host}-{i}", bus=_bus(i),
                    numa=i // 4, links=tuple(_switch_bus(k % 4) for k in range(18)), nvlink_version=4)
            for i in range(8)]
    pairs = {frozenset((i, j)) for i in range(8) for j in range(8) if i != j}
    ancestor = {frozenset((i, j)): 40 if i // 4 == j // 4 else 50 for i in range(8) for j in range(8) if i != j}
    return FakeNvml(gpus, p2p_nvlink=pairs, ancestor=ancestor)


def pcie_box(nvlink_bridges: bool = False) -> FakeNvml:
    """8 PCIe GPUs, pairs under one PCIe switch, halves on two CPU sockets; optionally NVLink-bridged pairs.

    Bridged pairs are reported only by their links' remote PCI bus (P2PStatus says not supported).
    """
    gpus = []
    for i in range(8):
        partner = _bus(i ^ 1)
        gpus.append(FakeGpu(name="NVIDIA L40S", memory_gb=44.4, uuid=f"GPU-l40s-{i}", bus=_bus(i), numa=i // 4,
                            links=(partner,) * 4 if nvlink_bridges else (), nvlink_version=4, pcie=(4, 16)))
    ancestor = {}
    for i in range(8):
        for j in range(8):
            if i != j:
                ancestor[frozenset((i, j))] = 10 if i // 2 == j // 2 else (30 if i // 4 == j // 4 else 50)
    return FakeNvml(gpus, ancestor=ancestor)


def nvl72_tray(tray: int, cluster: bytes = b"nvl72-rack-0", clique: int = 7, completed: bool = True) -> FakeNvml:
    """One compute tray (host) of an NVL72 rack: 4 GPUs whose links go to the rack's NVLink switches."""
    gpus = [FakeGpu(name="NVIDIA GB200", memory_gb=184.0, uuid=f"GPU-gb200-{tray}-{i}", bus=_bus(i), numa=i // 2,
                    links=tuple(_switch_bus(k % 9) for k in range(18)), nvlink_version=5,
                    fabric=(cluster, clique, 3 if completed else 2))
            for i in range(4)]
    pairs = {frozenset((i, j)) for i in range(4) for j in range(4) if i != j}
    return FakeNvml(gpus, p2p_nvlink=pairs, ancestor={p: 50 for p in pairs})


def no_driver() -> FakeNvml:
    """pynvml installed, but no libnvidia-ml (nvmlInit fails), like this project's CI machines."""
    return FakeNvml([], init_error=NVML_ERROR_LIBRARY_NOT_FOUND)
