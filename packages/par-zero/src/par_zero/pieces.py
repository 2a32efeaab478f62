"""Save and load this rank's pieces of global tensors with torch.distributed.checkpoint (DCP).

A :class:`Pieces` value stands for one global tensor (``full_shape``) of which this rank holds some
boxes, each a tensor with its global offsets: the part of a parameter (or of its optimizer state)
this rank owns, cut by its placement and by data-parallel sharding. Saving writes each box once
(identical boxes held by replicas share their offsets, and DCP's planner keeps one), no rank builds
a full tensor, and loading under another layout reads only the stored chunks that overlap the boxes
a rank asks for, straight into them. Only DCP's public planner interface is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclass
class Pieces:
    """Boxes ``(global offsets, tensor)`` this rank holds of a tensor of ``full_shape`` (possibly none)."""

    full_shape: tuple[int, ...]
    boxes: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)

    def to_cpu_copy(self) -> "Pieces":
        """Private fp32 CPU copies (for a write that runs while training goes on)."""
        return Pieces(self.full_shape, [(o, t.detach().to("cpu", torch.float32, copy=True)) for o, t in self.boxes])


class PiecesSavePlanner(DefaultSavePlanner):
    """Plans a state dict of :class:`Pieces`: one chunk per box, replicas deduplicated by offsets."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        self._data, items = {}, []
        for fqn, pieces in self.state_dict.items():
            for offsets, t in pieces.boxes:
                index = MetadataIndex(fqn, offsets)
                self._data[(fqn, torch.Size(offsets))] = t
                chunk = ChunkStorageMetadata(torch.Size(offsets), t.size())
                data = TensorWriteData(chunk, TensorProperties.create_from_tensor(t), torch.Size(pieces.full_shape))
                items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self._data[(write_item.index.fqn, write_item.index.offset)]


class PiecesLoadPlanner(DefaultLoadPlanner):
    """Reads into each box of a state dict of :class:`Pieces` the stored chunks overlapping it."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict = self.original_state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, pieces in self.state_dict.items():
            stored = self.metadata.state_dict_metadata[fqn]
            if tuple(stored.size) != tuple(pieces.full_shape):
                raise ValueError(f"{fqn}: stored shape {list(stored.size)}, wanted {list(pieces.full_shape)}")
            chunks = [ChunkStorageMetadata(torch.Size(o), t.size()) for o, t in pieces.boxes]
            items += create_read_items_for_chunk_list(fqn, stored, chunks)
        return LoadPlan(items)

    def resolve_tensor(self, read_item) -> torch.Tensor:
        t = self.state_dict[read_item.dest_index.fqn].boxes[read_item.dest_index.index][1]
        for d, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, start, length)
        return t

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the box: the data is already in place


def save_pieces(state: dict[str, Pieces], checkpoint_id: str, **kwargs) -> None:
    """``dcp.save`` of a state dict of :class:`Pieces` (kwargs go to DCP: process_group, no_dist...)."""
    dcp.save(state, checkpoint_id=checkpoint_id, planner=PiecesSavePlanner(), **kwargs)


def load_pieces(state: dict[str, Pieces], checkpoint_id: str, **kwargs) -> None:
    """``dcp.load`` into the boxes of a state dict of :class:`Pieces`."""
    dcp.load(state, checkpoint_id=checkpoint_id, planner=PiecesLoadPlanner(), **kwargs)
