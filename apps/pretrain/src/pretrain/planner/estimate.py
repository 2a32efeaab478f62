"""Step time of one layout, estimated: compute, pipeline bubble, exposed communication.

The assumptions decide the ranking, so `plan --auto` prints them (:data:`ASSUMPTIONS`); the
default efficiency, 0.6 of peak, is a round figure for large bf16 GEMMs and flash attention on
H100-class GPUs, not a measurement: pass your own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from types import SimpleNamespace

from par_groups.topology import LINK_CLASSES, Workload, bytes_per_step
from par_groups.topology.cost import exposed_share
from par_groups.topology.assignment import MULTI_RAIL
from par_groups import ParallelDims
from par_pp import Costs, build_schedule, chunks_per_rank, simulate

from ..sizing.muon_comm import muon_wire_per_element

GRADIENT_GROUPS = ("dp", "dp_cp", "edp")
ASSUMPTIONS = (
    "compute: the model FLOPs of a step plus what recomputation repeats (full: every layer's forward again; "
    "selective: the attention core forward), spread evenly over the ranks, at the GPU's peak bf16 rate x efficiency",
    "bubble: par-pp's simulator on the schedule (F = 1 slot, B = 2, or 1 + 1 split for ZB-V; +1 with full "
    "recompute); past pp micro-batches (2 x pp for ZB-V) the idle time is carried over (steady state)",
    "communication: par_groups' rank-assignment cost model with groups in order tp-cp-ep-dp-pp on ranks numbered node "
    "by node: bytes per step of each group type / bandwidth of the slowest link its groups cross x the share not "
    "hidden (tp, ep, etp and CP all-to-all 100 %; CP ring, gradient reductions and pipeline sends 50 %)",
    "gradients: fp32 all-reduce (DDP); ZeRO-1/2 reduce-scatter them and all-gather bf16 parameters once per step; "
    "ZeRO-3 all-gathers parameters for the forward and the backward of every micro-batch",
    "memory: pretrain.sizing's closed form of the heaviest pipeline stage (model state in par-zero's convention: "
    "bf16 params, grads in [train].grad_reduce_dtype, fp32 main weights and Adam moments; activations as the "
    "trainer saves them), the figures `plan --simulate` measures the trainer against, within the GPU's memory "
    "less the headroom",
)
# with --auto-policy (the search takes [model].offload too)
OFFLOAD_ASSUMPTION = ("offload: the busiest stage's offloaded bytes per step go to the host during the forward (a third of "
                      "its model compute) and come back during the backward and recomputation, over the topology's pcie "
                      "bandwidth each way; what a window cannot hide is exposed (offload comm)")
CANONICAL_ORDER = "tp-cp-ep-dp-pp"


@dataclass(frozen=True)
class Shape(ParallelDims):
    """The structure of a layout (what the groups are: :class:`ParallelDims` and the schedule), without
    batching, ZeRO or recompute."""

    schedule: str = "1f1b"
    vpp: int = 1
    first: int = 0  # layers on the first / last pipeline rank when the layers do not split evenly (0: even)
    last: int = 0

    def heaviest_stage(self, layers: int) -> int:
        """Layers on the busiest pipeline rank (the middle ones under an uneven split)."""
        if not self.first:
            return layers // self.pp
        return max(self.first, self.last, (layers - self.first - self.last) // max(1, self.pp - 2))

    @property
    def chunks_per_rank(self) -> int:
        return chunks_per_rank(self.schedule, self.pp, self.vpp)


@dataclass(frozen=True)
class Estimate:
    compute_s: float  # busy time of one rank, recomputation included
    bubble_s: float  # pipeline idle time
    comm_s: dict  # exposed seconds per group type
    step_s: float
    mfu: float


@lru_cache(maxsize=4096)
def recompute_fraction(m, seq_len: int, recompute) -> float:
    """Extra FLOPs of recomputation as a fraction of the model FLOPs of a token."""
    from ..sizing.flops import training_flops_per_token

    total = training_flops_per_token(m, seq_len)
    if not isinstance(recompute, str):  # a list of modules: each layer's reruns' forward FLOPs
        return sum(module_forward_flops(m, seq_len, i, recompute) for i in range(m.layers)) / total
    if recompute == "full":  # forward of every layer again: a third of its forward + backward
        head = 6.0 * m.vocab_size * m.hidden
        return (total - head) / 3 / total
    if recompute == "selective":  # the attention core forward (2 x s x h per layer)
        return 2.0 * m.layers * seq_len * m.hidden / total
    return 0.0


def module_forward_flops(m, seq_len: int, i: int, recompute) -> float:
    """Per token: the forward FLOPs layer ``i`` runs again under the module list ``recompute`` (matmuls
    only: the norms and activations are a rounding error of them)."""
    from ..blocks.recompute_policy import modules_at
    from ..sizing.flops import training_flops_per_token

    modules = modules_at(recompute, i)
    if "full" in modules:
        head = 6.0 * m.vocab_size * m.hidden
        return (training_flops_per_token(m, seq_len) - head) / 3 / m.layers
    flops = 0.0
    if modules & {"core_attn", "mla_up_proj"}:
        flops += 2.0 * seq_len * m.hidden  # the attention core, as "selective"
    if "mla_up_proj" in modules:
        flops += 2.0 * m.heads * (m.q_lora_rank * m.qk_head_dim + m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim))
    if m.is_moe_layer(i):
        if "moe" in modules:
            flops += 6.0 * m.hidden * m.expert_ffn_hidden * (m.top_k + m.shared_experts) + 2.0 * m.hidden * m.num_experts
    elif "mlp" in modules:
        flops += 6.0 * m.hidden * m.ffn_hidden
    return flops


def host_seconds(offloaded: float, host_gbps: float, forward_s: float, backward_s: float) -> float:
    """Exposed time of ``[model].offload``'s copies: the bytes go out during the forward and come back
    during the backward (recomputation included), each direction on its own side stream; what does not
    fit its window waits."""
    copy = offloaded / (host_gbps * 1e9)
    return max(0.0, copy - forward_s) + max(0.0, copy - backward_s)


@lru_cache(maxsize=4096)
def pipeline_idle(schedule: str, pp: int, vpp: int, microbatches: int, full_recompute: bool) -> tuple[float, float]:
    """(idle, busy) slots of one rank for ``microbatches``, from par-pp's simulator."""
    if pp == 1:
        return 0.0, 1.0
    b = 2.0 if full_recompute else 1.0
    costs = Costs(f=1.0, b=b, w=1.0, full_backward=b + 1.0)
    steady = 2 * pp if schedule in ("zb-v", "dualpipev") else pp  # V schedules fill over two passes
    simulated = min(microbatches, steady)
    result = simulate(build_schedule(schedule, pp, simulated, vpp=vpp), costs)
    busy = result.makespan - min(result.idle_time(r) for r in range(pp))
    idle = result.makespan - busy
    return idle, busy * microbatches / simulated


def pattern_groups(stride: int, size: int, world: int) -> list[list[int]]:
    """Groups of ``size`` ranks ``stride`` apart, as one dimension of a grid whose faster dimensions
    span ``stride`` ranks: in order tp-cp-ep-dp-pp every group type is one such pattern."""
    block = stride * size
    return [[b * block + o + i * stride for i in range(size)] for b in range(world // block) for o in range(stride)]


def patterns(shape: Shape) -> dict[str, tuple[int, int]]:
    """(stride, size) of each group type under the canonical order."""
    s = shape
    out = {"tp": (1, s.tp), "cp": (s.tp, s.cp), "dp": (s.tp * s.cp, s.dp), "dp_cp": (s.tp, s.cp * s.dp),
           "ep": (s.etp, s.ep), "etp": (1, s.etp), "edp": (s.etp * s.ep, s.edp), "pp": (s.world_size // s.pp, s.pp)}
    return {name: p for name, p in out.items() if p[1] > 1}


def group_bandwidth(shape: Shape, cluster: Cluster) -> dict:
    """GB/s and link class per group type: par_groups' placement model on each group pattern."""
    return {name: pattern_bandwidth(stride, size, name in MULTI_RAIL, cluster)
            for name, (stride, size) in patterns(shape).items()}


@dataclass(frozen=True)
class Cluster:
    """A described cluster (``[topology]`` preset or compact TOML file) and its node / NVLink domain sizes."""

    spec: object  # pretrain.config.TopologyConfig
    per_node: int
    domain: int  # GPUs per NVLink domain, 1 without NVLink
    host_gbps: float = 0.0  # host <-> GPU, one direction (the topology's pcie bandwidth): [model].offload's copies


@lru_cache(maxsize=4096)
def pattern_bandwidth(stride: int, size: int, multi_rail: bool, cluster: Cluster) -> tuple[float, str]:
    """The slowest link and bandwidth of the pattern's groups on the smallest whole number of nodes
    and NVLink domains that repeats it (groups repeat with the pattern's block)."""
    from ..runtime.rank_assignment import described_topology

    world = math.lcm(stride * size, cluster.per_node, cluster.domain)
    topo = described_topology(SimpleNamespace(topology=replace(cluster.spec, nodes=world // cluster.per_node)), world)
    groups = pattern_groups(stride, size, world)
    link = max((topo.group_link(g) for g in groups), key=LINK_CLASSES.index)
    return min(topo.group_gbps(g, multi_rail=multi_rail) for g in groups), link


def sizes(shape: Shape) -> SimpleNamespace:
    """What the cost model reads of a grid, without building the world's rank lists."""
    return SimpleNamespace(tp=shape.tp, cp=shape.cp, pp=shape.pp, ep=shape.ep, etp=shape.etp, dp=shape.dp,
                           edp=shape.edp, hcp=None)


def comm_seconds(shape: Shape, work: Workload, zero: str, bandwidth: dict, muon_ns: str | None = None,
                 gather_bytes: float = 2.0) -> dict:
    """Exposed seconds per group type for one step (``muon_ns``: Muon's Newton-Schulz dtype, None: AdamW;
    ``gather_bytes``: ZeRO-3's gathered bytes per parameter, below bf16's 2 with [train].fp8_param_gather)."""
    grid = sizes(shape)
    out = {}
    for name, nbytes in bytes_per_step(grid, work).items():
        gbps, _ = bandwidth[name]
        if name in GRADIENT_GROUPS:
            nbytes *= zero_traffic(zero, work, muon_ns, gather_bytes)
        out[name] = nbytes / (gbps * 1e9) * exposed_share(name, grid, work)
    return out


def zero_traffic(zero: str, work: Workload, muon_ns: str | None = None, gather_bytes: float = 2.0) -> float:
    """Gradient-group bytes relative to an fp32 all-reduce (2 x grad_bytes per parameter); with Muon
    (``muon_ns``) plus its owners' exchange (sizing/muon_comm.py), every parameter taken as a matrix."""
    allreduce = 2.0 * work.grad_bytes
    muon = muon_wire_per_element(zero, muon_ns) / allreduce if muon_ns else 0.0
    if zero == "no_shard":
        return 1.0 + muon
    if zero in ("optim", "optim_grads"):  # reduce-scatter grads, all-gather bf16 params once
        return (work.grad_bytes + 2.0) / allreduce + muon
    return (work.grad_bytes + gather_bytes * 2 * work.microbatches) / allreduce + muon  # ZeRO-3: gathers per micro-batch


def estimate(shape: Shape, work: Workload, zero: str, recompute: str, model, model_flops: float,
             peak_flops: float, efficiency: float, bandwidth: dict, muon_ns: str | None = None,
             gather_bytes: float = 2.0, offloaded: float = 0.0, host_gbps: float = 0.0,
             compute_time: float = 1.0) -> Estimate:
    """Step time and MFU (against ``peak_flops``, bf16's) of one layout; ``offloaded``: the bytes per step
    the busiest stage's ``[model].offload`` moves out and back over ``host_gbps`` (:func:`host_seconds`);
    ``compute_time``: the compute's time relative to all of it at bf16's rate (below 1 with FP8 GEMMs:
    sizing/fp8.py)."""
    stage = shape.heaviest_stage(model.layers) * shape.pp / model.layers  # the busiest stage sets the pace
    forward = model_flops / shape.world_size * stage / 3 * compute_time / (peak_flops * efficiency)
    compute = model_flops / shape.world_size * (1.0 + recompute_fraction(model, work.seq_len, recompute)) * compute_time
    compute *= stage
    compute /= peak_flops * efficiency
    idle, busy = pipeline_idle(shape.schedule, shape.pp, shape.vpp, work.microbatches,
                               recompute == "full" or recompute == ("full",))
    bubble = compute * idle / busy if shape.pp > 1 else 0.0
    comm = comm_seconds(shape, work, zero, bandwidth, muon_ns, gather_bytes)
    if offloaded:
        comm["offload"] = host_seconds(offloaded, host_gbps, forward, compute - forward)
    step = compute + bubble + sum(comm.values())
    return Estimate(compute, bubble, comm, step, model_flops / (shape.world_size * peak_flops * step))
