"""Run every benchmark with quick settings and collect their RESULT lines into one table and chart.

    uv run python tools/bench/run_all.py [--out tools/bench/results] [--only bench_cp ...] [--repeats N]

Each bench runs as its own subprocess (CPU, gloo, world 4 where it is multi-rank). Its
``RESULT <case> key=value ...`` lines are parsed; ``ratio`` is ours / peer (median of paired
per-repeat ratios, ``ratio_min`` / ``ratio_max`` their spread; bench_split_backward and
bench_dynamic_cp write it as ``spread=min-max``; ``ci95=lo-hi`` the 95 % confidence interval of the
median, paired_timing.median_ci). Writes ``RESULTS.md`` (one markdown table: bench, case, ratio,
spread, CI, the other fields, the command that reproduces the row) and ``ratios.png`` (the ratios as
bars, the CI as error bars where given, else the spread; a line at 1.0: below it ours is faster).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (script, quick arguments): a few minutes in all on an idle 2-core machine
BENCHES = [
    ("bench_zero.py", ["--repeats", "7", "--hidden", "256", "--layers", "4"]),
    ("bench_pp.py", ["--repeats", "7", "--microbatches", "8", "--hidden", "128"]),
    # B + W vs one backward at h 512: at h 256 the fixed ~0.2 ms of each engine call dominates
    ("bench_split_backward.py", ["--repeats", "9", "--hidden", "512", "--tokens", "512"]),
    ("bench_cp.py", ["--repeats", "7", "--seq", "1024"]),
    ("bench_gdn_cp.py", ["--repeats", "7", "--seq", "512"]),  # a GDN layer's cp2 state pass vs one rank / an all-gather
    ("bench_dynamic_cp.py", ["--repeats", "7", "--seq", "2048"]),
    ("bench_tp.py", ["--repeats", "7"]),
    ("bench_tp_overlap.py", ["--repeats", "7", "--tp", "2"]),
    ("bench_moe.py", ["--repeats", "7", "--tokens", "128"]),
    ("bench_expert_balance.py", ["--repeats", "9"]),  # expert_balance=replicate vs standard / torchtitan, ep4 skewed
    ("bench_timing_overhead.py", ["--repeats", "15"]),  # step timing + flight recorder on / off (tp2 x pp2)
    ("bench_compile.py", ["--repeats", "11"]),  # [train].compile vs eager tokens/s, tiny model, one process
]


@dataclass
class Result:
    bench: str
    case: str
    fields: dict[str, str]
    command: str = ""
    spread: tuple[float, float] | None = field(init=False)
    ci: tuple[float, float] | None = field(init=False)

    def __post_init__(self):
        f = self.fields
        if "ratio_min" in f and "ratio_max" in f:
            self.spread = (float(f["ratio_min"]), float(f["ratio_max"]))
        elif "spread" in f and "-" in f["spread"][1:]:
            lo, hi = f["spread"].split("-", 1)
            self.spread = (float(lo), float(hi))
        else:
            self.spread = None
        self.ci = tuple(float(x) for x in f["ci95"].split("-", 1)) if "-" in f.get("ci95", "")[1:] else None

    @property
    def ratio(self) -> float | None:
        return float(self.fields["ratio"]) if "ratio" in self.fields else None

    def other_fields(self) -> str:
        skip = {"ratio", "ratio_min", "ratio_max", "spread", "ci95"}
        return " ".join(f"{k}={v}" for k, v in self.fields.items() if k not in skip)


def parse_results(bench: str, text: str, command: str = "") -> list[Result]:
    """Every ``RESULT <case> key=value ...`` line of a bench's output."""
    results = []
    for line in text.splitlines():
        if not line.startswith("RESULT "):
            continue
        case, *pairs = line.split()[1:]
        fields = dict(p.split("=", 1) for p in pairs if "=" in p)
        results.append(Result(bench, case, fields, command))
    return results


def markdown_table(results: list[Result]) -> str:
    lines = ["| bench | case | ratio | spread [min, max] | 95 % CI of the median | other fields | command |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r.ratio:.2f}" if r.ratio is not None else ""
        spread = f"[{r.spread[0]:.2f}, {r.spread[1]:.2f}]" if r.spread else ""
        ci = f"[{r.ci[0]:.2f}, {r.ci[1]:.2f}]" if r.ci else ""
        lines.append(f"| {r.bench} | {r.case} | {ratio} | {spread} | {ci} | {r.other_fields()} | `{r.command}` |")
    return "\n".join(lines) + "\n"


KEPT = "<!-- kept by run_all.py: hand-run benches below -->"  # what follows it in RESULTS.md survives a rewrite


def write_table(results: list[Result], path: Path, header: str = "") -> None:
    """``header`` and the table into ``path``; whatever follows a KEPT line in the old file is kept after it."""
    old = path.read_text() if path.is_file() else ""
    kept = "\n" + KEPT + old.split(KEPT, 1)[1] if KEPT in old else ""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(header + markdown_table(results) + kept)
    tmp.replace(path)


def plot_ratios(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.ratio is not None]
    labels = [f"{r.bench.removeprefix('bench_').removesuffix('.py')}: {r.case}" for r in rows]
    ratios = [r.ratio for r in rows]
    bars = [r.ci or r.spread for r in rows]
    lo = [r.ratio - b[0] if b else 0 for r, b in zip(rows, bars)]
    hi = [b[1] - r.ratio if b else 0 for r, b in zip(rows, bars)]
    fig, ax = plt.subplots(figsize=(10, max(3, 0.32 * len(rows) + 1)))
    ax.barh(range(len(rows)), ratios, xerr=[lo, hi], color=["tab:green" if x <= 1 else "tab:orange" for x in ratios],
            capsize=3)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ours / peer time (median of paired repeats; bars: its 95 % CI, else min-max)")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def _with_repeats(bench_args: list[str], repeats: int) -> list[str]:
    """``bench_args`` with its ``--repeats`` value replaced by ``repeats``."""
    out = list(bench_args)
    if "--repeats" in out:
        out[out.index("--repeats") + 1] = str(repeats)
    return out


def run_bench(script: str, args: list[str], timeout: float) -> tuple[list[Result], float]:
    command = shlex.join(["uv", "run", "python", f"tools/bench/{script}", *args])
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=HERE.parent.parent, env={**os.environ, "PYTHONPATH": str(HERE)})
    seconds = time.perf_counter() - start
    results = parse_results(script, proc.stdout, command)
    if proc.returncode or not results:
        print(f"{script} exited {proc.returncode} with {len(results)} RESULT lines:\n{proc.stderr[-2000:]}", file=sys.stderr)
    commits = {line.split(":", 1)[1].strip() for line in proc.stdout.splitlines() if line.startswith("commit: ")}
    for r in results:
        r.fields["commit"] = ",".join(sorted(commits)) or "not printed"
    return results, seconds


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (the machine is shared: say how busy it was)."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--only", nargs="*", help="bench scripts to run (default: all)")
    ap.add_argument("--repeats", type=int, help="timed repeats for every bench (default: each one's quick setting)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per bench")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results, timings = [], []
    load_before = load_average()
    for script, bench_args in BENCHES:
        if args.only and script not in args.only:
            continue
        if args.repeats:
            bench_args = _with_repeats(bench_args, args.repeats)
        rows, seconds = run_bench(script, bench_args, args.timeout)
        print(f"{script}: {len(rows)} results in {seconds:.0f} s", flush=True)
        results += rows
        timings.append(f"{script} {seconds:.0f} s")
    commits = sorted({r.fields["commit"] for r in results})
    header = (f"# Benchmark results ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `uv run python "
              f"tools/bench/run_all.py`)\n\nCommit measured: {', '.join(commits)} (`git rev-parse --short HEAD`, "
              f"+dirty: uncommitted changes; each row's `commit` field says which). Machine: {os.cpu_count()} CPU "
              f"cores, shared; load average (1, 5, 15 min) {load_before} before, {load_average()} after.\n\n"
              "CPU gloo, world 4 where multi-rank. ratio = ours / "
              "peer, the median of per-repeat ratios of steps interleaved in the same processes (the slowest rank's "
              "time); spread = min and max of those ratios; CI = the median's 95 % confidence interval (order "
              "statistics): a win is claimed where it lies below 1. Wall time: " + ", ".join(timings) + ".\n\n")
    write_table(results, args.out / "RESULTS.md", header)
    plot_ratios(results, args.out / "ratios.png")
    print(markdown_table(results))


if __name__ == "__main__":
    main()
