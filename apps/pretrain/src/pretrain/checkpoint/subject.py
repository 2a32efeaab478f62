"""What a checkpoint saves of one rank's run and loads back into it: :class:`Checkpointed`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Checkpointed:
    """The parts of a rank's run a save reads and a load fills in place, handed over by the run's owner.

    ``cfg``: the run's config (its model's shapes, [checkpoint].verify, the optimizer's name, [log].dir);
    ``layout``: the run's layout (the state file's and the RNG files' world); ``model``: the rank's model
    (``model.build.RankModel``: its chunks' tensors by full name, and ``model.dp``, the DP wrapper with the
    fp32 masters, the optimizer state and its step count); ``experts``: the expert re-placement
    (``model.replace.ExpertReplacer``; None where no layer re-places): its maps and load go with a save."""

    cfg: object
    layout: object
    model: object
    experts: object | None = None
