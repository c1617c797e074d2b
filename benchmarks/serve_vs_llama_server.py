"""`kvtool serve` beside llama-server: the same model, slots and workload, driven by the same
client (`kvtool parallel --server`), alternated; then prompt reuse: a request that shares a
long prefix with the one before it.

    .venv/bin/python benchmarks/serve_vs_llama_server.py /path/to/llama-server [-m smollm2] [-r 2]

Each round starts one server, waits for /health, runs `kvtool parallel --server URL -np N -ns M
-n K --json` against it, then a prefix probe, and stops it (SIGINT); the two servers alternate
which goes first. Printed: total tokens/s (prompt tokens the server processed plus answer
tokens, over the wall time) per round and the medians; the probe's cache_n and the time to the
first streamed token of the second request against a cold one. Both servers get -t, -c, -np,
split KV and f16 K/V. llama-server is only run as a program, with -nr (no weight repacking):
where the CPU reports AMX but the kernel does not grant its tile state, llama.cpp's AMX
repacked matmul dies of SIGILL (it does on the machine of docs/benchmarks.md); x86 repacks
no Q4_1 weights otherwise, so SmolLM2's Q4_1 loses nothing by it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO

KVTOOL = [sys.executable, "-m", "kvtool.commands"]
PREFIX = "You are a careful assistant who answers in one sentence. " * 40  # about 480 tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], port: int, log: IO[bytes] | None = None) -> subprocess.Popen[bytes]:
    """Starts a server and waits for its /health; its output goes to `log` (default: nowhere)."""
    out = log if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=out)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{cmd[0]} did not come up")


def ttft(port: int, prompt: str) -> tuple[float, int]:
    """Seconds to the first streamed token of a chat request, and its cache_n."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    msgs = [{"role": "user", "content": prompt}]
    body = {"messages": msgs, "max_tokens": 4, "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
    r = conn.getresponse()
    first, cache_n = 0.0, -1
    for line in r:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        doc = json.loads(line[6:])
        if not first and doc.get("choices") and doc["choices"][0]["delta"].get("content"):
            first = time.perf_counter() - t0
        if "timings" in doc:
            cache_n = doc["timings"]["cache_n"]
    conn.close()
    return first, cache_n


def one_round(name: str, cmd: list[str], port: int, a: argparse.Namespace) -> dict[str, float]:
    proc = start(cmd, port)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "p.json"
            url = f"http://127.0.0.1:{port}"
            par = [*KVTOOL, "parallel", "--server", url, "-m", a.model, "--no-progress"]
            par += ["-np", str(a.np), "-ns", str(a.ns), "-n", str(a.n), "--junk", str(a.junk), "-s", "1"]
            subprocess.run([*par, "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
            doc = json.loads(out.read_text())
        cold, _ = ttft(port, PREFIX + "What is the capital of France?")
        warm, cache_n = ttft(port, PREFIX + "What is the capital of Italy?")
        return {"tps": doc["speed_total"], "cold": cold, "warm": warm, "cache_n": cache_n}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("llama_server")
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--rounds", type=int, default=2)
    ap.add_argument("-np", type=int, default=8)
    ap.add_argument("-ns", type=int, default=32)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-c", type=int, default=16384)
    ap.add_argument("--junk", type=int, default=1)
    a = ap.parse_args()
    code = f"from kvtool.common import registry; print(registry.resolve_model({a.model!r}))"
    gguf = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    common = ["-c", str(a.c), "-np", str(a.np), "-t", str(a.threads)]
    servers = {
        "kvtool serve": lambda p: [*KVTOOL, "serve", "-m", gguf, "-a", a.model, "--port", str(p), *common],
        "llama-server": lambda p: [a.llama_server, "-m", gguf, "--port", str(p), *common, "-nr", "--no-ui"],
    }
    results: dict[str, list[dict[str, float]]] = {k: [] for k in servers}
    order = list(servers)
    for r in range(a.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            port = free_port()
            res = one_round(name, servers[name](port), port, a)
            results[name].append(res)
            print(f"round {r + 1} {name}: {res['tps']:.1f} t/s total, TTFT cold {res['cold'] * 1e3:.0f} ms, "
                  f"warm {res['warm'] * 1e3:.0f} ms (cache_n {res['cache_n']})", flush=True)  # fmt: skip
    print(f"\nparallel --server -np {a.np} -ns {a.ns} -n {a.n}, -c {a.c}, -t {a.threads}, {Path(gguf).name}")
    print("| server | total t/s (median) | TTFT cold ms | TTFT shared prefix ms | cache_n |")
    print("|---|---|---|---|---|")
    for name, rs in results.items():
        med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        ms = f"{med['cold'] * 1e3:.0f} | {med['warm'] * 1e3:.0f}"
        print(f"| {name} | {med['tps']:.1f} | {ms} | {med['cache_n']:.0f} |")


if __name__ == "__main__":
    main()
