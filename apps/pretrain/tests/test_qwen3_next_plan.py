"""`plan` sizes a Qwen3-Next model's recurrent states: per linear layer and micro-batch, one state is
value heads/tp x linear_key_dim x linear_value_dim fp32 values per sequence, and context parallelism
passes one per boundary between ranks' pieces, forward and backward (the bytes par-cp's test records:
packages/par-cp/tests/test_delta_rule.py); a family without such layers reports none. `plan --simulate`
(the trainer's step on fake tensors, bf16 autocast as on a GPU) measures the activations the plan sizes
from the family's declaration (``models/qwen3_next/memory.py``: the chunked rule's saved set, the conv's
inputs), within 10 %; with the linear layers' core recomputed (``selective``, ``core_attn``), within 5 %."""

import json

import os

import pytest

from typer.testing import CliRunner

from pretrain.cli import app

Q = ["--set", "model.attention=qwen3_next", "--set", "model.layers=8", "--set", "model.linear_value_heads=8",
     "--set", "model.linear_key_dim=16", "--set", "model.linear_value_dim=32"]


def _plan(*args):
    res = CliRunner().invoke(app, ["plan", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_plan_sizes_the_recurrent_states_and_the_state_pass():
    for world, cp, tp, boundaries in ((2, 2, 1, 1), (4, 4, 1, 2), (4, 2, 2, 1)):
        plan = _plan("--world", str(world), *Q, "--set", f"parallel.cp={cp}", "--set", f"parallel.tp={tp}")
        b, state = plan["layout"]["micro_batch"], plan["recurrent_state"]
        assert state["linear_layers"] == 6  # a full-attention layer every 4th
        assert state["state_bytes"] == b * 8 // tp * 16 * 32 * 4
        assert state["cp_state_bytes_per_layer"] == 2 * boundaries * state["state_bytes"], (world, cp, tp)
        channels = (2 * 4 * 16 + 8 * 32) // tp  # q and k of the key heads, v of the value heads
        assert state["cp_halo_bytes_per_layer"] == 2 * boundaries * b * 3 * channels * 2  # bf16 (a GPU run)
    assert "recurrent_state" not in _plan("--world", "2", "--set", "parallel.cp=2")


def test_all_to_all_over_more_ranks_than_key_heads_is_one_error_line():
    from one_error_line import assert_one_error_line

    for kind in (["--set", "parallel.cp_comm_type=a2a"], ["--set", "parallel.cp_comm_type=a2a+p2p", "--set", "parallel.hcp=[4,1]"]):
        res = CliRunner().invoke(app, ["plan", "--world", "4", *Q, "--set", "model.linear_key_heads=2", "--set",
                                       "parallel.cp=4", *kind])
        assert_one_error_line(res, "linear_key_heads", "splits the linear layers' key heads over 4 ranks, which does not "
                                                       "divide the 2 [model].linear_key_heads per tp rank")


@pytest.mark.parametrize("recompute", ["selective", '["core_attn"]', '["core_attn@0-3", "layernorm", "mlp"]'])
def test_plan_keeps_the_linear_layers_declared_set_under_each_recompute(recompute):
    """A linear layer's kept set in the plan is ``memory.gdn_saved_per_token``'s under the modules its layer
    recomputes: the core (``core_attn``, ``selective``) keeps the checkpoint's inputs; the word and a module
    list alike, per layer range, beside the norms' and the MLP's own terms."""
    from pretrain.blocks.recompute_policy import modules_at
    from pretrain.config import load_config
    from pretrain.models.qwen3_next.memory import gdn_saved_per_token
    from pretrain.sizing.activations import layer_per_token

    cfg = load_config(None, [q for q in Q if q != "--set"] + ["parallel.tp=2", f"model.recompute={recompute}"])
    m, layout = cfg.model, cfg.validate_world(2)
    linear = 6 / 8  # of the layers, averaged over the pattern (a full-attention layer every 4th)
    for i in range(m.layers):
        modules = modules_at(m.recompute, i)
        gdn = {core: gdn_saved_per_token(m, 2, 1, 2, layout.micro_batch, core)  # bf16, as on a GPU
               for core in ("none", "selective")}
        want = linear * (gdn["selective"] - gdn["none"]) if "core_attn" in modules else 0.0
        same = [x for x in ("layernorm", "mlp") if x in modules]  # their own terms, the attention's untouched
        base = layer_per_token(cfg, layout, i, tuple(same) or "none")
        assert layer_per_token(cfg, layout, i, m.recompute) - base == pytest.approx(want, rel=1e-9), (i, modules)


SIMULATED = ["model.attention=qwen3_next", "model.hidden=512", "model.heads=4", "model.kv_heads=2",
             "model.kv_channels=128", "model.linear_key_heads=4", "model.linear_value_heads=8",
             "model.linear_key_dim=64", "model.linear_value_dim=64", "model.ffn_hidden=1024", "model.vocab_size=8192",
             "train.global_batch=2", "train.seq_len=1024"]


@pytest.mark.extended  # ~10 s; the default tier checks the declaration against a forward's saved tensors
def test_simulate_measures_the_planned_activations():  # (test_gdn_context_parallel.py)
    """cp 2 x tp 2 (SP), rank 1: both its pieces take the affine form; a linear layer and a full one
    """
    from pretrain.config import load_config
    from pretrain.simulate.report import simulate

    cfg = load_config("llama3-8b", SIMULATED + ["model.layers=2", "model.full_attention_interval=2", "parallel.tp=2",
                                                "parallel.cp=2", "model.recompute=none"])
    (rank,) = simulate(cfg, 4, [1])["ranks"]
    assert rank["measured"]["activations"] == pytest.approx(rank["planned"]["activations"], rel=0.10)


# each policy once on each layout in the extended tier; the other pairing too with PAR_FULL_MATRIX=1
FULL = pytest.mark.skipif(not os.environ.get("PAR_FULL_MATRIX"), reason="the other policy-layout pairing: PAR_FULL_MATRIX=1")


@pytest.mark.extended  # ~5-15 s each
@pytest.mark.parametrize("cp, tp, recompute", [(1, 1, "selective"), pytest.param(1, 1, '["core_attn"]', marks=FULL),
                                               pytest.param(2, 2, "selective", marks=FULL), (2, 2, '["core_attn"]')])
def test_simulate_measures_the_planned_recomputed_core(cp, tp, recompute):
    """With the linear layers' core recomputed (``models/qwen3_next/memory.py``) the plan counts the
    checkpoint's inputs and the output side kept, and in a linear layer's backward the core's saved set
    back beside the backward's working set (``Qwen3Next.backward_bytes``), less what the later layers'
    backward freed; under the word (``selective``) and a module list alike: within 5 % per stage. Two
    periods of three linear layers and a full one; cp 2 x tp 2: the last rank."""
    from pretrain.config import load_config
    from pretrain.simulate.report import simulate

    cfg = load_config("llama3-8b", SIMULATED + ["model.layers=8", "model.full_attention_interval=4",
                                                f"parallel.tp={tp}", f"parallel.cp={cp}", f"model.recompute={recompute}"])
    (rank,) = simulate(cfg, cp * tp, [cp * tp - 1])["ranks"]
    assert rank["measured"]["activations"] == pytest.approx(rank["planned"]["activations"], rel=0.05)


@pytest.mark.parametrize("cp, kind", [(2, "p2p"), (4, "p2p"), (4, "allgather"), (2, "a2a")])
def test_auto_cost_model_counts_the_linear_layers_declared_cp_bytes(cp, kind):
    """``plan --auto``'s estimate of a layout (``search.best_variant``'s workload): under CP only the
    full-attention layers move K and V; the linear layers send what the family declares (the state pass
    and the conv's halo along the ring, or the all-to-all of their heads' inputs and outputs)."""
    from pretrain.config import load_config
    from pretrain.models import family_of
    from pretrain.planner.estimate import Shape, sizes
    from pretrain.planner.search import light_layout
    from pretrain.runtime.rank_assignment import workload
    from par_groups.topology import bytes_per_step

    cfg = load_config(None, [q for q in Q if q != "--set"] + [f"parallel.cp_comm_type={kind}", "train.seq_len=512"])
    m, mb, microbatches = cfg.model, 2, 4
    shape = Shape(cp, tp=1, cp=cp, pp=1, ep=1, etp=1)
    layout = light_layout(shape, mb, microbatches)
    sent = bytes_per_step(sizes(shape), workload(cfg, layout))["cp"]
    declared = family_of(m).recurrent_state(m, layout, mb, 2, kind)
    full, linear, tokens = m.layers - declared["linear_layers"], declared["linear_layers"], 512 // cp * mb
    kv = tokens * m.hidden * 2  # the K/V model's one [S/cp, B, hidden] bf16 activation
    if kind == "a2a":
        want = microbatches * (full * 8 * (cp - 1) / cp * kv + linear * tokens * declared["cp_a2a_bytes_per_token"])
    else:
        want = microbatches * full * {"p2p": 6, "allgather": 4}[kind] * (cp - 1) * kv + declared["cp_bytes_per_step"]
    assert declared["cp_bytes_per_step"] > 0 if kind != "a2a" else declared["cp_a2a_bytes_per_token"] > 0
    assert sent == pytest.approx(want, rel=1e-12), (sent, want)


def test_rank_assignment_cost_counts_the_declared_bytes_at_each_hcp_level():
    """a2a+p2p (hcp [2, 2]) on a run's own grid: the inner all-to-all carries the linear layers' heads, the
    outer ring their state pass, beside the full-attention layers' K and V."""
    from pretrain.config import load_config
    from pretrain.models import family_of
    from pretrain.runtime.rank_assignment import workload
    from par_groups.topology import bytes_per_step

    cfg = load_config(None, [q for q in Q if q != "--set"] + ["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p",
                                                              "parallel.hcp=[2,2]", "train.seq_len=512"])
    m, layout = cfg.model, cfg.validate_world(4)
    sent = bytes_per_step(layout.grid, workload(cfg, layout))
    declared = family_of(m).recurrent_state(m, layout, layout.micro_batch, 2, "a2a+p2p")
    full, linear, tokens = m.layers - declared["linear_layers"], declared["linear_layers"], 512 // 4 * layout.micro_batch
    kv, n = tokens * m.hidden * 2, layout.microbatches
    assert declared["cp_bytes_per_step"] > 0 and declared["cp_a2a_bytes_per_token"] > 0
    assert sent["hcp0"] == pytest.approx(n * (full * 8 / 2 * kv + linear * tokens * declared["cp_a2a_bytes_per_token"]))
    assert sent["hcp1"] == pytest.approx(n * full * 6 * kv + declared["cp_bytes_per_step"])
