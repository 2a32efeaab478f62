"""par-pp: pipeline schedules (IR, generators, validator, simulator, renderer) and their executor.

    schedule = build_schedule("1f1b", pp=4, microbatches=7)
    print(render_timeline(simulate(schedule)))          # the explainer's table
    chunks = {c: model_chunk(c) for c in chunks_on_rank(schedule, rank)}
    losses = PipelineExecutor(schedule, chunks, pp_group, loss_fn=loss).step(inputs, targets)
"""

from .executor import ActionRecord, PipelineExecutor
from .ir import Action, Message, Schedule
from .render import render_timeline, timeline_json
from .schedules import SCHEDULE_NAMES, V_SCHEDULES, build_schedule, chunk_ranks, chunks_on_rank, chunks_per_rank
from .simulate import Costs, SimResult, TimedAction, parse_costs, simulate
from .split import split_layers, split_stages, stage_layer_counts
from .validate import ScheduleError, validate_schedule

__all__ = [
    "Action",
    "ActionRecord",
    "Costs",
    "Message",
    "PipelineExecutor",
    "SCHEDULE_NAMES",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "TimedAction",
    "V_SCHEDULES",
    "build_schedule",
    "chunk_ranks",
    "chunks_per_rank",
    "chunks_on_rank",
    "parse_costs",
    "render_timeline",
    "simulate",
    "split_layers",
    "split_stages",
    "stage_layer_counts",
    "timeline_json",
    "validate_schedule",
]
