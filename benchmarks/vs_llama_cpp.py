"""kvtool beside llama.cpp on the same machine, model and workload shapes; prints the ratios.

    .venv/bin/python benchmarks/vs_llama_cpp.py /path/to/llama.cpp/build [-m smollm2] [-t 2] [-r 2]

The build folder must hold llama-bench, llama-batched-bench and llama-parallel (in bin/ or at
its top). Each measurement runs both tools back to back, alternating which goes first, `-r`
rounds, so a change in machine load hits both alike; the table gives each tool's median and the
range of its rounds. `-m` takes a known model's name or a GGUF file (benchmarks/model_shapes.py
writes files of real models' shapes).
Measures: tg128 and pp512 (`bench`), S_TG of `batched-bench` at PP 128 / TG 128 for each B of
`--npl` (split KV, one stream per sequence, as both tools default), `parallel -np 8 -ns 32
-n 64` total tokens/s, peak RSS of a tg128 run, and the wall time of a process that loads
the model and generates one token (llama-simple, when the build has it). llama.cpp is never
imported: it is only run as a program, and is not a dependency of kvtool.

Both tools get the same K/V cache type (`--cache-type`, default f16, the default of both), so
their attention reads the same number of bytes. `--depth-types` adds generation at a depth
(`-d`, 4096 by default) for each K/V type it lists (f16,q8_0 by default): `bench -p 0 -n 32 -d`
beside `llama-bench ... -fa on` (llama.cpp needs flash attention for a quantized V; it gets it
for every type here, so the rows compare alike); `--depth-only` runs that measure alone.

On parallel: llama-parallel's system transcript (about 300 tokens) is compiled into it; kvtool's
is shorter, so kvtool gets enough filler turns (`--junk`) that its mean prompt length per request
reaches llama-parallel's, which the table shows beside the speeds.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

KVTOOL = [sys.executable, "-m", "kvtool.commands"]


@dataclass
class Row:
    name: str
    kvtool: list[float] = field(default_factory=list)
    llama: list[float] = field(default_factory=list)
    note: str = ""

    def line(self) -> str:
        k = statistics.median(self.kvtool) if self.kvtool else float("nan")
        c = statistics.median(self.llama) if self.llama else float("nan")
        ratio = k / c if c else float("nan")
        return f"| {self.name} | {cell(self.llama)} | {cell(self.kvtool)} | {ratio:.2f}x | {self.note} |"


def cell(xs: list[float]) -> str:
    """The median, and the range where there are several measurements."""
    if not xs:
        return "nan"
    m = statistics.median(xs)
    return f"{m:.1f}" if len(xs) == 1 else f"{m:.1f} ({min(xs):.1f}-{max(xs):.1f})"


def run(cmd: list[str], timeout: float = 3600) -> str:
    """stdout of `cmd` (stderr goes to ours); exits with a one-line error if it fails."""
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.exit(f"error: {' '.join(cmd[:4])} ... exited with {p.returncode}")
    return p.stdout


def peak_rss_mb(cmd: list[str]) -> float:
    """Peak resident set of `cmd` in MB, from GNU time's %M (kilobytes)."""
    p = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"error: {' '.join(cmd[:4])} ... exited with {p.returncode}")
    return int(p.stderr.strip().splitlines()[-1]) / 1024


def find_tool(build: Path, name: str) -> str:
    for p in (build / "bin" / name, build / name):
        if p.is_file():
            return str(p)
    sys.exit(f"error: {name} not found in {build} (build llama.cpp with its tools first)")


def wall_s(cmd: list[str]) -> float:
    """Seconds from starting `cmd` to its exit."""
    t0 = time.perf_counter()
    run(cmd)
    return time.perf_counter() - t0


def bench_ts(out: str, n_prompt: int, n_gen: int) -> float:
    """avg_ts of the test with these sizes in llama-bench/kvtool bench JSON output."""
    for rec in json.loads(out):
        if rec["n_prompt"] == n_prompt and rec["n_gen"] == n_gen:
            return float(rec["avg_ts"])
    sys.exit(f"error: no pp{n_prompt}/tg{n_gen} result in bench output")


def batched_tg(out: str) -> dict[int, float]:
    """B -> S_TG from batched-bench jsonl output (both tools print the same keys)."""
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {int(r["pl"]): float(r["speed_tg"]) for r in rows}


def llama_parallel(out: str) -> tuple[float, int]:
    """(total tokens/s, prompt tokens) from llama-parallel's closing lines (its log)."""
    speed = re.search(r"Total speed \(AVG\):\s+speed:\s+([\d.]+)", out)
    prompt = re.search(r"Total prompt tokens:\s+(\d+)", out)
    if not speed or not prompt:
        sys.exit("error: llama-parallel printed no totals")
    return float(speed.group(1)), int(prompt.group(1))


def progress(what: str, values: list[float]) -> None:
    """One measurement as it arrives, with the load average (stderr): a long run that is cut
    short or disturbed still shows which rounds ran on a quiet machine."""
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    print(f"[{time.strftime('%H:%M:%S')} load {load}] {what}: {values[-1]:.1f}", file=sys.stderr, flush=True)


def alternate(rounds: int, a: Callable[[], None], b: Callable[[], None]) -> None:
    for i in range(rounds):
        for f in (a, b) if i % 2 == 0 else (b, a):
            f()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build", type=Path, help="llama.cpp build folder (holds bin/llama-bench ...)")
    ap.add_argument("-m", "--model", default="smollm2", help="known model name or GGUF path")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--rounds", type=int, default=2, help="alternating rounds per measure")
    ap.add_argument(
        "--bench-reps", type=int, default=3, help="-r of each bench run (repetitions in one process)"
    )
    ap.add_argument("--npl", default="16,32", help="batched-bench B values")
    ap.add_argument("--skip-parallel", action="store_true")
    ap.add_argument(
        "--cache-type", default="f16", help="K and V cache type of both tools (llama.cpp's default: f16)"
    )
    ap.add_argument("--depth", type=int, default=4096, help="tokens in the cache before generating")
    ap.add_argument("--depth-types", default="f16,q8_0", help="K/V types generated at --depth ('' for none)")
    ap.add_argument("--depth-only", action="store_true", help="only the generation at --depth")
    ap.add_argument("--batched-only", action="store_true", help="only batched-bench's S_TG")
    ap.add_argument(
        "--llama-repack",
        choices=("0", "1"),
        default="1",
        help="llama.cpp's weight repacking (its default 1); which of its paths is faster depends on the CPU",
    )
    a = ap.parse_args()

    gguf = run([*KVTOOL, "models", "path", a.model]).strip() if not a.model.endswith(".gguf") else a.model
    lb, lbb = (find_tool(a.build, n) for n in ("llama-bench", "llama-batched-bench"))
    lp = "" if a.skip_parallel or a.batched_only else find_tool(a.build, "llama-parallel")
    t = str(a.threads)
    kv = ["-ctk", a.cache_type, "-ctv", a.cache_type]  # both tools store the same K/V bytes
    no_repack = ["-nr"] if a.llama_repack == "0" else []
    rows: list[Row] = []

    depth_types = [x for x in a.depth_types.split(",") if x]
    deep = {x: Row(f"tg32 t/s at depth {a.depth}, K/V {x} (bench -d)") for x in depth_types}
    at_depth = ["-p", "0", "-n", "32", "-d", str(a.depth), "-t", t, "-r", "2", "-o", "json"]

    def kv_deep() -> None:
        for x, row in deep.items():
            out = run([*KVTOOL, "bench", "-m", gguf, *at_depth, "-ctk", x, "-ctv", x])
            row.kvtool.append(bench_ts(out, 0, 32))

    def ll_deep() -> None:
        for x, row in deep.items():
            # --repack 0: where the kernel grants no AMX tile state, llama.cpp's AMX repacking of
            # the weights dies of SIGILL in the depth's prompt (its generation alone runs)
            out = run([lb, "-m", gguf, *at_depth, "-ctk", x, "-ctv", x, "-fa", "on", "--repack", "0"])
            row.llama.append(bench_ts(out, 0, 32))

    if deep and not a.batched_only:
        alternate(a.rounds, kv_deep, ll_deep)
    if a.depth_only:
        print_rows(rows + list(deep.values()), gguf, a)
        return

    tg, pp = Row("tg128 t/s (bench)"), Row("pp512 t/s (bench)")

    # the same test in both tools: pp512 and tg128, the same repetitions, threads and K/V types
    same = ["-m", gguf, "-p", "512", "-n", "128", "-t", t, "-r", str(a.bench_reps), *kv, "-o", "json"]

    def kv_bench() -> None:
        out = run([*KVTOOL, "bench", *same])
        pp.kvtool.append(bench_ts(out, 512, 0))
        tg.kvtool.append(bench_ts(out, 0, 128))
        progress("kvtool pp512", pp.kvtool)
        progress("kvtool tg128", tg.kvtool)

    def ll_bench() -> None:
        out = run([lb, *same, "--repack", a.llama_repack])
        pp.llama.append(bench_ts(out, 512, 0))
        tg.llama.append(bench_ts(out, 0, 128))
        progress("llama.cpp pp512", pp.llama)
        progress("llama.cpp tg128", tg.llama)

    if not a.batched_only:
        alternate(a.rounds, kv_bench, ll_bench)
        rows += [tg, pp]

    npl = [int(x) for x in a.npl.split(",")]
    bb = {b: Row(f"batched-bench S_TG t/s, PP 128, TG 128, B = {b}") for b in npl}
    n_ctx = str(max(npl) * 256)
    common = ["-c", n_ctx, "-b", "2048", "-ub", "512", "-npp", "128", "-ntg", "128", "-npl", a.npl, "-t", t]
    common += kv

    def kv_bb() -> None:
        for b, s in batched_tg(
            run([*KVTOOL, "batched-bench", "-m", gguf, *common, "--output-format", "jsonl"])
        ).items():
            bb[b].kvtool.append(s)
            progress(f"kvtool batched S_TG B={b}", bb[b].kvtool)

    def ll_bb() -> None:
        for b, s in batched_tg(
            run([lbb, "-m", gguf, *common, *no_repack, "--output-format", "jsonl"])
        ).items():
            bb[b].llama.append(s)
            progress(f"llama.cpp batched S_TG B={b}", bb[b].llama)

    alternate(a.rounds, kv_bb, ll_bb)
    rows += list(bb.values())
    if a.batched_only:
        print_rows(rows, gguf, a)
        return

    if not a.skip_parallel:
        par = Row("parallel -np 8 -ns 32 -n 64, total t/s")
        shape: dict[str, list[int]] = {"kvtool": [], "llama": []}
        junk = 1

        def ll_par() -> None:
            p = subprocess.run(
                [lp, "-m", gguf, "-np", "8", "-ns", "32", "-n", "64", "-t", t, "-c", "8192", *kv, *no_repack],
                capture_output=True,
                text=True,
            )
            speed, n_prompt = llama_parallel(p.stdout + p.stderr)
            par.llama.append(speed)
            shape["llama"].append(n_prompt // 32)

        def kv_par() -> None:
            cmd = [
                *KVTOOL,
                "parallel",
                "-m",
                gguf,
                "-np",
                "8",
                "-ns",
                "32",
                "-n",
                "64",
                "-t",
                t,
                "-c",
                "8192",
                *kv,
            ]
            out = Path("/tmp/kvtool-vs-llama-parallel.json")
            run([*cmd, "--junk", str(junk), "--no-progress", "--json", str(out)])
            s = json.loads(out.read_text())
            par.kvtool.append(float(s["speed_total"]))
            shape["kvtool"].append(int(s["n_prompt"]) // 32)

        ll_par()  # its prompt length sets kvtool's filler turns
        for j in range(1, 8):  # the smallest -j whose mean prompt reaches llama-parallel's
            junk = j
            kv_par()
            if shape["kvtool"][-1] >= shape["llama"][0] or j == 7:
                break
            par.kvtool.clear()
            shape["kvtool"].clear()
        alternate(max(a.rounds - 1, 0), kv_par, ll_par)
        par.note = (
            f"prompt tokens per request: llama.cpp {statistics.median(shape['llama']):.0f}, "
            f"kvtool {statistics.median(shape['kvtool']):.0f} (--junk {junk})"
        )
        rows.append(par)

    rss = Row("peak RSS MB, bench -p 0 -n 128")
    rss.kvtool.append(
        peak_rss_mb([*KVTOOL, "bench", "-m", gguf, "-p", "0", "-n", "128", "-t", t, "-r", "1", *kv])
    )
    rss.llama.append(
        peak_rss_mb(
            [lb, "-m", gguf, "-p", "0", "-n", "128", "-t", t, "-r", "1", *kv, "--repack", a.llama_repack]
        )
    )
    rows.append(rss)

    first = Row("process start to exit after 1 generated token, s (lower is better)")
    places = (a.build / "bin" / "llama-simple", a.build / "llama-simple")
    simple = next((p for p in places if p.is_file()), None)
    other = "llama-simple -n 1 Hi" if simple else "no llama-simple in the build"
    first.note = f"kvtool run -p Hi -n 1; {other}"

    def kv_first() -> None:
        first.kvtool.append(wall_s([*KVTOOL, "run", "-m", gguf, "-p", "Hi", "-n", "1", "-t", t]))

    def ll_first() -> None:
        if simple:
            first.llama.append(wall_s([str(simple), "-m", gguf, "-n", "1", "Hi"]))

    alternate(max(a.rounds, 3), kv_first, ll_first)
    rows.append(first)
    print_rows(rows + list(deep.values()), gguf, a)


def print_rows(rows: list[Row], gguf: str, a: argparse.Namespace) -> None:
    # the depth runs always take --repack 0 (see ll_deep)
    repack = "0" if a.depth_only else a.llama_repack + (", depth rows 0" if a.depth_types else "")
    print(f"\nmodel {gguf}, {a.threads} threads, llama.cpp repack {repack}")
    print(f"{a.rounds} alternating rounds: median (range)\n")
    print("| measure | llama.cpp | kvtool | kvtool / llama.cpp | note |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(r.line())


if __name__ == "__main__":
    main()
