"""Checkpoints that reshard across layouts, and Hugging Face import/export."""

from .background import CheckpointSaver, PendingSave, start_async_save
from .store import (
    latest_checkpoint,
    load_checkpoint,
    read_state,
    resolve_checkpoint,
    save_checkpoint,
)
from .subject import Checkpointed

__all__ = ["CheckpointSaver", "Checkpointed", "PendingSave", "latest_checkpoint", "load_checkpoint",
           "read_state", "resolve_checkpoint", "save_checkpoint", "start_async_save"]
