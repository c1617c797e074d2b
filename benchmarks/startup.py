"""How long commands that load no model take to answer: `kvtool --help`, each verb's --help,
--version, `models`, `defrag-sim --help`; beside llama.cpp's `llama-cli --help` when a build is
given. Prints the min and median wall time and the median CPU time (user + system) of N runs.

    .venv/bin/python benchmarks/startup.py [-n 20] [--llama-cpp /path/to/llama.cpp/build/bin]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

KVTOOL = str(Path(sys.executable).with_name("kvtool"))
COMMANDS = [
    ["--help"],
    ["--version"],
    ["run", "--help"],
    ["bench", "--help"],
    ["batched-bench", "--help"],
    ["parallel", "--help"],
    ["state", "load", "--help"],
    ["defrag-sim", "--help"],
    ["models"],
]


def measure(cmd: list[str], n: int) -> tuple[float, float, float]:
    """(min wall, median wall, median CPU) in seconds over n runs."""
    walls, cpus = [], []
    for _ in range(n):
        before, t0 = os.times(), time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        walls.append(time.perf_counter() - t0)
        after = os.times()
        cpus.append(
            after.children_user - before.children_user + after.children_system - before.children_system
        )
    return min(walls), statistics.median(walls), statistics.median(cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=20, help="runs of each command")
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp's bin folder (for llama-cli --help)")
    args = ap.parse_args()
    rows = [(f"kvtool {' '.join(c)}", [KVTOOL, *c]) for c in COMMANDS]
    if args.llama_cpp is not None:
        rows.append(("llama-cli --help", [str(args.llama_cpp / "llama-cli"), "--help"]))
    print(f"{'command':<28} {'min ms':>8} {'median ms':>10} {'CPU ms':>8}   (load {os.getloadavg()[0]:.2f})")
    for label, cmd in rows:
        lo, med, cpu = measure(cmd, args.n)
        print(f"{label:<28} {lo * 1e3:8.0f} {med * 1e3:10.0f} {cpu * 1e3:8.0f}")


if __name__ == "__main__":
    main()
