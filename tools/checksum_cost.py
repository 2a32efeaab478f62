"""What checkpoint checksums cost on this machine (issue 38): ``uv run python tools/checksum_cost.py [--gib 1]``.

1. Hashing speed in memory, s/GiB, for the standard library's hashes (and xxhash's, if it happens
   to be installed: it is not a dependency), best of 3.
2. A model-only checkpoint of ``--gib`` GiB of fp32 (written as a save does, with its
   ``checksums.json``): ``verify_checkpoint`` (every file, warm page cache), and reading it with DCP
   with the checks and without them (as a checkpoint from before checksums), interleaved, 3 repeats;
   s/GiB min and max.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path


def hash_speeds(mib: int = 512) -> dict[str, float]:
    block = os.urandom(1 << 20)
    makers = {name: (lambda n=name: hashlib.new(n)) for name in ("sha256", "sha1", "blake2b", "blake2s", "md5")}
    try:
        import xxhash  # not a dependency: only measured when present

        makers |= {"xxh3_128 (xxhash, not a dependency)": xxhash.xxh3_128, "xxh64 (xxhash)": xxhash.xxh64}
    except ImportError:
        pass
    out = {}
    for name, make in makers.items():
        times = []
        for _ in range(3):
            h, t = make(), time.perf_counter()
            for _ in range(mib):
                h.update(block)
            h.digest()
            times.append(time.perf_counter() - t)
        out[name] = min(times) / (mib / 1024)
    return out


def verify_costs(gib: float, repeats: int = 3) -> dict[str, list[float]]:
    import torch

    from pretrain.checkpoint import full_model, integrity, store

    path = Path(tempfile.mkdtemp(prefix="checksum-cost-")) / "ckpt"
    g = torch.Generator().manual_seed(0)
    n = max(1, round(gib * 16))
    full_model.save_full_model(path, {f"layer{i}.weight": torch.randn(4096, 4096, generator=g) for i in range(n)},
                               {"format": store.FORMAT, "step": 0})
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**30
    checked = full_model.read_checksums
    rows: dict[str, list[float]] = {"verify_checkpoint (every file)": [], "DCP read, files checked": [],
                                    "DCP read, unchecked (no checksums.json)": []}
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            integrity.verify_checkpoint(path)
            rows["verify_checkpoint (every file)"].append((time.perf_counter() - t) / size)
            t = time.perf_counter()
            full_model.read_full_tensors(path)
            rows["DCP read, files checked"].append((time.perf_counter() - t) / size)
            full_model.read_checksums = lambda p: None  # as a checkpoint written before checksums
            t = time.perf_counter()
            full_model.read_full_tensors(path)
            rows["DCP read, unchecked (no checksums.json)"].append((time.perf_counter() - t) / size)
            full_model.read_checksums = checked
    finally:
        full_model.read_checksums = checked
        shutil.rmtree(path.parent)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    opts = parser.parse_args()
    print(f"hashing in memory ({os.cpu_count()} cores; other load on the machine counts):")
    for name, s in sorted(hash_speeds().items(), key=lambda kv: kv[1]):
        print(f"  {name:40s} {s:.3f} s/GiB")
    print(f"a {opts.gib:g} GiB checkpoint (s/GiB, 3 interleaved repeats):")
    for name, times in verify_costs(opts.gib).items():
        print(f"  {name:40s} min {min(times):.2f}  max {max(times):.2f}")


if __name__ == "__main__":
    main()
