"""`pretrain convert`: Hugging Face weights (Llama, Mistral, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3)
<-> pretrain checkpoints."""

from __future__ import annotations

from typing import Optional

import typer

from ..errors import UsageError, fail


def convert(
    from_hf: Optional[str] = typer.Option(None, "--from-hf", help="A Hugging Face save_pretrained directory to import."),
    out: Optional[str] = typer.Option(None, "--out", help="With --from-hf: the checkpoint directory to write."),
    to_hf: Optional[str] = typer.Option(None, "--to-hf", help="A directory to export config.json, model.safetensors and the data's tokenizer to."),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="With --to-hf: a checkpoint (or a run's checkpoint dir)."),
    tokenizer: bool = typer.Option(True, "--tokenizer/--no-tokenizer", help="With --to-hf: also write the run's tokenizer."),
) -> None:
    """Import a Llama / Qwen3 / Qwen3-MoE / Mixtral / DeepSeek-V3 model from Hugging Face
    (--from-hf DIR --out CKPT) or export one (--to-hf DIR --checkpoint CKPT)."""
    from ..checkpoint.hf import export_hf, import_hf

    try:
        if from_hf and not to_hf:
            if not out:
                raise UsageError("--from-hf needs --out CKPT (the checkpoint directory to write)")
            path = import_hf(from_hf, out)
            typer.echo(f"wrote {path} (model only) and {path / 'config.toml'}; {_next_step(path)}")
        elif to_hf and not from_hf:
            if not checkpoint:
                raise UsageError("--to-hf needs --checkpoint CKPT")
            dst, files = export_hf(checkpoint, to_hf, tokenizer)
            typer.echo(f"wrote {dst} ({', '.join(files)})")
        else:
            raise UsageError("give either --from-hf DIR --out CKPT or --to-hf DIR --checkpoint CKPT")
    except UsageError as e:
        raise fail(str(e))


def _next_step(path) -> str:
    """How to train the import: on the embedded byte-level data when its vocabulary is the bytes',
    else on data prepared with its tokenizer (training refuses other data: checkpoint/hf_data.py)."""
    from ..checkpoint.hf_data import BYTE_VOCABS
    from ..checkpoint.store import read_state

    saved = read_state(path)
    want = saved.get("tokenizer_vocab") or saved["config"]["model"]["vocab_size"]
    if want in BYTE_VOCABS:
        return f"train from it with: pretrain train {path / 'config.toml'}"
    return (f"train it on data prepared with its tokenizer: pretrain prepare TEXT --tokenizer "
            f"{saved.get('tokenizer', 'ITS_TOKENIZER')} --out data/NAME, then pretrain train "
            f"{path / 'config.toml'} --set data.path=data/NAME")
