"""Time to first token of one long prompt from each tier of `kvtool serve`'s prompt cache
(docs/prompt-cache.md), and the bytes each keeps; llama-server beside it where it has the tier.

    .venv/bin/python benchmarks/serve_tiers.py [-m smollm2 -m gemma3-270m] [-n 2000]
        [--llama-server /work/llamacpp/src/build/bin/llama-server]

Each server runs with one slot (-np 1, -cms 512, --slot-save-path; kvtool also --cache-dir a
fresh folder) and gets requests of one answer token (n_predict 1, greedy: the request's time is
the time to its first token) on a prompt P of n tokens, an unrelated prompt R of n tokens and an
edit E of P (P's first 60 % and 64 new tokens):
  1. P cold: from scratch;
  2. P again: from the slot;
  3. the slot saved to a file (POST /slots/0?action=save);
  4. R, then P: P comes back from host RAM (-cram; the slot dropped it for R);
  5. E: the slot cuts P back (attention) or resumes from a checkpoint (sliding window);
  6. the file of 3 restored into the slot (action=restore), then P: the restore's time plus
     the request's;
then the server stops and a new one on the same folders gets
  7. P: from disk (kvtool's --cache-dir; llama-server has no disk tier: from scratch).
Printed: one Markdown row per step and server (cache_n, where it came from, time to first token,
the server's prompt_ms), then the bytes of a slot file, a RAM entry, a disk entry and a
checkpoint. llama-server's RAM entries and checkpoints are read from its log (-lv 4), in MiB to
three decimals. llama-server runs with -nr (docs/benchmarks.md: its AMX repacking dies of SIGILL
here).
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_vs_llama_server import KVTOOL, free_port, start

LLAMA_SERVER = "/work/llamacpp/src/build/bin/llama-server"
TEXT = " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box on shelf {i % 7}." for i in range(3000))
OTHER = " ".join(f"Day {i}: the river rose {i % 11} inches near mill {i % 5}." for i in range(3000))
EDIT = " ".join(f"Note {i}: the lamp is off." for i in range(40))
MIB = 1024 * 1024


def call(port: int, method: str, path: str, body: Any = None) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    data = None if body is None else json.dumps(body)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{method} {path}: {resp.status} {raw[:300]!r}")
    return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()


def ask(port: int, tokens: list[int], extra_ms: float = 0.0) -> dict[str, Any]:
    body = {"prompt": tokens, "n_predict": 1, "temperature": 0, "cache_prompt": True}
    t0 = time.perf_counter()
    t = call(port, "POST", "/completion", body)["timings"]
    ms = 1e3 * (time.perf_counter() - t0) + extra_ms
    return {
        "cache_n": t["cache_n"],
        "source": t.get("cache_source", "") or "-",
        "ms": ms,
        "prompt_ms": t["prompt_ms"],
    }


def slot_action(port: int, action: str, name: str) -> tuple[dict[str, Any], float]:
    t0 = time.perf_counter()
    out = call(port, "POST", f"/slots/0?action={action}", {"filename": name})
    return out, 1e3 * (time.perf_counter() - t0)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(300)
    except subprocess.TimeoutExpired:
        proc.kill()


def llama_log_bytes(log: Path, n_tokens: int) -> tuple[float, list[float]]:
    """From llama-server's log: the bytes of its RAM entry of `n_tokens` tokens (the largest
    listed), and of each checkpoint it created."""
    text = log.read_text(errors="replace")
    entries = [
        float(m[1]) * MIB
        for m in re.findall(r"prompt 0x[0-9a-f]+:\s+(\d+) tokens, checkpoints:\s+\d+,\s+([\d.]+) MiB", text)
        if abs(int(m[0]) - n_tokens) <= 2
    ]
    cps = [float(x) * MIB for x in re.findall(r"created context checkpoint .*?size = ([\d.]+) MiB", text)]
    return max(entries, default=0.0), cps


def scenario(
    kind: str, cmd: list[str], port: int, folders: dict[str, Path], a: argparse.Namespace
) -> dict[str, Any]:
    """Steps 1-7 on one server; rows and bytes."""
    log = folders["log"] / f"{kind}.log"
    rows: dict[str, dict[str, Any]] = {}
    with log.open("ab") as err:
        proc = start(cmd, port, err)
        try:
            tok = lambda s: call(port, "POST", "/tokenize", {"content": s})["tokens"]  # noqa: E731
            p, r = tok(TEXT)[: a.n_tokens], tok(OTHER)[: a.n_tokens]
            e = p[: int(0.6 * len(p))] + tok(EDIT)[:64]
            rows["cold"] = ask(port, p)
            rows["slot"] = ask(port, p)
            saved, _ = slot_action(port, "save", "p.bin")
            ask(port, r)
            rows["ram"] = ask(port, p)
            rows["edit"] = ask(port, e)
            restored, wall = slot_action(port, "restore", "p.bin")
            rows["restore"] = ask(port, p, extra_ms=wall)
            rows["restore"]["restore_ms"] = restored["timings"]["restore_ms"]
            if kind == "kvtool":
                metrics = call(port, "GET", "/metrics")
                cps = [c["bytes"] for c in call(port, "GET", "/slots")[0]["kv"]["checkpoints"]]
        finally:
            stop(proc)
        disk = [f.stat().st_size for f in folders["cache"].glob("*.state")] if kind == "kvtool" else []
        proc = start(cmd, port, err)
        try:
            rows["disk"] = ask(port, p)
        finally:
            stop(proc)
    if kind == "kvtool":
        ram = re.findall(r'^kvtool:cache_bytes\{tier="ram"\} ([\d.e+]+)$', metrics, re.M)
        n = re.findall(r'^kvtool:cache_entries\{tier="ram"\} ([\d.e+]+)$', metrics, re.M)
        ram_bytes = float(ram[0]) / max(float(n[0]), 1) if ram and n else 0.0
    else:
        ram_bytes, cps = llama_log_bytes(log, len(p))
    return {
        "rows": rows,
        "n": (len(p), len(e)),
        "slot_file": saved["n_written"],
        "ram": ram_bytes,
        "disk": max(disk, default=0),
        "checkpoints": cps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", action="append", help="registry names (default: smollm2, gemma3-270m)")
    ap.add_argument("-n", "--n-tokens", type=int, default=2000)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=LLAMA_SERVER, help="'' to run kvtool alone")
    a = ap.parse_args()
    steps = {
        "cold": "1. P cold",
        "slot": "2. P again (slot)",
        "ram": "4. P after R (RAM)",
        "edit": "5. E, P edited at 60 %",
        "restore": "6. slot file restored, P",
        "disk": "7. P after a restart (disk)",
    }
    for model in a.model or ["smollm2", "gemma3-270m"]:
        code = f"from kvtool.common import registry; print(registry.resolve_model({model!r}))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        gguf = out.stdout.strip()
        results: dict[str, dict[str, Any]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for kind in ["kvtool", "llama-server"] if a.llama_server else ["kvtool"]:
                folders = {k: Path(tmp) / kind / k for k in ["cache", "slots", "log"]}
                for f in folders.values():
                    f.mkdir(parents=True)
                port = free_port()
                common = ["-m", gguf, "--port", str(port), "-t", str(a.threads), "-np", "1"]
                common += [
                    "-c",
                    str(a.n_tokens + 1024),
                    "-cms",
                    "512",
                    "--slot-save-path",
                    str(folders["slots"]),
                ]
                if kind == "kvtool":
                    cmd = [*KVTOOL, "serve", *common, "--cache-dir", str(folders["cache"]), "--metrics"]
                else:
                    cmd = [a.llama_server, *common, "-nr", "--no-ui", "--metrics", "-lv", "4"]
                results[kind] = scenario(kind, cmd, port, folders, a)
                print(f"{model} {kind}: done", file=sys.stderr, flush=True)
        n_p, n_e = results["kvtool"]["n"]
        print(f"\n{Path(gguf).name}: P {n_p} tokens, E {n_e} tokens, -t {a.threads}, -np 1, -cms 512")
        print("| step | server | cache_n | from | TTFT ms | prompt_ms |")
        print("|---|---|---|---|---|---|")
        for key, label in steps.items():
            for kind, res in results.items():
                row = res["rows"][key]
                extra = f" (restore {row['restore_ms']:.0f})" if key == "restore" else ""
                print(
                    f"| {label} | {kind} | {row['cache_n']} | {row['source']} | {row['ms']:.0f}{extra} "
                    f"| {row['prompt_ms']:.0f} |"
                )
        print("\n| bytes | " + " | ".join(results) + " |")
        print("|---|" + "---|" * len(results))
        for key, label in [
            ("slot_file", "slot file of P"),
            ("ram", "RAM entry of P"),
            ("disk", "disk entry"),
        ]:
            print(f"| {label} | " + " | ".join(f"{r[key]:,.0f}" for r in results.values()) + " |")
        cps = " | ".join(f"{max(r['checkpoints'], default=0):,.0f}" for r in results.values())
        print(f"| largest checkpoint | {cps} |")


if __name__ == "__main__":
    main()
