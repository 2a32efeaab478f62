"""Every ```bash block of README.md that can run on the CPU runs as written, in order, in a fresh
directory shaped like a clone (the repository's apps/, packages/, tools/ and README.md linked in).

The blocks are parsed from the README itself, not copied here. A line is skipped only for a reason
in :data:`SKIP` (environment setup, the suite itself, a cluster, a GPU, minutes of simulation);
the test prints what it ran and skipped. ``uv run pretrain ...`` runs in this process (typer's
runner: ranks fork from the test session's forkserver instead of a new interpreter importing torch),
other lines in bash. Runs are shortened by the one override the test sets, ``PRETRAIN_SET`` (2
steps, no eval), which every ``pretrain`` command applies after its ``--set`` flags. A placeholder the
README names is made first: ``path/to/llama`` a tiny random Hugging Face Llama (vocabulary 257), the
raw text ``shards/`` (JSONL and text), ``a.jsonl.gz`` and ``b.parquet`` (a ``content`` field) and
``my-tokenizer`` (a ``save_pretrained`` tokenizer directory).
"""

import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
SHORT = "train.steps=2 train.warmup_steps=1 train.eval_every=0 log.progress=false"
SKIP = (  # (pattern, why)
    (r"^uv sync", "sets up the environment this test runs in (network)"),
    (r"^uv run pytest", "the test suite itself"),
    (r"\bsrun\b", "needs a SLURM cluster"),
    (r"^sbatch\b", "needs a SLURM cluster; tests/test_cluster_slurm.py runs it with stub sbatch, srun and scontrol"),
    (r"tools/gpu/check\.sh", "GPU check: needs a CUDA GPU; its CPU form runs in tests/test_gpu_check_script.py"),
    (r"--simulate", "minutes of simulation at 70B-671B shapes on a 2-core machine; tests/test_simulate.py runs "
                    "the same path on narrowed shapes"),
)


# what the test puts in the directory before the README's lines run (the clone and the placeholders)
PLACED = {"apps", "packages", "tools", "README.md", "path", "shards", "a.jsonl.gz", "b.parquet", "my-tokenizer"}


def readme_commands() -> list[str]:
    """The command lines of README.md's ```bash blocks, in order (continuations joined)."""
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return lines


def skip_reason(line: str) -> str | None:
    return next((why for pattern, why in SKIP if re.search(pattern, line)), None)


def hf_llama(path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def user_inputs(root: Path) -> None:
    """The raw text and tokenizer directory the data section's lines name."""
    import gzip
    import json

    transformers = pytest.importorskip("transformers")
    pq = pytest.importorskip("pyarrow.parquet")
    from tokenizers import Tokenizer, models, pre_tokenizers

    docs = [f"document {i} says hello world again" for i in range(40)]
    (root / "shards" / "part").mkdir(parents=True)
    (root / "shards" / "part" / "0.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (root / "shards" / "notes.txt").write_text("\n".join(docs))
    with gzip.open(root / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"content": d}) + "\n" for d in docs)
    pq.write_table(__import__("pyarrow").table({"content": docs}), root / "b.parquet")
    words = sorted({w for d in docs for w in d.split()})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", "</s>", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(root / "tokenizer.json"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"), eos_token="</s>")
    fast.save_pretrained(root / "my-tokenizer")
    (root / "tokenizer.json").unlink()


def run_line(line: str, runner: CliRunner) -> tuple[int, str]:
    from pretrain.cli import app

    words = shlex.split(line, comments=True)
    if words[:3] == ["uv", "run", "pretrain"]:
        res = runner.invoke(app, words[3:])
        return res.exit_code, res.output
    # the directory is a clone by its links, not by a pyproject.toml of its own: uv finds the project it links to
    res = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=600,
                         env=os.environ | {"UV_PROJECT": str(ROOT)})
    return res.returncode, res.stdout + res.stderr


# The default tier runs every line but torchrun's (each a fresh interpreter per rank, importing torch: minutes on
# 2 cores); the extended tier runs them all, torchrun's included, in the same order.
@pytest.mark.parametrize("torchrun", [False, pytest.param(True, marks=pytest.mark.extended)])
@pytest.mark.timeout(900)  # every README line, trainings included
def test_readme_bash_blocks_run_as_written(tmp_path, monkeypatch, capsys, torchrun):
    for name in ("apps", "packages", "tools", "README.md"):
        (tmp_path / name).symlink_to(ROOT / name)
    hf_llama(tmp_path / "path" / "to" / "llama")
    user_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PRETRAIN_SET", SHORT)
    runner, report, start = CliRunner(), [], time.perf_counter()
    commands = readme_commands()
    assert len(commands) >= 15, commands  # the parser found the README's blocks
    for line in commands:
        why = skip_reason(line) or (None if torchrun or not re.search(r"\btorchrun\b", line) else
                                    "torchrun starts an interpreter per rank: run as written by `pytest -m extended`")
        if why:
            report.append(f"skip  {line}\n      ({why})")
            continue
        t0 = time.perf_counter()
        code, output = run_line(line, runner)
        assert code == 0, f"README line failed (exit {code}): {line}\n{output[-3000:]}"
        report.append(f"ran   {line}  ({time.perf_counter() - t0:.1f} s)")
    with capsys.disabled():
        print(f"\nREADME.md: {sum(r.startswith('ran') for r in report)} lines run, "
              f"{sum(r.startswith('skip') for r in report)} skipped, {time.perf_counter() - start:.0f} s\n"
              + "\n".join(report))
    # what the lines left behind is what the README says they leave, and a checkout's git ignores it
    made = [p.name + "/" * p.is_dir() for p in tmp_path.iterdir() if p.name not in PLACED]
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *made], capture_output=True,
                             text=True).stdout.split()
    assert sorted(made) == sorted(ignored), f"README outputs that .gitignore misses: {set(made) - set(ignored)}"
    assert (tmp_path / "runs" / "tiny" / "log.jsonl").is_file() and (tmp_path / "exported" / "tokenizer.json").is_file()
    assert (tmp_path / "data" / "web_text_document.idx").read_bytes()[:9] == b"MMIDIDX\x00\x00"
    assert 'dir = "runs/llama"' in (tmp_path / "ckpt" / "llama" / "config.toml").read_text()
