"""What a cluster launch file asks for: nodes, GPUs per node and the time between its SIGTERM and the kill.

Read from an sbatch script's ``#SBATCH`` lines (``--nodes``, ``--gpus-per-node``, ``--signal=[B:]TERM@S``), a
Kubernetes JobSet (each replicated job's ``parallelism`` x ``replicas``, the container's ``nvidia.com/gpu``
limit, ``terminationGracePeriodSeconds``), a Kubeflow Trainer TrainJob (``numNodes``, ``resourcesPerNode``; the
grace from the TrainingRuntime in the same file) or a SkyPilot task (``num_nodes``, ``resources.accelerators``; a
spot VM is reclaimed without a grace the file could set). Never executed, only read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError, shown

GPU_KEY = "nvidia.com/gpu"


@dataclass(frozen=True)
class LaunchFile:
    path: str
    kind: str  # slurm | jobset | trainjob | skypilot
    nodes: int | None
    gpus_per_node: int | None
    grace_s: float | None  # seconds from the SIGTERM to the kill; None: the file cannot set one
    grace_words: str  # how the file says it


def read_launch_file(path: str) -> LaunchFile:
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read launch file {path!r} ({getattr(e, 'strerror', None) or e}); give an sbatch "
                         f"script, a JobSet or a SkyPilot YAML, e.g. tools/cluster/pretrain.sbatch") from None
    if "#SBATCH" in text:
        return _slurm(path, text)
    if p.suffix not in (".yaml", ".yml"):
        raise UsageError(f"{path} has no #SBATCH line and is not a .yaml file; give an sbatch script, a JobSet or a "
                         f"SkyPilot YAML, e.g. tools/cluster/pretrain.sbatch")
    doc = _yaml(path, text)
    if doc.get("kind") == "TrainJob":
        return _trainjob(path, doc)
    if doc.get("kind") == "JobSet":
        return _jobset(path, doc)
    if "run" in doc or "num_nodes" in doc:
        return _skypilot(path, doc)
    raise UsageError(f"{path} is neither a JobSet (kind: JobSet) nor a SkyPilot task (run:, num_nodes:)")


def _count(path: str, what: str, value) -> int:
    try:
        n = int(str(value).rsplit(":", 1)[-1])  # --gpus-per-node=h100:8, accelerators H100:8
    except ValueError:
        n = 0
    if n < 1:
        raise UsageError(f"{path}: {what} {shown(value)} is not a count >= 1")
    return n


def _slurm(path: str, text: str) -> LaunchFile:
    options = {}
    for line in text.splitlines():
        m = re.match(r"#SBATCH\s+(--[\w-]+|-N)(?:[= ]\s*(\S+))?", line)
        if m:
            options[{"-N": "--nodes"}.get(m[1], m[1])] = m[2]
    nodes = _count(path, "--nodes", options["--nodes"]) if options.get("--nodes") else None
    gpus = _count(path, "--gpus-per-node", options["--gpus-per-node"]) if options.get("--gpus-per-node") else None
    signal = options.get("--signal")
    m = re.fullmatch(r"(?:R:)?(B:)?(?:SIG)?(TERM|15)@(\d+)", signal or "")
    if not m:
        raise UsageError(f"{path}: #SBATCH --signal={signal or ''} does not send SIGTERM before the time limit; add "
                         f"#SBATCH --signal=B:TERM@180 (the ranks save on SIGTERM; without it the limit kills them)")
    return LaunchFile(path, "slurm", nodes, gpus, float(m[3]), f"--signal={signal}")


def _yaml(path: str, text: str) -> dict:
    try:
        import yaml
    except ImportError:
        raise UsageError("reading a YAML launch file needs PyYAML in the environment that runs pretrain: `uv sync` "
                         "installs it (the dev group); elsewhere `uv pip install pyyaml`") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise UsageError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    # a TrainJob with its TrainingRuntime: the TrainJob, the runtime under "runtime"
    kinds = [d.get("kind") if isinstance(d, dict) else None for d in docs]
    if len(docs) == 2 and sorted(map(str, kinds)) == ["TrainJob", "TrainingRuntime"]:
        return docs[kinds.index("TrainJob")] | {"runtime": docs[kinds.index("TrainingRuntime")]}
    doc = docs[0] if len(docs) == 1 else None
    if not isinstance(doc, dict):
        raise UsageError(f"{path} is not a YAML mapping (a JobSet or a SkyPilot task)")
    return doc


def _at(path: str, doc, *keys):
    for key in keys:
        if not isinstance(doc, dict) or key not in doc:
            raise UsageError(f"{path}: {'.'.join(map(str, keys))} is missing")
        doc = doc[key]
    return doc


def _jobset(path: str, doc: dict) -> LaunchFile:
    jobs = _at(path, doc, "spec", "replicatedJobs")
    if not isinstance(jobs, list) or len(jobs) != 1:
        raise UsageError(f"{path}: spec.replicatedJobs must hold one job (the nodes), not {shown(jobs)}")
    job = _at(path, jobs[0], "template", "spec")
    nodes = _count(path, "parallelism x replicas", _at(path, job, "parallelism")) * int(jobs[0].get("replicas", 1))
    pod = _at(path, job, "template", "spec")
    containers = _at(path, pod, "containers")
    limits = (containers[0].get("resources", {}) or {}).get("limits", {}) if containers else {}
    gpus = _count(path, GPU_KEY, limits[GPU_KEY]) if GPU_KEY in limits else None
    return LaunchFile(path, "jobset", nodes, gpus, _grace(path, pod), f"terminationGracePeriodSeconds: {_grace(path, pod):g}")


def _grace(path: str, pod: dict) -> float:
    if "terminationGracePeriodSeconds" not in pod:
        raise UsageError(f"{path}: the pod template has no terminationGracePeriodSeconds: Kubernetes' default 30 s kills "
                         f"the ranks in their save; set it to [train].preempt_timeout_s + 60 s")
    grace = pod["terminationGracePeriodSeconds"]
    if not isinstance(grace, int) or grace < 0:
        raise UsageError(f"{path}: terminationGracePeriodSeconds {shown(grace)} is not a number of seconds")
    return float(grace)


def _trainjob(path: str, doc: dict) -> LaunchFile:
    """A Kubeflow Trainer TrainJob: its nodes and GPUs; the grace period from its TrainingRuntime (same file)."""
    trainer = _at(path, doc, "spec", "trainer")
    nodes = _count(path, "spec.trainer.numNodes", _at(path, trainer, "numNodes"))
    limits = (trainer.get("resourcesPerNode") or {}).get("limits", {}) or {}
    gpus = _count(path, GPU_KEY, limits[GPU_KEY]) if GPU_KEY in limits else None
    if "runtime" not in doc:
        raise UsageError(f"{path}: no TrainingRuntime beside the TrainJob: its pods' terminationGracePeriodSeconds is "
                         f"set there (Kubernetes' default 30 s kills the ranks in their save)")
    jobs = _at(path, doc, "runtime", "spec", "template", "spec", "replicatedJobs")
    if not isinstance(jobs, list) or len(jobs) != 1:
        raise UsageError(f"{path}: the TrainingRuntime's replicatedJobs must hold one job (the nodes), not {shown(jobs)}")
    grace = _grace(path, _at(path, jobs[0], "template", "spec", "template", "spec"))
    return LaunchFile(path, "trainjob", nodes, gpus, grace, f"terminationGracePeriodSeconds: {grace:g}")


def _skypilot(path: str, doc: dict) -> LaunchFile:
    nodes = _count(path, "num_nodes", doc.get("num_nodes", 1))
    accelerators = (doc.get("resources") or {}).get("accelerators")
    if isinstance(accelerators, dict) and len(accelerators) == 1:
        accelerators = next(iter(accelerators.values()))
    gpus = _count(path, "resources.accelerators", accelerators) if accelerators is not None else None
    return LaunchFile(path, "skypilot", nodes, gpus, None, "")
