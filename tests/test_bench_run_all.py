"""tools/bench/run_all.py on canned bench output (no bench runs): RESULT lines parsed, the
spread read in both formats the benches write, the markdown table and the PNG chart written."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CANNED = """cp=4 S=1024 ... (a header line, ignored)
RESULT p2p ratio=1.84 ratio_min=1.50 ratio_max=2.31 ci95=1.61-2.02 repeats=7 bytes=9437184
noise RESULT not at the start of a line=1
RESULT allgather-fwd-vs-torch-flex ratio=0.71 ratio_min=0.60 ratio_max=0.95 repeats=7 bytes=6291456 peer_bytes=6291456
"""
SPLIT = "RESULT split-backward ratio=0.982 spread=0.951-1.040 replay_ratio=1.310\n"


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "tools/bench/run_all.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("run_all", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_parses_result_lines_and_writes_table_and_chart(tmp_path):
    run_all = _run_all()
    rows = run_all.parse_results("bench_cp.py", CANNED, "uv run python tools/bench/bench_cp.py --seq 1024")
    rows += run_all.parse_results("bench_split_backward.py", SPLIT, "uv run python tools/bench/bench_split_backward.py")
    assert [(r.case, r.ratio, r.spread, r.ci) for r in rows] == [
        ("p2p", 1.84, (1.50, 2.31), (1.61, 2.02)), ("allgather-fwd-vs-torch-flex", 0.71, (0.60, 0.95), None),
        ("split-backward", 0.982, (0.951, 1.040), None)]
    assert rows[1].other_fields() == "repeats=7 bytes=6291456 peer_bytes=6291456"

    run_all.write_table(rows, tmp_path / "RESULTS.md", "# header\n\n")
    lines = (tmp_path / "RESULTS.md").read_text().splitlines()
    assert lines[0] == "# header" and lines[2].startswith("| bench | case | ratio |")
    assert lines[4] == ("| bench_cp.py | p2p | 1.84 | [1.50, 2.31] | [1.61, 2.02] | repeats=7 bytes=9437184 | "
                        "`uv run python tools/bench/bench_cp.py --seq 1024` |")
    assert len(lines) == 4 + len(rows)

    kept = f"{run_all.KEPT}\n\n## by hand\n\nRESULT trainer layout=dp2 ratio=1.0\n"
    (tmp_path / "RESULTS.md").write_text("# old header\n\nold table\n\n" + kept)
    run_all.write_table(rows, tmp_path / "RESULTS.md", "# header\n\n")
    again = (tmp_path / "RESULTS.md").read_text()
    assert again.startswith("# header\n") and "old table" not in again and again.endswith("\n" + kept)

    run_all.plot_ratios(rows, tmp_path / "ratios.png")
    assert (tmp_path / "ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["RESULTS.md", "ratios.png"]  # no temporaries left


def test_median_ci_is_the_order_statistics_of_the_binomial_tables():
    spec = importlib.util.spec_from_file_location("paired_timing", ROOT / "tools/bench/paired_timing.py")
    paired_timing = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("paired_timing", paired_timing)  # its dataclass looks its module up there
    spec.loader.exec_module(paired_timing)
    Summary, median_ci = paired_timing.Summary, paired_timing.median_ci

    assert median_ci([float(x) for x in range(31, 0, -1)]) == (10.0, 22.0)  # 97.1 % coverage; 11th-21st: 92.9 %
    assert median_ci([float(x) for x in range(1, 101)]) == (40.0, 61.0)  # 96.5 %
    assert median_ci([3.0, 1.0, 2.0, 5.0, 4.0, 6.0, 7.0, 8.0]) == (1.0, 8.0)  # too few: min and max
    s = Summary.of([(1.0, 2.0)] * 4 + [(3.0, 2.0)] * 5)  # ratios 0.5 x 4, 1.5 x 5: 9 repeats, 2nd-8th values
    assert (s.ratio, s.ratio_min, s.ratio_max, s.ci_low, s.ci_high) == (1.5, 0.5, 1.5, 0.5, 1.5)
    assert "ci95=0.50-1.50 repeats=9" in s.spread()
