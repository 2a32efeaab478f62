"""gpt-oss trains the same model under every layout: its sliding window (on 160-token sequences, past
the 128-token window) and sinks under context parallelism (ring and all-to-all), its biased experts under
expert parallelism, tp2 with sequence parallelism, pp2 and ZeRO-3. Each of 20 steps from the single
rank's state, loss and grad norm at the suite's 1e-6 (moe_stepwise: routing flips reported)."""

import pytest

from moe_stepwise import assert_moe_steps_same, layout_steps, moe_reference  # noqa: F401 (a fixture)

TOLERANCE = 1e-6
GPT_OSS = ("model.attention=gpt_oss", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.kv_channels=16",
           "model.moe_layers_start=0", "model.shared_experts=0", "model.num_experts=4", "model.top_k=2",
           "model.moe_ffn_hidden=32", "model.norm_topk_prob=true", "model.bias_update_rate=0.001",
           'model.rope_scaling={rope_type="yarn",factor=2.0,original_max_position_embeddings=128,truncate=false}',
           "train.seq_len=160")
LAYOUTS = {
    "cp2-p2p": ["parallel.cp=2"],  # the window and the sinks over a ring of shards
    "cp2-a2a": ["parallel.cp=2", "parallel.cp_comm_type=a2a"],
    "tp2-sp": ["parallel.tp=2", "parallel.etp=1"],  # the experts' down bias is not split over etp
    "ep2": ["parallel.ep=2"],
    "pp2": ["parallel.pp=2"],
    "zero3": ["parallel.zero=optim_grads_params"],
}


# about 140 s each on 2 loaded cores (20 checkpointed reference steps of 160 tokens): the opt-in tier
@pytest.mark.extended
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpt_oss_layout_matches_single_rank(dist_run, moe_reference, name):
    # the balancing loss is per micro-batch: the pipeline's (of 2 sequences) on the single rank too
    common = GPT_OSS + (("train.micro_batch=2",) if name == "pp2" else ())
    root, reference = moe_reference(common)
    results = dist_run(2, layout_steps, "tiny-moe", list(common) + LAYOUTS[name], root, timeout=900)
    assert_moe_steps_same(results, reference, TOLERANCE, f"gpt-oss {name}")
    assert reference[-1][0] < reference[0][0]  # and it learns
