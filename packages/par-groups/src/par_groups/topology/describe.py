"""Described topologies: built-in presets and TOML files, for planning on machines without GPUs.

A TOML description is either compact (identical nodes)::

    name = "my-cluster"
    preset = "dgx-h100"        # optional: start from a preset, override below
    nodes = 4
    gpus_per_node = 8
    nvlink_domain_gpus = 8     # 0 = no NVLink; < gpus_per_node = bridged groups; > = multi-node fabric
    gpu_name = "NVIDIA H100 80GB HBM3"
    gpu_memory_gb = 80
    [bandwidth]                # GB/s per GPU, one direction
    nvlink = 450
    pcie = 64
    network = 50

or explicit, one ``[[gpus]]`` table per global rank (what ``Topology.to_dict`` writes)::

    hosts = ["a", "b"]
    [bandwidth] ...
    [[gpus]]
    node = 0
    local = 0
    domain = 0                 # omit: no NVLink
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Mapping

from .model import Gpu, Topology, TopologyError, uniform

# Bandwidths are per-GPU, one direction, round numbers from the vendors' data sheets:
# NVLink4 900 GB/s bidirectional, NVLink5 1.8 TB/s, one 400/800 Gb/s NIC per GPU.
PRESETS: dict[str, dict[str, Any]] = {
    "dgx-h100": dict(nodes=1, gpus_per_node=8, nvlink_domain_gpus=8, nvlinks=18,
                     gpu_name="NVIDIA H100 80GB HBM3", gpu_memory_gb=80,
                     bandwidth={"nvlink": 450.0, "pcie": 64.0, "network": 50.0},
                     about="8 x H100 per node on NVSwitch (NVLink4), one 400 Gb/s InfiniBand NIC per GPU"),
    "dgx-a100": dict(nodes=1, gpus_per_node=8, nvlink_domain_gpus=8, nvlinks=12,
                     gpu_name="NVIDIA A100-SXM4-80GB", gpu_memory_gb=80,
                     bandwidth={"nvlink": 300.0, "pcie": 32.0, "network": 25.0},
                     about="8 x A100 per node on NVSwitch (NVLink3), one 200 Gb/s InfiniBand NIC per GPU"),
    "pcie-8gpu": dict(nodes=1, gpus_per_node=8, nvlink_domain_gpus=0, nvlinks=0,
                      gpu_name="PCIe GPU", gpu_memory_gb=48,
                      bandwidth={"pcie": 25.0, "network": 12.5},
                      about="8 PCIe GPUs per node without NVLink, 100 Gb/s Ethernet/InfiniBand per GPU"),
    "nvl72": dict(nodes=18, gpus_per_node=4, nvlink_domain_gpus=72, nvlinks=18,
                  gpu_name="NVIDIA GB200", gpu_memory_gb=186,
                  bandwidth={"nvlink": 900.0, "pcie": 64.0, "network": 100.0},
                  about="GB200 NVL72 rack: 18 compute trays of 4 GPUs, one 72-GPU NVLink5 domain per rack, "
                        "800 Gb/s per GPU between racks"),
}

COMPACT_KEYS = {"name", "preset", "nodes", "gpus_per_node", "nvlink_domain_gpus", "nvlinks", "gpu_name",
                "gpu_memory_gb", "bandwidth", "about"}
EXPLICIT_KEYS = {"name", "hosts", "bandwidth", "gpus", "source", "about"}
GPU_KEYS = {"node", "local", "domain", "name", "memory_gb", "uuid", "pci_bus", "numa", "nvlinks"}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def preset(name: str, nodes: int | None = None) -> Topology:
    """A built-in topology; ``nodes`` overrides its node count (``--topology dgx-h100 --nodes 2``)."""
    if name not in PRESETS:
        raise TopologyError(f"unknown topology preset {name!r}; use one of {', '.join(preset_names())}")
    return from_dict({"name": name, "preset": name}, nodes=nodes, source="preset")


def from_dict(spec: Mapping[str, Any], nodes: int | None = None, source: str = "described") -> Topology:
    """A topology from a parsed description (compact or explicit form, see the module doc)."""
    if "gpus" in spec:
        return _explicit(spec, nodes)
    unknown = sorted(set(spec) - COMPACT_KEYS)
    if unknown:
        raise TopologyError(f"unknown topology key(s) {unknown}; use {', '.join(sorted(COMPACT_KEYS))} "
                            "or the explicit form with [[gpus]]")
    base: dict[str, Any] = {}
    if "preset" in spec:
        if spec["preset"] not in PRESETS:
            raise TopologyError(f"unknown topology preset {spec['preset']!r}; use one of {', '.join(preset_names())}")
        base = dict(PRESETS[spec["preset"]])
        base["bandwidth"] = dict(base["bandwidth"])
    merged = {**base, **{k: v for k, v in spec.items() if k != "bandwidth"}}
    merged["bandwidth"] = {**base.get("bandwidth", {}), **spec.get("bandwidth", {})}
    required = [k for k in ("gpus_per_node", "nvlink_domain_gpus") if k not in merged]
    if required:
        raise TopologyError(f"topology description lacks {required} (or a preset = one of {', '.join(preset_names())})")
    n = nodes if nodes is not None else merged.get("nodes", 1)
    topo = uniform(
        name=str(merged.get("name", "described")),
        nodes=n,
        gpus_per_node=merged["gpus_per_node"],
        nvlink_domain_gpus=merged["nvlink_domain_gpus"],
        bandwidth=merged["bandwidth"],
        gpu_name=str(merged.get("gpu_name", "GPU")),
        gpu_memory_gb=float(merged.get("gpu_memory_gb", 0.0)),
        nvlinks=int(merged.get("nvlinks", 0)),
        source=source,
    )
    if "about" in merged:
        object.__setattr__(topo, "notes", (str(merged["about"]),))
    return topo


def _explicit(spec: Mapping[str, Any], nodes: int | None) -> Topology:
    unknown = sorted(set(spec) - EXPLICIT_KEYS)
    if unknown:
        raise TopologyError(f"unknown topology key(s) {unknown} in the explicit form; use {', '.join(sorted(EXPLICIT_KEYS))}")
    if nodes is not None:
        raise TopologyError("--nodes applies to presets and compact descriptions, not to an explicit [[gpus]] list")
    gpus = []
    for i, g in enumerate(spec["gpus"]):
        bad = sorted(set(g) - GPU_KEYS)
        if bad or "node" not in g or "local" not in g:
            raise TopologyError(f"gpus[{i}] = {dict(g)}: needs node and local, may have {', '.join(sorted(GPU_KEYS))}")
        gpus.append(Gpu(node=int(g["node"]), local=int(g["local"]),
                        domain=None if g.get("domain") is None else int(g["domain"]),
                        name=str(g.get("name", "GPU")), memory_gb=float(g.get("memory_gb", 0.0)),
                        uuid=str(g.get("uuid", "")), pci_bus=str(g.get("pci_bus", "")),
                        numa=None if g.get("numa") is None else int(g["numa"]), nvlinks=int(g.get("nvlinks", 0))))
    hosts = spec.get("hosts") or [f"node{i}" for i in range(max(g.node for g in gpus) + 1)]
    notes = (str(spec["about"]),) if "about" in spec else ()
    return Topology(name=str(spec.get("name", "described")), nodes=tuple(hosts), gpus=tuple(gpus),
                    bandwidth=dict(spec.get("bandwidth", {})), source=str(spec.get("source", "described")), notes=notes)


def load_toml(path: str | Path, nodes: int | None = None) -> Topology:
    """Read a TOML description; errors name the file and what is wrong."""
    path = Path(path)
    try:
        spec = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise TopologyError(f"topology file {str(path)!r} does not exist")
    except tomllib.TOMLDecodeError as e:
        raise TopologyError(f"topology file {str(path)!r} is not valid TOML: {e}")
    except UnicodeDecodeError as e:
        raise TopologyError(f"topology file {str(path)!r} is not UTF-8 text (byte {e.start}); give a TOML description")
    except OSError as e:
        raise TopologyError(f"cannot read topology file {str(path)!r}: {e.strerror or e}")
    spec.setdefault("name", path.stem)
    try:
        return from_dict(spec, nodes=nodes)
    except TopologyError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # a value of the wrong type in the file
        raise TopologyError(f"topology file {str(path)!r} has a bad value ({type(e).__name__}: {e}); "
                            f"see `pretrain topo --save` for the form") from None


def to_toml(topology: Topology) -> str:
    """The explicit TOML form of a topology (e.g. to save a detected one and plan with it later)."""
    d = topology.to_dict()
    lines = [f"name = {_toml_value(d['name'])}", f"source = {_toml_value(d['source'])}",
             f"hosts = {_toml_value(d['hosts'])}", "", "[bandwidth]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in d["bandwidth"].items()]
    for g in d["gpus"]:
        lines += ["", "[[gpus]]"] + [f"{k} = {_toml_value(v)}" for k, v in g.items()]
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
