"""The search behind `pretrain plan --auto`: every layout the trainer can run on ``world`` ranks.

Shapes: tp (powers of two dividing the heads), cp (1-8, ring), pp (up to 32) with 1F1B,
interleaved (vpp 2) or ZB-V, or 1F1B with uneven first / last stages when the layers do not split, ep (divisors of the experts) with expert tp 1 or tp;
each shape is checked by the config's own validation (and, under par's FP8, by its tile rule and the FP8
parameter gather's whole row blocks). For every shape, each micro-batch size
(1, 2, 4 sequences), recompute (none, selective, full) and ZeRO strategy whose per-rank memory
(:mod:`pretrain.sizing`, the closed form `plan --simulate` measures the trainer against: the
heaviest pipeline stage's model state and activations) fits the GPU less the headroom is
estimated (:mod:`.estimate`), and the shape keeps its fastest variant.

Pruning: memory is checked before anything is timed; the link and bandwidth of each group
pattern (stride, size) are computed once, on the fewest nodes that repeat it; pipeline
simulations are cached and capped at the micro-batches a schedule needs to reach steady state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

from ..errors import UsageError
from ..config.fp8_rules import fp8_tile_rule
from ..config.layout import Layout
from ..runtime.rank_assignment import workload
from ..sizing.activations import stage_peak_of
from ..sizing.flops import param_counts, training_flops_per_step
from ..sizing.offload import offloaded_bytes
from ..sizing.fp8 import fp8_compute_time
from ..sizing.fp8_gather_rows import fp8_gather_misfit
from ..sizing.params import rank_params
from ..sizing.state import grad_buffer, muon_elements, optim_bytes, params_state, state_dtypes
from .estimate import CANONICAL_ORDER, Cluster, Estimate, Shape, estimate, group_bandwidth

TP = (1, 2, 4, 8, 16, 32, 64)
CP = (1, 2, 4, 8)
MAX_PP = 32
MICRO_BATCH = (1, 2, 4)
ZERO = ("no_shard", "optim", "optim_grads", "optim_grads_params")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Choice:
    shape: Shape
    zero: str
    micro_batch: int
    microbatches: int
    recompute: str
    memory: float  # bytes per rank
    estimate: Estimate
    links: dict  # group type -> link class
    offload: tuple[str, ...] = ()  # [model].offload (with --auto-policy)


def zeros(cfg) -> tuple[str, ...]:
    """The ZeRO levels searched: ZeRO-3 alone under [train].fp8_param_gather (its gather)."""
    return ("optim_grads_params",) if cfg.train.fp8_param_gather else ZERO


def gather_bytes(m, t) -> float:
    """ZeRO-3's gathered bytes per parameter: bf16's 2, less with the FP8 linears' weights in FP8."""
    if not t.fp8_param_gather:
        return 2.0
    from ..sizing.fp8 import FP8_GATHER_BYTES_PER_PARAM, fp8_gathered_params_per_rank

    share = min(fp8_gathered_params_per_rank(m, SimpleNamespace(tp=1, pp=1)) / param_counts(m).total, 1.0)
    return 2.0 - share * (2.0 - FP8_GATHER_BYTES_PER_PARAM[t.fp8])


def pipelines(pp: int) -> tuple[tuple[str, int], ...]:
    return (("1f1b", 1),) if pp == 1 else (("1f1b", 1), ("interleaved", 2), ("zb-v", 1))


def shapes(cfg, world: int) -> list[Shape]:
    """Every shape whose config validates on ``world`` ranks."""
    m, t = cfg.model, cfg.train
    experts = [e for e in range(1, m.num_experts + 1) if m.num_experts % e == 0] if m.is_moe else [1]
    out = []
    for tp in (tp for tp in TP if m.heads % tp == 0 and world % tp == 0):
        for cp in CP:
            if (t.seq_len // cp) % tp or t.seq_len % (2 * cp):
                continue
            for pp in (p for p in range(1, MAX_PP + 1) if world % (tp * cp * p) == 0):
                if t.global_batch % (world // (tp * cp * pp)):
                    continue
                first, last = uneven_split(m.layers, pp)
                for schedule, vpp in pipelines(pp) if not first else (("1f1b", 1),) if first > 0 else ():
                    for ep in experts:
                        for etp in sorted({1, tp}) if m.is_moe else [tp]:
                            shape = Shape(world, tp, cp, pp, ep, etp, schedule, vpp, max(first, 0), last)
                            if (world // pp) % (etp * ep) == 0 and shape_config(cfg, shape) is not None:
                                out.append(shape)
    return out


def uneven_split(layers: int, pp: int) -> tuple[int, int]:
    """(0, 0) when ``layers`` split evenly over ``pp`` ranks; else Megatron-style first / last stage
    sizes with ceil(layers / pp) on every other rank (as Llama 3 405B's 126 layers on 16 stages:
    7 | 8 x 14 | 7); (-1, 0) when no such split exists."""
    if layers % pp == 0:
        return 0, 0
    per = -(-layers // pp)
    rest = layers - (pp - 2) * per
    if pp < 3 or not 2 <= rest <= 2 * per - 1:
        return -1, 0
    return rest - rest // 2, rest // 2


def shape_config(cfg, s: Shape):
    """``cfg`` with the shape's [parallel] (validated by the config itself), or None if it is invalid."""
    parallel = dataclasses.replace(cfg.parallel, tp=s.tp, cp=s.cp, pp=s.pp, vpp=s.vpp, schedule=s.schedule, ep=s.ep,
                                   etp=s.etp if cfg.model.is_moe else cfg.parallel.etp, cp_comm_type="p2p", hcp=(), zero=zeros(cfg)[0], hsdp_replicas=1,
                                   microbatches=0, order=CANONICAL_ORDER, first_stage_layers=s.first,
                                   last_stage_layers=s.last)
    try:
        return dataclasses.replace(cfg, parallel=parallel)
    except UsageError:
        return None


def light_layout(s: Shape, micro_batch: int = 1, microbatches: int = 1) -> Layout:
    """The shape's layout (its grid is never built: the search sizes, it does not place ranks)."""
    return Layout(s.world_size, s.tp, s.cp, s.pp, s.ep, s.etp, s.vpp, s.chunks_per_rank, s.tp > 1,
                  micro_batch, microbatches)


# With --auto-policy: per-module recompute lists searched beside the words (least recomputed first), each
# (but full) also with the whole first layers of each chunk offloaded (the ones waiting longest for their backward)
POLICIES = (("layernorm",), ("core_attn", "layernorm"), ("core_attn", "mlp"), ("core_attn", "mlp", "layernorm"))
OFFLOADS = (("layers:1",), ("layers:2",))


def best_variant(cfg, s: Shape, budget: float, peak: float, efficiency: float, cluster: Cluster,
                 policies: bool = False) -> Choice | None:
    """The fastest (micro-batch, recompute, ZeRO) of one shape whose heaviest stage fits ``budget`` bytes;
    ``policies``: the per-module recompute lists too."""
    m, t = cfg.model, cfg.train
    shaped = shape_config(cfg, s)
    dtypes, d = state_dtypes(shaped.train), s.dp * s.cp
    params = [rank_params(shaped, light_layout(s), stage) for stage in range(s.pp)]
    state = {z: [params_state(p.dense, p.experts, d, s.edp, z, dtypes, muon=muon_elements(t, p), optim=optim_bytes(t)).total
                 for p in params] for z in ZERO}
    if min(state[ZERO[-1]]) > budget:
        return None
    recomputes = RECOMPUTE + (POLICIES if policies else ())
    offloads = (shaped.model.offload,) + (tuple(o for o in OFFLOADS if o != shaped.model.offload) if policies else ())
    policy = [(r, o) for r in recomputes for o in offloads if not (o and r == "full")]
    variants = {(r, o): dataclasses.replace(shaped, model=dataclasses.replace(shaped.model, recompute=r, offload=o))
                for r, o in policy}
    flops = training_flops_per_step(m, t.seq_len, t.global_batch)
    compute_time = fp8_compute_time(m, t)  # FP8 GEMMs at FP8's rate
    if fp8_gather_misfit(shaped, light_layout(s), s.dp * s.cp):  # ZeRO-3's FP8 gather needs whole row blocks
        return None
    per_rank = t.global_batch // s.dp
    bandwidth = None
    best = None
    for mb in (b for b in MICRO_BATCH if per_rank % b == 0):
        microbatches = per_rank // mb
        if s.schedule == "interleaved" and microbatches % s.pp:
            continue
        layout = light_layout(s, mb, microbatches)
        if not fp8_fits(shaped, layout):
            continue
        work = workload(cfg, layout)
        fitting: dict = {}  # recompute -> the ZeRO strategies it fits without offload
        for recompute, offload in policy:
            # an offload only adds host time: it matters where the same recompute alone does not fit
            dominated = set(fitting.get(recompute, ())) if offload and not offloads[0] else set()
            if dominated >= set(zeros(cfg)):
                continue
            variant = variants[(recompute, offload)]
            acts = [stage_peak_of(variant, layout, stage) for stage in range(s.pp)]
            peaks = {z: max(a + b.with_grads(grad_buffer(shaped, layout, p, z)) for a, b, p in zip(state[z], acts, params))
                     for z in ZERO}  # the heaviest stage
            if not offload:
                fitting[recompute] = {z for z in ZERO if peaks[z] <= budget}
            if peaks[ZERO[-1]] > budget:
                continue
            bandwidth = bandwidth or group_bandwidth(s, cluster)
            moved = max(offloaded_bytes(variant, layout, stage) for stage in range(s.pp)) if offload else 0.0
            for zero in zeros(cfg):
                memory = peaks[zero]
                if memory > budget or zero in dominated:
                    continue
                est = estimate(s, work, zero, recompute, m, flops, peak, efficiency, bandwidth,
                               t.optimizer_declaration.matrix_dtype, gather_bytes(m, t), moved, cluster.host_gbps,
                               compute_time)
                choice = Choice(s, zero, mb, microbatches, recompute, memory, est,
                                {n: link for n, (_, link) in bandwidth.items()}, offload)
                if best is None or _key(choice) < _key(best):
                    best = choice
    return best


def fp8_fits(cfg, layout: Layout) -> bool:
    """Blockwise / MXFP8 tiles straddle no rank under ``layout`` (config/fp8_rules.py, which the trainer
    checks of the world: the cp chunk's tokens depend on the micro-batch, so it is asked per variant)."""
    try:
        fp8_tile_rule(cfg, layout)
    except UsageError:
        return False
    return True


def _key(c: Choice) -> tuple:
    """Fastest first; on a tie, the simpler layout (less sharding, recompute, parallelism)."""
    return (c.estimate.step_s, ZERO.index(c.zero), (RECOMPUTE + POLICIES).index(c.recompute),
            OFFLOADS.index(c.offload) + 1 if c.offload in OFFLOADS else 0, c.shape.tp * c.shape.cp * c.shape.pp)


def search(cfg, world: int, budget: float, peak: float, efficiency: float,
           cluster: Cluster, policies: bool = False) -> tuple[list[Choice], int]:
    """(every shape's best variant that fits, fastest first; how many shapes were tried)."""
    tried = shapes(cfg, world)
    found = [c for c in (best_variant(cfg, s, budget, peak, efficiency, cluster, policies) for s in tried) if c]
    return sorted(found, key=_key), len(tried)
