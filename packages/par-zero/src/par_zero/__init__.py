"""par-zero: DDP, ZeRO-1/2/3 and HSDP over flat bucketed buffers, and the model-state memory model."""

from .config import STRATEGIES, DataParallelConfig, check_optimizer_choice
from .data_parallel import DataParallel, data_parallel
from .fsdp2 import TorchFSDP2
from .grad_buffer import GradBuffer
from .optimizer import DistributedAdamW
from .muon import DistributedMuon
from .optimizer_choice import check_optimizer, optimizer_classes
from .torch_optimizer import TorchOptimizer
from .clipping import clip_grad_norm_
from .checkpoint import owned_pieces, whole_pieces
from .pieces import Pieces, PiecesLoadPlanner, PiecesSavePlanner, load_pieces, save_pieces
from .move_rows import RowMove, move_rows_
from .memory import ModelState, bytes_per_param, model_state, model_state_for_params
from .units import default_unit_modules

__all__ = [
    "STRATEGIES",
    "TorchFSDP2",
    "DataParallel",
    "data_parallel",
    "GradBuffer",
    "DistributedAdamW",
    "DistributedMuon",
    "TorchOptimizer",
    "check_optimizer",
    "check_optimizer_choice",
    "optimizer_classes",
    "clip_grad_norm_",
    "DataParallelConfig",
    "ModelState",
    "Pieces",
    "RowMove",
    "PiecesLoadPlanner",
    "PiecesSavePlanner",
    "load_pieces",
    "move_rows_",
    "owned_pieces",
    "whole_pieces",
    "save_pieces",
    "bytes_per_param",
    "default_unit_modules",
    "model_state",
    "model_state_for_params",
]
