"""Pictures (matplotlib, optional: one clear line if it is missing): a run's report and a pipeline schedule."""

from __future__ import annotations

import base64
from pathlib import Path

from ..errors import UsageError
from ..runtime.safe_files import write_atomic, write_via

MATPLOTLIB_MISSING = ("drawing needs matplotlib, which is not installed here: `uv sync` (the dev group has it), or "
                      "`uv pip install matplotlib` into this environment")
PHASES = (("time_data_s", "data"), ("time_fwd_bwd_s", "forward-backward"), ("time_optimizer_s", "optimizer"))
MARKED_STEPS = 30  # the report marks each step's points up to this many steps
KIND_COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#c44e52"}


def pyplot():
    """matplotlib's pyplot on a file backend (no display needed); UsageError when not installed."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError(MATPLOTLIB_MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    write_via(path, lambda tmp: fig.savefig(tmp, dpi=110, bbox_inches="tight", format=path.suffix[1:]))


def report_png(train: list[dict], evals: list[dict], title: str, path: Path, events: list[dict] = ()) -> None:
    """Loss (and eval loss), tokens/s, MFU and the time breakdown per step, one figure; ``events`` (a replica
    lost or rejoined) are marked on the loss curve at the step boundary they happened at."""
    plt = pyplot()
    steps = [r["step"] for r in train]
    fig, ((loss, speed), (util, times)) = plt.subplots(2, 2, figsize=(12, 7.5))
    fig.suptitle(title)
    loss.plot(steps, [r["loss"] for r in train], label="train")
    if evals:
        loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    for kind, colour in (("replica_lost", "#c44e52"), ("replica_joined", "#55a868")):
        for i, e in enumerate(e for e in events if e["event"] == kind):
            loss.axvline(e["step"] + 0.5, color=colour, ls=":", lw=1, label=kind.replace("_", " ") if i == 0 else None)
    loss.set(title="loss", xlabel="step")
    loss.legend()
    speed.plot(steps, [r.get("tokens_per_s") or 0 for r in train])
    speed.set(title="tokens / s", xlabel="step")
    mfu = [r.get("mfu") for r in train]
    if any(m is not None for m in mfu):
        util.plot(steps, [100 * (m or 0) for m in mfu])
        util.set(title="MFU (%)", xlabel="step")
    else:
        util.text(0.5, 0.5, "no MFU: the peak FLOP/s of this device is unknown\n(set [log].peak_tflops)",
                  ha="center", va="center", transform=util.transAxes)
        util.set(title="MFU", xticks=[], yticks=[])
    _breakdown(times, train, steps)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _breakdown(ax, train: list[dict], steps: list[int]) -> None:
    if not all("time_fwd_bwd_s" in r for r in train):
        ax.plot(steps, [1e3 * r.get("step_time_s", float("nan")) for r in train], label="step")
        ax.set(title="step time (ms; no breakdown: [log].timing = false)", xlabel="step")
        return
    bottom = [0.0] * len(train)
    for key, label in PHASES:
        values = [1e3 * r[key] for r in train]
        ax.bar(steps, values, bottom=bottom, label=label, width=0.9)
        bottom = [b + v for b, v in zip(bottom, values)]
    few = len(train) <= MARKED_STEPS  # past that, a marker per step would hide the bars
    ax.plot(steps, [1e3 * r["time_exposed_comm_s"] for r in train], "k.--" if few else "k--", lw=0.8,
            label="of which waiting in comm")
    ax.plot(steps, [1e3 * r["time_busy_max_s"] for r in train], "r^:" if few else "r:", lw=0.8,
            label="slowest rank busy")
    ax.plot(steps, [1e3 * r["step_time_s"] for r in train], "k-", lw=0.8, label="step")
    ax.set(title="where the step's time goes (ms, rank 0)", xlabel="step")
    ax.legend(fontsize=8)


def report_html(png: Path, path: Path, title: str, summary: list[str]) -> None:
    """A page with the PNG inline, so it is one file to pass around."""
    data = base64.b64encode(png.read_bytes()).decode()
    rows = "".join(f"<li>{line}</li>" for line in summary)
    write_atomic(path, f"<!doctype html><meta charset=utf-8><title>{title}</title><h1>{title}</h1><ul>{rows}</ul>"
                       f"<img alt='report' src='data:image/png;base64,{data}'>\n", fsync=False)


def schedule_png(timeline: dict, caption: str, path: Path) -> None:
    """Each rank's F/B/W passes as bars over time, labelled with the micro-batch (chunk as shade)."""
    plt = pyplot()
    ranks = timeline["ranks"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * timeline["makespan"]), 0.55 * len(ranks) + 1.4))
    for r, actions in enumerate(ranks):
        for a in actions:
            shade = 1.0 if a["chunk"] % 2 == 0 or timeline["vpp"] == 1 else 0.55
            ax.barh(r, a["end"] - a["start"], left=a["start"], color=KIND_COLOURS[a["type"]], alpha=shade,
                    edgecolor="white", height=0.8)
            ax.text((a["start"] + a["end"]) / 2, r, str(a["microbatch"]), ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
    ax.invert_yaxis()
    ax.set_xlabel("time (slots)")
    ax.set_title(caption, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLOURS.values()]
    ax.legend(handles, ["F forward", "B backward (input grad if split)", "W weight grad"], fontsize=8,
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3)
    _save(fig, path)
    plt.close(fig)
