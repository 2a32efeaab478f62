"""par-zero: DDP, ZeRO-1/2/3 and HSDP over flat bucketed buffers, and the model-state memory model.

Each name is imported from its module on first use: what only reads the strategies (a config check,
`pretrain --help`) does not pay for torch.distributed.checkpoint and FSDP2, which import sympy.
"""

import importlib

_MODULE_OF = {
    "STRATEGIES": "config", "DataParallelConfig": "config", "check_optimizer_choice": "config",
    "DataParallel": "data_parallel", "data_parallel": "data_parallel",
    "TorchFSDP2": "fsdp2",
    "GradBuffer": "grad_buffer",
    "DistributedAdamW": "optimizer",
    "DistributedMuon": "muon",
    "AdamW": "declaration", "Declaration": "declaration", "Elementwise": "declaration", "Lion": "declaration",
    "Muon": "declaration", "SGD": "declaration", "State": "declaration", "TorchClass": "declaration",
    "declare_optimizer": "declaration", "DECLARED": "declaration",
    "check_optimizer": "optimizer_choice", "optimizer_classes": "optimizer_choice",
    "TorchOptimizer": "torch_optimizer",
    "clip_grad_norm_": "clipping",
    "owned_pieces": "checkpoint", "whole_pieces": "checkpoint",
    "Pieces": "pieces", "PiecesLoadPlanner": "pieces", "PiecesSavePlanner": "pieces", "load_pieces": "pieces",
    "save_pieces": "pieces",
    "RowMove": "move_rows", "move_rows_": "move_rows",
    "ModelState": "memory", "bytes_per_param": "memory", "model_state": "memory", "model_state_for_params": "memory",
    "default_unit_modules": "units",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name = _MODULE_OF[name]
    module = importlib.import_module(f".{module_name}", __name__)
    if module_name in _MODULE_OF:  # importing data_parallel.py bound the package's data_parallel to the module
        globals()[module_name] = getattr(module, module_name)
    value = globals()[name] = getattr(module, name)  # once: later reads are plain attribute reads
    return value


def __dir__():
    return __all__
