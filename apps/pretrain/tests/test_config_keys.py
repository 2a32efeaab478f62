"""The README's config reference: "Every config key" is `pretrain keys` (generated from the sections),
and every row of the Megatron-LM / torchtitan tables maps to keys that load together, or says why none."""

import dataclasses
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.config import load_config
from pretrain.config.key_docs import field_comments, key_list
from pretrain.config.run_config import SECTIONS

README = (Path(__file__).resolve().parents[3] / "README.md").read_text()
SECTION = README.split("## Coming from Megatron-LM or torchtitan", 1)[1].split("\n## ", 1)[0]

# NVIDIA's Llama-3-8B example script's pretrain_gpt.py flags, and torchtitan's debug_model.toml keys
MEGATRON = """--tensor-model-parallel-size --pipeline-model-parallel-size --sequence-parallel --use-distributed-optimizer
--num-layers --hidden-size --ffn-hidden-size --num-attention-heads --group-query-attention --num-query-groups
--seq-length --max-position-embeddings --position-embedding-type --rotary-base --normalization --swiglu
--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size --global-batch-size --train-iters
--train-samples --lr --min-lr --lr-decay-style --lr-warmup-iters --lr-decay-iters --weight-decay --adam-beta1
--adam-beta2 --adam-eps --clip-grad --init-method-std --bf16 --fp8-format --fp8-recipe --attention-dropout
--hidden-dropout --recompute-granularity --recompute-method --recompute-num-layers --data-path --split
--tokenizer-type --tokenizer-model --vocab-size --save --load --save-interval --eval-interval --eval-iters
--log-interval --tensorboard-dir --wandb-project --seed --overlap-grad-reduce --overlap-param-gather --num-workers
--context-parallel-size --expert-model-parallel-size --num-experts --moe-router-topk --use-flash-attn
--transformer-impl""".split()
TORCHTITAN = {
    "job": "dump_folder description print_args use_for_integration_test",
    "profiling": "enable_profiling save_traces_folder profile_freq enable_memory_snapshot save_memory_snapshot_folder",
    "metrics": "log_freq disable_color_printing enable_tensorboard save_tb_folder enable_wandb",
    "model": "name flavor tokenizer_path converters",
    "optimizer": "name lr eps",
    "lr_scheduler": "warmup_steps decay_ratio decay_type min_lr_factor",
    "training": "local_batch_size seq_len max_norm steps dataset",
    "parallelism": "data_parallel_replicate_degree data_parallel_shard_degree fsdp_reshard_after_forward "
                   "tensor_parallel_degree enable_async_tensor_parallel pipeline_parallel_degree "
                   "pipeline_parallel_schedule context_parallel_degree expert_parallel_degree",
    "checkpoint": "enable_checkpoint folder interval last_save_model_weights_only export_dtype async_mode",
    "activation_checkpoint": "mode selective_ac_option",
    "compile": "enable components",
    "float8": "enable_fsdp_float8_all_gather precompute_float8_dynamic_scale_for_fsdp filter_fqns",
    "validation": "enabled dataset freq steps",
}


def rows() -> list[tuple[str, str, str]]:
    out = []
    for line in SECTION.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            out.append(tuple(cells))
    return out


ROWS = rows()


def test_the_readme_key_list_is_what_pretrain_keys_prints():
    listed = README.split("<!-- keys:begin -->\n", 1)[1].split("\n<!-- keys:end -->", 1)[0]
    res = CliRunner().invoke(app, ["keys"])
    assert res.exit_code == 0 and res.stdout.rstrip("\n") == listed == key_list(), "run `uv run pretrain keys` into the README"


def test_every_key_of_every_section_has_a_default_and_a_meaning():
    text = key_list()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            line = next(x for x in text.splitlines() if x.startswith(f"  - `{f.name} = "))
            assert re.fullmatch(r"  - `\w+ = .+`: \S.*", line), (section, line)
    assert field_comments(SECTIONS["train"])["adam_eps"].startswith("AdamW's eps")


def test_every_megatron_flag_and_torchtitan_key_has_a_row():
    firsts = [r[0] for r in ROWS]
    for flag in MEGATRON:
        assert any(re.search(rf"`{re.escape(flag)}(\s[^`]*)?`", c) for c in firsts), flag
    for section, keys in TORCHTITAN.items():
        for key in keys.split():
            assert f"`[{section}] {key}`" in firsts, (section, key)


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_each_row_loads_its_keys_or_says_why_none(row):
    name, par, why = row
    if par == "none":
        assert len(why) > 10, (name, why)
        return
    items = re.findall(r"`([^`]+)`", par)
    assert items and "".join(f"`{i}`" for i in items).replace("``", "` `") == par, (name, par)
    sets = [i for i in items if not i.startswith("pretrain ")]
    load_config(None, sets)  # every key exists and the row's values are valid together
    for command in (i for i in items if i.startswith("pretrain ")):
        _, sub, *option = command.split()  # a command, and the option of it that does the flag's work
        res = CliRunner().invoke(app, [sub, "--help"], terminal_width=200)
        assert res.exit_code == 0 and all(o in res.stdout for o in option), (name, command)
