"""``zero = "torch_fsdp2"`` keeps the run's mixed precision: a bf16 run (bf16 grad reduction) all-gathers
and reduce-scatters half the bytes of an fp32 run, counted from the collectives torch dispatches (one
rank of a world of 2 on torch's fake process group), and its params compute in bf16 over fp32 shards."""

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

BASE = ["model.layers=2", "train.seq_len=32", "train.global_batch=8", "parallel.zero=torch_fsdp2"]
PRECISIONS = {"fp32": ["train.dtype=fp32"], "bf16": ["train.dtype=bf16", "train.grad_reduce_dtype=bf16"],
              "bf16-fp32-reduce": ["train.dtype=bf16"]}
# c10d ops FSDP2 issues -> (kind, the argument whose bytes count: the gathered output, the unreduced input)
COLLECTIVES = {"_allgather_base_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
               "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1)}


class CollectiveBytes(TorchDispatchMode):
    """Bytes by collective kind (and the dtypes seen) of the c10d collectives dispatched under it."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = {}
        self.dtypes: dict[str, set] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "c10d" and name in COLLECTIVES:
            kind, arg = COLLECTIVES[name]
            tensors = args[arg] if isinstance(args[arg], (list, tuple)) else [args[arg]]
            self.bytes[kind] = self.bytes.get(kind, 0) + sum(t.numel() * t.element_size() for t in tensors)
            self.dtypes.setdefault(kind, set()).update(t.dtype for t in tensors)
        return func(*args, **(kwargs or {}))


def _step_bytes(overrides):
    from par_groups import create_groups
    from pretrain.config import load_config
    from pretrain.model.build import build_rank_model

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        cfg = load_config(None, BASE + overrides)
        layout = cfg.validate_world(2)
        rank_model = build_rank_model(cfg, layout, create_groups(layout.grid), device=torch.device("cpu"))
        x = torch.randint(0, cfg.model.vocab_size, (cfg.train.seq_len, 2))
        with CollectiveBytes() as rec:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train.dtype == "bf16"):
                out = rank_model.dp(x)
            out.float().sum().backward()
        policy = rank_model.dp.module._get_fsdp_state()._mp_policy
        return rec, policy
    finally:
        dist.destroy_process_group()


def test_bf16_fsdp2_moves_half_the_bytes_of_fp32():
    fp32, p32 = _step_bytes(PRECISIONS["fp32"])
    bf16, p16 = _step_bytes(PRECISIONS["bf16"])
    assert p32.param_dtype in (None, torch.float32) and (p16.param_dtype, p16.reduce_dtype) == (torch.bfloat16,) * 2
    assert fp32.bytes["all_gather"] > 0 and fp32.bytes["reduce_scatter"] > 0, fp32.bytes
    assert bf16.bytes["all_gather"] * 2 == fp32.bytes["all_gather"], (bf16.bytes, fp32.bytes)
    assert bf16.bytes["reduce_scatter"] * 2 == fp32.bytes["reduce_scatter"], (bf16.bytes, fp32.bytes)
    assert bf16.dtypes == {"all_gather": {torch.bfloat16}, "reduce_scatter": {torch.bfloat16}}, bf16.dtypes


def test_bf16_fsdp2_reduces_in_fp32_by_default_like_our_zero():
    fp32, _ = _step_bytes(PRECISIONS["fp32"])
    mixed, policy = _step_bytes(PRECISIONS["bf16-fp32-reduce"])
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed.bytes["all_gather"] * 2 == fp32.bytes["all_gather"]
    assert mixed.bytes["reduce_scatter"] == fp32.bytes["reduce_scatter"] and mixed.dtypes["reduce_scatter"] == {torch.float32}


def test_fsdp2_optimizer_takes_the_devices_fastest_kernels():
    from par_zero.optimizer_choice import fastest_implementation

    assert fastest_implementation(torch.optim.AdamW, torch.device("cuda")) == {"fused": True}
    assert fastest_implementation(torch.optim.RMSprop, torch.device("cuda")) == {"foreach": True}
    assert fastest_implementation(torch.optim.AdamW, torch.device("cpu")) == {}  # the per-tensor loop, as measured
    assert fastest_implementation(torch.optim.AdamW, torch.device("cuda"), {"foreach": False}) == {}  # the user's
