"""A rank's random state in a checkpoint (``rng/rank_R.pt``): taken at save, restored on a resume at the same world size."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UsageError


def load_rng_state(file: Path) -> None:
    """Restore this rank's RNG from ``file``; anything but the states we write is one line (torch's own
    message would advise ``weights_only=False``, which is wrong for a file we did not check)."""
    why = "it is not a tensor file"
    try:
        state = torch.load(file, weights_only=True)
        why = "it does not hold the states pretrain writes"
        if not (isinstance(state, dict) and set(state) <= {"cpu", "cuda"} and "cpu" in state
                and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in state.values())):
            raise TypeError(why)
        set_rng_state(state)
    except Exception as e:  # torch.load raises many types on garbage; set_rng_state a RuntimeError on a bad size
        raise UsageError(f"checkpoint RNG file {file} is unreadable: {why} ({type(e).__name__}); remove it to "
                         f"resume with a fresh random state") from None


def rng_state() -> dict:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
