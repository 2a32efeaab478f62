"""`plan` sizes a Qwen3-Next model's recurrent states: per linear layer and micro-batch, one state is
value heads/tp x linear_key_dim x linear_value_dim fp32 values per sequence, and context parallelism
passes one per boundary between ranks' pieces, forward and backward (the bytes par-cp's test records:
packages/par-cp/tests/test_delta_rule.py); a family without such layers reports none."""

import json

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
    assert "recurrent_state" not in _plan("--world", "2", "--set", "parallel.cp=2")


def test_all_to_all_over_more_ranks_than_key_heads_is_one_error_line():
    from one_error_line import assert_one_error_line

    for kind in (["--set", "parallel.cp_comm_type=a2a"], ["--set", "parallel.cp_comm_type=a2a+p2p", "--set", "parallel.hcp=[4,1]"]):
        res = CliRunner().invoke(app, ["plan", "--world", "4", *Q, "--set", "model.linear_key_heads=2", "--set",
                                       "parallel.cp=4", *kind])
        assert_one_error_line(res, "linear_key_heads", "splits the linear layers' key heads over 4 ranks, which does not "
                                                       "divide the 2 [model].linear_key_heads per tp rank")
