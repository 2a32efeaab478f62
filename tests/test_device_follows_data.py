"""Device follows the data, proven without a GPU.

Under ``FakeTensorMode`` tensors on device "cuda" exist on this CPU-only machine and run forward
(not backward), and torch's fake process group plays any rank of a multi-rank layout. Each
layout's model is built on fake CUDA, wrapped with a ZeRO strategy, and run forward; every
parameter, buffer, bucket and optimizer tensor must be on cuda and no op of the forward may
produce a CPU tensor. The meta device runs backward too: a whole step (forward, backward, grad
reduction, clipping, AdamW) runs on meta and must leave nothing on the CPU. With
``[model].backend='te'`` (tests/te_standin.py standing in for Transformer Engine) TE's modules must
be made on the weights' device: on meta that cannot be TE's own default, "cuda".
"""

import contextlib

import pytest
import te_standin
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from par_groups.testing.host_ops import CpuOutputs

BASE = ["model.layers=4", "train.seq_len=32", "train.global_batch=8"]

LAYOUTS = {  # id: (world, overrides); our ZeRO strategies, TP+SP, PP (1F1B and a V schedule), CP modes, HSDP
    "ddp": (1, ["parallel.zero=no_shard"]),
    "zero1-cp2-ring": (4, ["parallel.zero=optim", "parallel.cp=2", "parallel.cp_comm_type=p2p"]),
    "zero2-tp2-sp-cp2-a2a": (8, ["parallel.zero=optim_grads", "parallel.tp=2", "parallel.cp=2",
                                 "parallel.cp_comm_type=a2a"]),
    "zero2-tp2-sp-overlap": (4, ["parallel.zero=optim_grads", "parallel.tp=2", "parallel.tp_comm_overlap=true"]),
    "zero3-tp2-pp2": (8, ["parallel.zero=optim_grads_params", "parallel.tp=2", "parallel.pp=2"]),
    "zero3-pp2-zbv-hsdp": (8, ["parallel.zero=optim_grads_params", "parallel.pp=2", "parallel.schedule=zb-v",
                               "parallel.hsdp_replicas=2"]),
    # Transformer Engine's modules (tests/te_standin.py standing in) are made on the weights' device
    "zero2-tp2-sp-te": (4, ["parallel.zero=optim_grads", "parallel.tp=2", "model.backend=te"]),
}


def _fake_world(world: int):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _build(overrides, world, device, monkeypatch):
    from pretrain.config import load_config
    from par_groups import create_groups
    from pretrain.model.build import build_rank_model

    cfg = load_config(None, BASE + overrides)
    layout = cfg.validate_world(world)
    return cfg, layout, build_rank_model(cfg, layout, create_groups(layout.grid), device=torch.device(device))


def _state_tensors(rank_model) -> dict[str, torch.Tensor]:
    """Every tensor the rank holds: params, buffers, and the DP wrapper's buckets and optimizer state."""
    out = {f"param {n}": p for n, p in rank_model.module.named_parameters()}
    out |= {f"buffer {n}": b for n, b in rank_model.module.named_buffers()}
    for i, b in enumerate(getattr(rank_model.dp, "buckets", [])):
        for kind, ts in b.state_tensors().items():
            out |= {f"bucket {i} {kind} {k}": t for k, t in enumerate(ts) if t is not None}
        out[f"bucket {i} opt_grad"] = b.opt_grad
    optimizer = getattr(rank_model.dp, "optimizer", None)
    for k, state in enumerate(optimizer.state.values() if optimizer is not None else []):
        out |= {f"optim {k} {n}": t for n, t in state.items() if isinstance(t, torch.Tensor)}
    return out


def _forward(cfg, layout, rank_model, device):
    """Run each of this rank's chunks: tokens into the first, fake activations into the others."""
    s = cfg.train.seq_len // layout.cp
    outs = []
    for chunk in rank_model.chunks.values():
        if chunk.first:
            x = torch.randint(0, cfg.model.vocab_size, (s, 2), device=device)
        else:
            sp = layout.tp if layout.sequence_parallel else 1
            x = torch.randn(s // sp, 2, cfg.model.hidden, device=device)
        outs.append(rank_model.dp(x) if len(rank_model.chunks) == 1 else chunk(x))
    return outs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fake_cuda_model_buckets_and_forward_stay_on_cuda(name, monkeypatch):
    world, overrides = LAYOUTS[name]
    _fake_world(world)
    te = te_standin.installed() if "model.backend=te" in overrides else contextlib.nullcontext()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), te as record:
            cfg, layout, rank_model = _build(overrides, world, "cuda", monkeypatch)
            if "parallel.tp_comm_overlap=true" in overrides:  # the key reaches every TP layer
                flags = [m.comm_overlap for c in rank_model.chunks.values() for m in c.modules() if hasattr(m, "comm_overlap")]
                assert flags and all(flags)
            where = {n: t.device.type for n, t in _state_tensors(rank_model).items()}
            assert where and all(d == "cuda" for d in where.values()), {n: d for n, d in where.items() if d != "cuda"}
            recorder = CpuOutputs()
            with recorder:
                outs = _forward(cfg, layout, rank_model, "cuda")
            assert all(o.device.type == "cuda" for o in outs)
            assert not recorder.ops, f"ops that produced CPU tensors in the forward: {sorted(set(recorder.ops))}"
            if record is not None:
                assert record.norm_linear_calls > 0 and record.devices == {"cuda"}, record
    finally:
        dist.destroy_process_group()


class _MeshBuilt(Exception):
    pass


def test_torch_fsdp2_mesh_takes_the_params_device_type(monkeypatch):
    """torch's fully_shard initializes CUDA itself, so under fake CUDA only its mesh is checked."""
    from torch.distributed.device_mesh import DeviceMesh

    seen = []

    def from_group(group, device_type, *args, **kwargs):
        seen.append(device_type)
        raise _MeshBuilt

    monkeypatch.setattr(DeviceMesh, "from_group", staticmethod(from_group))
    _fake_world(2)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(_MeshBuilt):
            _build(["parallel.zero=torch_fsdp2"], 2, "cuda", monkeypatch)
    finally:
        dist.destroy_process_group()
    assert seen == ["cuda"]


@pytest.mark.parametrize("world,overrides", [
    (1, ["parallel.zero=no_shard"]),
    (4, ["parallel.zero=optim_grads_params", "parallel.tp=2", "parallel.cp=2", "parallel.cp_comm_type=a2a"]),
    (4, ["parallel.zero=optim_grads", "parallel.pp=2", "parallel.schedule=1f1b"]),
    (2, ["parallel.zero=optim_grads", "parallel.tp=2", "model.backend=te"]),  # TE's modules on meta too
], ids=["ddp", "zero3-tp2-cp2-a2a", "zero2-pp2", "zero2-tp2-te"])
def test_meta_step_leaves_nothing_on_cpu(world, overrides, monkeypatch):
    """Forward, backward, grad reduction, clipping and AdamW on the meta device: no op makes a CPU tensor.
    (The fake process group has no meta backend for batched send/recv, so the ring CP mode is not here.)"""

    _fake_world(world)
    te = te_standin.installed() if "model.backend=te" in overrides else contextlib.nullcontext()
    try:
        with te as record:
            _meta_step(overrides, world, monkeypatch)
        if record is not None:  # TE's modules: made on the weights' device (TE's own default is "cuda")
            assert record.norm_linear_calls > 0 and record.devices == {"meta"}, record
    finally:
        dist.destroy_process_group()


def _meta_step(overrides, world, monkeypatch):
    """One whole step on the meta device; asserts no op made a CPU tensor and every state tensor is on meta."""
    cfg, layout, rank_model = _build(overrides, world, "meta", monkeypatch)
    dp, recorder = rank_model.dp, CpuOutputs()
    with recorder:
        outs = _forward(cfg, layout, rank_model, "meta")
        sum(o.float().sum() for o in outs).backward()
        dp.reduce_grads()
        dp.clip_grad_norm_(1.0, norm_groups=(rank_model.groups.tp, rank_model.groups.pp))
        dp.set_lr(1e-3)
        dp.step()
        dp.zero_grad()
    assert not recorder.ops, f"ops that produced CPU tensors in the step: {sorted(set(recorder.ops))}"
    where = {n: t.device.type for n, t in _state_tensors(rank_model).items()}
    assert where and all(d == "meta" for d in where.values()), {n: d for n, d in where.items() if d != "meta"}
