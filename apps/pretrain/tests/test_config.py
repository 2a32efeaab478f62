"""Config: shipped files load, --set overrides, and every bad input is a UsageError naming the key."""

import itertools
import re
from pathlib import Path

import pytest

from pretrain.config import Config, builtin_configs, load_config, parse_override
from pretrain.errors import UsageError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
# shipped: the package's configs/ and each family folder's models/<family>/configs/
SHIPPED = [*CONFIG_DIR.glob("*.toml"), *CONFIG_DIR.resolve().parent.glob("models/*/configs/*.toml")]


def test_shipped_configs_are_the_package_configs_and_all_load():
    assert sorted(p.name for p in SHIPPED) == builtin_configs() == [
        "deepseek-v3.toml", "gpt-oss-120b.toml", "llama3-405b.toml", "llama3-70b.toml", "llama3-8b.toml", "llama3.2-1b.toml",
        "qwen3-next-80b-a3b.toml", "tiny-moe.toml", "tiny.toml"]
    for path in SHIPPED:
        cfg = load_config(str(path))
        assert cfg == load_config(path.name[:-5])  # by its bare name too
        cfg.validate_world(cfg.train.nproc)
    assert load_config(None) == load_config(str(CONFIG_DIR / "tiny.toml"))
    assert load_config("tiny-moe").model.is_moe


def test_published_shapes():
    llama = load_config("llama3-8b").model
    assert (llama.hidden, llama.layers, llama.heads, llama.kv_heads, llama.ffn_hidden, llama.vocab_size,
            llama.rope_theta) == (4096, 32, 32, 8, 14336, 128256, 500000.0)
    shapes = {name: (m.hidden, m.layers, m.heads, m.kv_heads, m.ffn_hidden, m.vocab_size, m.tie_embeddings)
              for name in ("llama3-70b", "llama3-405b", "llama3.2-1b") for m in [load_config(name).model]}
    assert shapes == {"llama3-70b": (8192, 80, 64, 8, 28672, 128256, False),
                      "llama3-405b": (16384, 126, 128, 8, 53248, 128256, False),
                      "llama3.2-1b": (2048, 16, 32, 8, 8192, 128256, True)}
    uneven = ["parallel.pp=16", "parallel.first_stage_layers=7", "parallel.last_stage_layers=7"]
    assert [len(s) for s in load_config("llama3-405b", uneven).parallel.stage_layers(126)] == [7] + [8] * 14 + [7]
    ds = load_config("deepseek-v3").model
    assert (ds.hidden, ds.layers, ds.moe_layers_start, ds.num_experts, ds.moe_ffn_hidden, ds.top_k, ds.shared_experts,
            ds.n_groups, ds.topk_groups, ds.score_func, ds.routed_scaling, ds.vocab_size) == (
        7168, 61, 3, 256, 2048, 8, 1, 8, 4, "sigmoid", 2.5, 129280)
    assert ds.num_moe_layers == 58 and not ds.is_moe_layer(2) and ds.is_moe_layer(3)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_tiny_fits_every_layout_up_to_8_ranks(name):
    """tp, pp, cp (and ep for MoE) in {1, 2, 4}, vpp 2 with pp > 1, on up to 8 ranks."""
    checked = 0
    for tp, pp, cp, ep in itertools.product((1, 2, 4), repeat=4):
        if name == "tiny" and ep > 1:
            continue
        for world in (1, 2, 4, 8):
            if world % (tp * pp * cp) or (world // pp) % (tp * ep):
                continue
            sets = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.cp={cp}", f"parallel.ep={ep}"]
            if pp > 1:
                sets += ["parallel.schedule=interleaved", "parallel.vpp=2"]
            layout = load_config(name, sets).validate_world(world)
            assert layout.dp * tp * pp * cp == world
            assert layout.micro_batch * layout.microbatches * layout.dp == 8
            assert layout.sequence_parallel == (tp > 1)
            checked += 1
    assert checked > 20


def test_overrides_parse_toml_literals_and_bare_strings():
    assert parse_override("parallel.hcp=[2,2]") == ("parallel", "hcp", [2, 2])
    assert parse_override("log.dir=runs/a b") == ("log", "dir", "runs/a b")
    assert parse_override("train.lr=1e-3") == ("train", "lr", 1e-3)
    cfg = load_config(None, ["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p", "parallel.hcp=[2,2]", "train.lr=1",
                             "log.progress=false", "parallel.sequence_parallel=false", "parallel.tp=2"])
    assert cfg.parallel.hcp == (2, 2) and cfg.train.lr == 1.0 and cfg.log.progress is False
    assert cfg.validate_world(8).sequence_parallel is False  # explicitly off with tp > 1 is allowed
    assert load_config(None, ["parallel.etp=0", "parallel.tp=2"]).parallel.expert_tp == 2


def test_round_trip_through_toml(tmp_path):
    cfg = load_config("deepseek-v3", ["parallel.sequence_parallel=true"])
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert load_config(str(path)) == cfg


@pytest.mark.parametrize("sets, world, message", [
    (["parallel.tpp=2"], 1, "unknown key [parallel].tpp (did you mean tp?); valid keys: tp, pp, vpp, cp,"),
    (["modle.hidden=2"], 1, "unknown section [modle] (did you mean model?)"),
    (["parallel.tp=two"], 1, "[parallel].tp must be an integer, got 'two'"),
    (["train.lr=true"], 1, "[train].lr must be a number"),
    (["parallel.tp=3"], 3, "[parallel].tp=3 does not divide [model].heads=8; use one of 1, 2, 4, 8"),
    (["parallel.pp=2", "model.layers=6", "parallel.vpp=2", "parallel.schedule=interleaved"], 2,
     "[model].layers=6 is not divisible by pp*vpp=2*2=4"),
    (["parallel.pp=3"], 3, "[model].layers=8 is not divisible by pp*chunks=3*1=3"),
    (["parallel.pp=2", "parallel.first_stage_layers=3", "parallel.last_stage_layers=4"], 2,
     "[parallel] layer split: num_layers=8 with first_stage_layers=3, last_stage_layers=4: the two stages must add up"),
    (["parallel.pp=4", "parallel.first_stage_layers=3"], 4, "the other 3 stages get 5 layers, which must split evenly"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved", "parallel.first_stage_layers=3"], 2,
     "3 layers on stage 0 do not split evenly into its 2 chunks"),
    (["parallel.first_stage_layers=4"], 1, "[parallel].first_stage_layers/last_stage_layers need pp >= 2 (got pp=1)"),
    (["parallel.last_stage_layers=-1"], 1, "[parallel].last_stage_layers"),
    (["parallel.tp=2"], 3, "does not fit 3 ranks: world_size=3 is not divisible by tp*cp*pp=2*1*1=2"),
    (["parallel.zero=torch_fsdp2", "parallel.pp=2"], 2, "'torch_fsdp2' runs with tp=1, pp=1, ep=1 and untied embeddings only (got tp=1, pp=2"),
    (["parallel.zero=torch_fsdp2", "parallel.tp=2"], 2, "'torch_fsdp2' runs with tp=1, pp=1, ep=1 and untied embeddings only (got tp=2, pp=1, ep=1"),
    (["parallel.zero=torch_fsdp2", "model.tie_embeddings=true"], 2, "ep=1, tie_embeddings=true); use optim_grads_params"),
    (["parallel.vpp=2"], 1, "[parallel].schedule='1f1b' with vpp=2: 1f1b runs one chunk per rank, so vpp must be 1"),
    (["parallel.ep=2"], 2, "[parallel].ep=2 needs MoE layers"),
    (["model.num_experts=6", "parallel.ep=4"], 4, "[parallel].ep=4 does not divide [model].num_experts=6"),
    (["parallel.zero=zero3"], 1, "[parallel].zero='zero3' is not one of no_shard, optim,"),
    (["parallel.hcp=[2,2]"], 1, "only used with cp_comm_type='a2a+p2p'"),
    (["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p", "parallel.hcp=[2,4]"], 4, "inner*outer = cp=4"),
    (["parallel.cp=4", "parallel.tp=2", "parallel.cp_comm_type=a2a"], 8, "does not divide the 2 [model].kv_heads per tp rank"),
    (["train.seq_len=60", "parallel.cp=4"], 4, "[train].seq_len=60 must be divisible by 2*cp=8"),
    (["train.global_batch=6"], 4, "[train].global_batch=6 is not divisible by dp=4"),
    (["train.micro_batch=3"], 2, "[train].micro_batch=3 does not divide global_batch/dp=8/2=4"),
    (["parallel.hsdp_replicas=2"], 4, "needs zero='optim_grads_params'"),
    (["parallel.hsdp_replicas=3", "parallel.zero=optim_grads_params"], 4, "hsdp_replicas=3 does not divide dp=4"),
    (["parallel.order=tp-cp-dp-pp", "parallel.ep=2", "model.num_experts=4"], 2, "lacks ep=2"),
    (["model.num_experts=8", "model.max_route_nodes=2"], 1, "[model].max_route_nodes=2 needs n_groups > 1"),
    (["model.num_experts=8", "model.n_groups=2", "model.max_route_nodes=3"], 1, "max_route_nodes=3 must be in 1..n_groups=2"),
    (["model.num_experts=8", "model.n_groups=4", "model.max_route_nodes=3", "model.group_score=top_k_per_group"], 1,
     "max_route_nodes=3 must divide top_k=2"),
    (["model.group_score=top3"], 1, "[model].group_score='top3' is not one of top2, top_k_per_group"),
    (["model.rope_scaling={rope_type = \"dynamic\", factor = 2.0}"], 1, "rope_type='dynamic' is not supported"),
    (["model.rope_scaling={rope_type = \"llama3\", factor = 8.0}"], 1, "needs low_freq_factor"),
    (["model.mlp_only_layers=[9]"], 1, "[model].mlp_only_layers=[9] must be layer indices"),
    (["model.num_experts=8", "model.n_groups=4", "model.topk_groups=2", "model.max_route_nodes=1"], 1,
     "max_route_nodes=1 and topk_groups=2 set the same limit"),
    (["model.num_experts=12", "model.n_groups=3", "model.max_route_nodes=1", "parallel.ep=4"], 4,
     "n_groups must divide [parallel].ep=4 or be a multiple of it"),
    (["model.kv_heads=3"], 1, "[model].kv_heads=3 does not divide heads=8"),
    (["train.stop_at=400"], 1, "[train].stop_at=400 is after the last step"),
    (["model.recompute=some"], 1, "[model].recompute='some' is not one of none, selective, full"),
    (["parallel.tp"], 1, "must look like section.key=value"),
    (["parallel.tp_comm_overlap=true"], 1, "tp_comm_overlap=true overlaps sequence parallelism's collectives: it needs tp > 1"),
    (["parallel.tp=2", "parallel.sequence_parallel=false", "parallel.tp_comm_overlap=true"], 2, "sequence_parallel=False"),
    (["parallel.tp=2", "parallel.tp_comm_overlap=true", "model.backend=te"], 2, "use [model].backend='torch'"),
    # issue 40: numbers the RNGs, timedelta/gloo or the step cannot take
    (["train.collective_timeout_s=inf"], 1, "[train].collective_timeout_s=inf must be a finite number"),
    (["train.join_timeout_s=1e15"], 1, "[train].join_timeout_s=1000000000000000.0 must be in (0, 604800] seconds"),
    (["train.preempt_timeout_s=nan"], 1, "[train].preempt_timeout_s=nan must be a finite number"),
    (["train.lr=inf"], 1, "[train].lr=inf must be a finite number"),
    (["data.seed=-1"], 1, "[data].seed=-1 must be in 0..4294967295"),
    (["train.seed=4294967296"], 1, "[train].seed=4294967296 must be in 0..4294967295"),
    (["train.seed=18446744073709551616"], 1, "[train].seed=18446744073709551616 is out of range"),
    (["train.eval_batches=0"], 1, "[train].eval_batches=0 must be >= 1"),
    (["model.z_loss_coeff=-1"], 1, "[model].z_loss_coeff=-1.0 must be >= 0"),
    (["model.routed_scaling=0"], 1, "[model].routed_scaling=0.0 must be > 0"),
    ([], 1000000, "world size 1000000 must be in 1..131072"),
    # issue 51: expert_balance = "replicate" refuses what it is not tested with, saying which
    (["model.expert_balance=spread"], 1, "[model].expert_balance='spread' is not one of none, replicate, replicate+replace"),
    (["model.replace_every=0"], 1, "[model].replace_every=0 must be >= 1"),
    *((["model.num_experts=8", "parallel.ep=2", "model.expert_balance=replicate+replace", *extra], 4,
       f"[model].expert_balance='replicate+replace' is not supported with {refused}")
      for extra, refused in ((["parallel.zero=optim_grads_params"], "[parallel].zero='optim_grads_params'"),)),
    (["model.max_replicas_per_rank=0"], 1, "[model].max_replicas_per_rank=0 must be >= 1"),
    (["model.replicate_across_domains=maybe"], 1, "[model].replicate_across_domains must be true or false, got 'maybe'"),
    (["model.num_experts=8", "parallel.ep=2", "model.expert_balance=replicate", "model.dispatcher=alltoall_padded"], 4,
     "[model].expert_balance='replicate' is not supported with [model].dispatcher='alltoall_padded': the padded "
     "dispatcher already computes the same padded slots on every EP rank"),
    (["model.num_experts=8", "model.expert_balance=replicate", "parallel.zero=torch_fsdp2", "parallel.ep=2"], 4,
     "[parallel].zero='torch_fsdp2' runs with tp=1, pp=1, ep=1"),
    (["train.compile=true", "data.document_mask=true"], 1, "[train].compile=true compiles the torch backend's blocks: "
                                                          "not with [model].backend='te' nor packed documents"),
])
def test_bad_input_names_the_key(sets, world, message):
    with pytest.raises(UsageError) as e:
        load_config(None, sets).validate_world(world)
    assert message in str(e.value)


def test_a_world_the_batch_cannot_fill_is_refused_before_the_rank_grid_is_built(monkeypatch):
    """`plan --world 131072` used to build the 131072-rank grid (~16 s here, minutes beyond) to say dp is too big."""
    import pretrain.config.layout

    def no_grid(*args, **kwargs):
        raise AssertionError("the rank grid was built")

    monkeypatch.setattr(pretrain.config.layout, "RankGrid", no_grid)  # where Layout.grid builds it
    with pytest.raises(UsageError, match=r"global_batch=8 is not divisible by dp=131072"):
        load_config(None).validate_world(1 << 17)


def test_max_route_nodes_is_the_routers_group_limit(tmp_path):
    from pretrain.model.moe import moe_config

    cfg = load_config(None, ["model.num_experts=8", "model.n_groups=4", "model.max_route_nodes=2", "parallel.ep=4"])
    cfg.validate_world(4)
    assert (moe_config(cfg.model).n_groups, moe_config(cfg.model).topk_groups) == (4, 2)
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert load_config(str(path)) == cfg


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nhidden = 1")
    with pytest.raises(UsageError, match="not valid TOML"):
        load_config(str(bad))


def test_defaults_are_a_valid_config():
    assert Config().validate_world(1).microbatches == 1


def test_uneven_pipeline_stages_set_the_layers_each_chunk_builds():
    from pretrain.model.build import chunk_layout

    cfg = load_config(None, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved",
                             "parallel.first_stage_layers=2"])
    layout = cfg.validate_world(2)
    _, mine, ranges = chunk_layout(cfg, layout, 0)
    assert mine == [0, 2] and [len(r) for r in ranges] == [1, 3, 1, 3]  # rank 0: 2 layers, rank 1: 6
    assert cfg.parallel.stage_layers(8) == [[0, 4], [1, 2, 3, 5, 6, 7]]
    big = load_config("llama3-8b", ["model.layers=126", "parallel.pp=16", "parallel.first_stage_layers=7",
                                    "parallel.last_stage_layers=7"])
    assert [len(s) for s in big.parallel.stage_layers(126)] == [7] + [8] * 14 + [7]


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.dynamic_cp=true", "parallel.max_seq_per_rank=64", "data.document_mask=true",
      "model.vocab_size=257"], 2, "dynamic_cp=true needs cp > 1"),
    (["parallel.dynamic_cp=true", "parallel.cp=2", "data.document_mask=true", "model.vocab_size=257"], 2,
     "needs max_seq_per_rank >= 1"),
    (["parallel.dynamic_cp=true", "parallel.cp=2", "parallel.max_seq_per_rank=8"], 2, "needs [data].document_mask=true"),
    (["parallel.dynamic_cp=true", "parallel.cp=2", "parallel.max_seq_per_rank=8", "data.document_mask=true",
      "model.vocab_size=257"], 4, "can hold a document longer than [parallel].max_seq_per_rank=8 x dp x cp=4"),
])
def test_dynamic_cp_bad_input_is_one_line(overrides, world, message):
    from pretrain.config import load_config
    from pretrain.errors import UsageError

    with pytest.raises(UsageError, match=re.escape(message)):
        load_config(None, overrides).validate_world(world)


def test_a_renamed_key_still_works_and_says_its_new_name(capsys):
    """[parallel].placement is now [parallel].rank_assignment: the old name sets the new key, with one note."""
    cfg = load_config(None, ["parallel.placement=off"])
    assert cfg.parallel.rank_assignment == "off"
    assert capsys.readouterr().err == "note: [parallel].placement is now [parallel].rank_assignment\n"
    assert load_config(None, ["parallel.rank_assignment=strict"]).parallel.rank_assignment == "strict"


def test_the_former_timeout_key_sets_both_timeouts_and_says_so(capsys):
    cfg = load_config(None, ["train.timeout_s=42"])
    assert (cfg.train.collective_timeout_s, cfg.train.join_timeout_s) == (42.0, 42.0)
    assert capsys.readouterr().err == ("note: [train].timeout_s is now [train].collective_timeout_s and "
                                       "[train].join_timeout_s; it sets each\n")
    cfg = load_config(None, ["train.timeout_s=42", "train.join_timeout_s=7"])  # the new key beside it wins
    assert (cfg.train.collective_timeout_s, cfg.train.join_timeout_s) == (42.0, 7.0)


def test_train_seed_owns_the_weights_and_data_seed_the_data_order():
    from pretrain.data import build_sampler, load_dataset
    from pretrain.config.layout import Layout  # noqa: F401 - the sampler takes the resolved layout
    from pretrain.model.initial_state import init_full_state

    def batch_and_weights(*overrides):
        cfg = load_config(None, ["model.layers=2", *overrides])
        sampler = build_sampler(cfg, cfg.validate_world(1), 0, load_dataset(cfg.data, cfg.model.vocab_size))
        return sampler.train_batch(0).tokens, dict(init_full_state(cfg.model, cfg.train.seed))

    tokens, weights = batch_and_weights()
    other_tokens, same_weights = batch_and_weights("data.seed=7")
    same_tokens, other_weights = batch_and_weights("train.seed=7")
    assert not other_tokens.equal(tokens) and all(same_weights[k].equal(w) for k, w in weights.items())
    assert same_tokens.equal(tokens) and not all(other_weights[k].equal(w) for k, w in weights.items())
