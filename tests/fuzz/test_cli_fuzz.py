"""Fuzzing the CLI's flags (issue 14): every verb, random flags from its own option list.

For each verb (`run`, `parallel`, `bench`, `batched-bench`, `defrag-sim`, `state ...`,
`models ...`) a case starts from a small, valid command line on a tiny model (-n, -c small)
and appends random flags read from the click command itself, with random values: huge,
negative and zero integers, NaN and infinite floats, empty strings, non-UTF-8 bytes (as
Python's argv carries them), missing files, folders and wrong files where a file is read or
written, unknown flags and llama.cpp's spellings. `run` without -p reads chat lines (with
/save, /load) from stdin.

Cases run in process, through `kvtool.commands.main` (what the console script calls), in a
worker process with a memory limit (an allocation the flags do not justify ends there, not
in the test runner) and a time limit per case. The invariant: exit 0, or a non-zero exit
with an `error:` line -- never a traceback, never an exception out of main, never a hang.
`benchmarks/fuzz_cli.py` runs the same for longer and groups what it finds.
"""

from __future__ import annotations

import io
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).parents[2]
TINY = REPO / "tests" / "data" / "tiny" / "models"
MEMORY_LIMIT = 4 << 30  # address space of the worker: the tiny models need < 1.5 GiB

# -- the worker: runs `main()` in process, one case at a time --------------------------------


class Hang(BaseException):
    """Raised by the timer in a case that does not finish (BaseException: no `except
    Exception` in the command may swallow it)."""


def _on_alarm(signum: int, frame: object) -> None:
    raise Hang


def run_in_process(argv: list[str], stdin: str, cwd: str, timeout: float) -> dict[str, Any]:
    """Runs `kvtool ARGV` through main() with stdin/stdout/stderr as a UTF-8 terminal has them;
    returns rc (None: hang), output, and the exception that escaped main, if any."""
    import torch

    from kvtool.commands import main

    threads = torch.get_num_threads()
    out, err = io.BytesIO(), io.BytesIO()
    saved = sys.argv, sys.stdin, sys.stdout, sys.stderr, os.getcwd()
    sys.argv = ["kvtool", *argv]
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8", "surrogateescape")), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(err, encoding="utf-8", errors="backslashreplace", write_through=True)
    os.chdir(cwd)
    rc: int | None = None
    escaped = None
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        try:
            main()
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Hang:
            rc = None
        except BaseException as e:
            rc = -1
            last = traceback.extract_tb(e.__traceback__)[-1]
            escaped = f"{type(e).__name__}: {str(e)[:200]} ({Path(last.filename).name}:{last.lineno})"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        texts = [b.getvalue().decode("utf-8", "backslashreplace") for b in (out, err)]
        sys.argv, sys.stdin, sys.stdout, sys.stderr = saved[:4]
        os.chdir(saved[4])
        torch.set_num_threads(threads)  # -t changes the process's threads: not the next case's
    return {
        "rc": rc,
        "out": texts[0],
        "err": texts[1],
        "escaped": escaped,
    }


def worker_main(req_fd: int, ans_fd: int) -> None:
    """Reads cases (JSON lines) from one pipe and answers on the other, until it closes."""
    import warnings

    warnings.simplefilter("ignore")
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    import kvtool.commands  # noqa: F401  (imports torch once, before the first case)

    with os.fdopen(req_fd, "r") as requests, os.fdopen(ans_fd, "w") as answers:
        for line in requests:
            req = json.loads(line)
            res = run_in_process(req["argv"], req["stdin"], req["cwd"], req["timeout"])
            answers.write(json.dumps(res) + "\n")
            answers.flush()


class Worker:
    """A kvtool process that runs cases in process; restarted when a case kills it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> None:
        req_r, req_w = os.pipe()
        ans_r, ans_w = os.pipe()
        code = (
            "import sys; sys.path.insert(0, '.'); from tests.fuzz.test_cli_fuzz import worker_main; "
            f"worker_main({req_r}, {ans_w})"
        )
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONHASHSEED="0")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=env,
            pass_fds=(req_r, ans_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(req_r)
        os.close(ans_w)
        self.requests = os.fdopen(req_w, "w")
        self.answers = os.fdopen(ans_r, "r")

    def run(self, argv: list[str], stdin: str = "", timeout: float = 20.0) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        with tempfile.TemporaryDirectory(prefix="kvtool-fuzz-") as cwd:
            try:
                req = {"argv": argv, "stdin": stdin, "cwd": cwd, "timeout": timeout}
                self.requests.write(json.dumps(req) + "\n")
                self.requests.flush()
                line = self.answers.readline()
            except BrokenPipeError:
                line = ""
            if not line:  # the worker died: killed for memory, or crashed
                assert self.proc is not None
                rc = self.proc.wait()
                self.proc = None
                return {"rc": None, "out": "", "err": "", "escaped": f"worker died (signal {-rc})"}
            return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.requests.close()
            self.proc.wait(timeout=30)
            self.proc = None


def problem(res: dict[str, Any]) -> str | None:
    """What breaks the invariant in one result, or None."""
    text = res["out"] + res["err"]
    if res["escaped"]:
        return f"escaped main: {res['escaped']}"
    if res["rc"] is None:
        return "hang: no answer within the time limit"
    if "Traceback (most recent call last)" in text:
        tail = [ln for ln in text.splitlines() if ln.strip()]
        return f"traceback: {tail[-1][:200] if tail else ''}"
    # `parallel --server` reports failed requests as llama-parallel does: a line each, a count
    # in the summary, exit 1
    failed_requests = "Failed requests:" in res["out"]
    if (
        res["rc"] != 0
        and not failed_requests
        and not any(ln.startswith("error:") for ln in res["err"].splitlines())
    ):
        return f"exit {res['rc']} without an error line: {res['err'].strip()[-200:]!r}"
    return None


# -- cases -------------------------------------------------------------------------------------


@dataclass
class Files:
    """What cases point at: a tiny model, a valid state, and files of the wrong kind."""

    root: Path
    model: str
    state: str
    seq_state: str
    text: str
    binary: str
    empty: str
    folder: str
    dangling: str

    @classmethod
    def make(cls, root: Path) -> Files:
        import kvtool

        model = str(TINY / "tiny-llama.gguf")
        ctx = kvtool.Context(kvtool.Model(model), kvtool.ContextParams(n_ctx=64, n_seq_max=2))
        kvtool.decode_tokens(ctx, [5, 6, 7, 8], 0, 0)
        kvtool.decode_tokens(ctx, [9, 10], 1, 0)
        ctx.state_save_file(root / "ctx.kvs", tokens={0: [5, 6, 7, 8], 1: [9, 10]})
        ctx.state_save_file(root / "seq.kvs", 1, tokens=[9, 10])
        (root / "text.txt").write_text("hello\nworld\n")
        (root / "binary.bin").write_bytes(bytes(range(256)) * 4)
        (root / "empty").write_bytes(b"")
        (root / "folder").mkdir()
        (root / "dangling").symlink_to(root / "nowhere")
        return cls(
            root,
            model,
            str(root / "ctx.kvs"),
            str(root / "seq.kvs"),
            str(root / "text.txt"),
            str(root / "binary.bin"),
            str(root / "empty"),
            str(root / "folder"),
            str(root / "dangling"),
        )


NON_UTF8 = "\udcff\udcfe"  # how Python's argv carries bytes that are not UTF-8
INTS = ["0", "1", "2", "3", "4", "8", "16", "32", "64"]
HOSTILE_INTS = ["-1", "-2", "0", "-2147483648", "2147483647", "2147483648", "4294967296", "100000"]
HOSTILE_INTS += ["9223372036854775807", "9223372036854775808", "-9223372036854775809", "10" * 20]
JUNK_INTS = ["", "x", "0x10", "nan", NON_UTF8, "1e3", "1.5"]
FLOATS = ["0", "0.5", "1", "1.1", "2", "100", "-1", "-0.5", "nan", "inf", "-inf", "-nan", "1e308", "1e999"]
FLOATS += ["-0.0", "1e-320", "", "x"]
STRS = ["", " ", "-", "x", "f16", "bf16", "q8_0", "F32", "none", "threshold=0.5", "threshold=nan", "on-fail"]
STRS += ["paged", "contiguous", "fixed:4", "lognormal:300", "exp:0", "uniform:1:2", "exp:-1", "fixed:nan"]
STRS += ["[/x]", "[bold]", NON_UTF8, "a" * 5000, "\n", "\x00x", "poisson", "closed", "json", "csv", "md"]
SKIP = {"--pip-arg", "--help", "-h"}  # pip reaches the network; help is not a case
# a server answers until a signal ends it: it is given a file that is not a model (and no -m
# of the fuzzer's), so its flags are parsed, its port bound and its load refused, and no case
# leaves it listening (its answers are tests/commands/serve's)
SERVERS = {"serve"}


def _paths(f: Files, rng: random.Random) -> list[str]:
    return [
        f.text, f.binary, f.empty, f.folder, f.dangling, f.state, f.seq_state, f.model,
        "missing.file", "no/such/dir/file", "", ".", "out.kvs", "out.json", "out.png", "x.db",
        str(Path(f.folder) / "new"), NON_UTF8, f"{f.text}/below",
    ]  # fmt: skip


def option_kind(opt: Any) -> type:
    """int, float, Path or str: what an option takes, read from its click type by class name
    (typer < 0.29 vendors click as typer._click; later ones have bare_type, naming the
    annotation, 'int | None', its annotations being postponed)."""
    names = {c.__name__ for c in type(getattr(opt, "type", None)).__mro__}
    for name, kind in (("IntParamType", int), ("FloatParamType", float), ("Path", Path), ("TyperPath", Path)):
        if name in names:
            return kind
    bare = getattr(opt, "bare_type", None)
    got = bare() if callable(bare) else "str"
    got = got if isinstance(got, str) else getattr(got, "__name__", "str")
    return {"int": int, "float": float, "Path": Path}.get(got.split("|")[0].strip(), str)


def _value(rng: random.Random, opt: Any, f: Files) -> str:
    name = max(opt.opts, key=len)
    if name == "--model" or name == "-m":
        return f.model if rng.random() < 0.7 else rng.choice([*_paths(f, rng), "smollm2x", "tiny"])
    if name == "--server":  # nothing reachable: refused at once or not a URL
        return rng.choice(["http://127.0.0.1:9", "notaurl", "", "http://[::1", "ftp://127.0.0.1:9", NON_UTF8])
    kind = option_kind(opt)
    roll = rng.random()
    if kind is int:
        return rng.choice(INTS if roll < 0.35 else HOSTILE_INTS if roll < 0.85 else JUNK_INTS)
    if kind is float:
        return rng.choice(FLOATS)
    if kind is Path or roll < 0.15:
        return rng.choice(_paths(f, rng))
    return rng.choice(STRS)


def verbs() -> dict[str, Any]:
    """Every verb's click command, by its path ("state load")."""
    import typer

    from kvtool.commands import _register, app

    _register()
    out: dict[str, Any] = {}

    def walk(cmd: Any, path: list[str]) -> None:
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                walk(sub, [*path, name])
        else:
            out[" ".join(path)] = cmd

    walk(typer.main.get_command(app), [])
    return out


def baseline(verb: str, f: Files) -> list[str]:
    """A small command line that works: what random flags are added to."""
    m = ["-m", f.model]
    return {
        "run": [*m, "-n", "4", "-c", "128", "--no-progress", "-p", "hello"],
        "parallel": [*m, "-np", "2", "-ns", "2", "-n", "4", "-c", "512", "--no-progress"],
        "bench": [*m, "-p", "8", "-n", "4", "-r", "1", "--no-progress"],
        "batched-bench": [*m, "-c", "128", "-npp", "8", "-ntg", "4", "-npl", "1", "--no-progress"],
        "kv-types": [*m, "-f", f.text, "--types", "bf16"],  # without: smollm2 and seven pairs
        "defrag-sim": ["--policy", "paged", "--requests", "20", "--clients", "4", "-c", "4096"],
        "state save": [*m, "-o", "saved.kvs", "-p", "hello", "-c", "64"],
        "state load": [*m, "-i", f.state, "-n", "2", "-c", "64"],
        "state inspect": [f.state],
        "state list": ["--store", "missing.db"],
        "models list": [],
        "models path": ["smollm2"],
        "models fetch": ["no-such-model"],
        "serve": ["-m", f.text, "--port", "0", "-t", "1"],
    }.get(verb, [])


CHAT_LINES = [
    "hello",
    "/save chat.kvs",
    "/load chat.kvs",
    "/load missing",
    "/save",
    "/load",
    "/help",
    "/list",
]
CHAT_LINES += ["/stats", "/clear", "/load {state}", "/load {folder}", "/save {folder}", "/nope", "", NON_UTF8]


@dataclass
class CliCase:
    argv: list[str]
    stdin: str

    def line(self) -> str:
        shown = " ".join(a if a and " " not in a else repr(a) for a in self.argv)
        return f"kvtool {shown[:300]}" + (f"  <<< {self.stdin[:120]!r}" if self.stdin else "")


def cli_cases(f: Files, seed: int, only: list[str] | None = None) -> Iterator[CliCase]:
    """An endless, seeded stream of command lines over every verb (or those in `only`)."""
    from kvtool.commands.flags import LLAMA_ONLY

    rng = random.Random(seed)
    commands = verbs()
    names = sorted(only or commands)
    llama = sorted(LLAMA_ONLY)
    weights = [1 + len(commands[v].params) for v in names]  # verbs with more flags get more cases
    while True:
        verb = rng.choices(names, weights)[0]
        cmd = commands[verb]
        opts = [p for p in cmd.params if p.param_type_name == "option" and not SKIP & set(p.opts)]
        if verb in SERVERS:
            opts = [p for p in opts if "--model" not in p.opts]
        argv = [*verb.split(), *baseline(verb, f)]
        for _ in range(rng.choice([1, 2, 2, 3, 4, 5])):
            r = rng.random()
            if r < 0.06:
                argv.append(rng.choice(["--nope", "-xyz", "--", "-", "--n-predict=", "---x"]))
            elif r < 0.12:
                argv += [rng.choice(llama), rng.choice(["99", "1", "x"])]
            elif opts:
                opt = rng.choice(opts)
                spelling = rng.choice([*opt.opts, *opt.secondary_opts])
                if opt.is_flag:
                    argv.append(spelling)
                else:
                    argv += [spelling, _value(rng, opt, f)]
        if rng.random() < 0.04 and argv[-1].startswith("-"):
            argv.pop()  # sometimes a flag left without its value
        elif rng.random() < 0.04:
            argv.append(max(opts, key=lambda o: len(o.opts[0])).opts[0] if opts else "-x")
        stdin = ""
        if (verb == "run" and "-p" not in argv[argv.index("run") :]) or rng.random() < 0.02:
            stdin = "\n".join(rng.choice(CHAT_LINES) for _ in range(rng.randrange(1, 4)))
            stdin = stdin.format(state=f.seq_state, folder=f.folder) + "\n/exit\n"
        yield CliCase(argv, stdin)


def chat_cases(f: Files, seed: int) -> Iterator[CliCase]:
    """`run` as a chat: lines with /save and /load of good, bad and missing files."""
    rng = random.Random(seed)
    while True:
        argv = ["run", "-m", f.model, "-n", "3", "-c", "128", "--no-progress"]
        lines = [rng.choice(CHAT_LINES) for _ in range(rng.randrange(1, 5))]
        stdin = "\n".join(lines).format(state=f.seq_state, folder=f.folder) + "\n/exit\n"
        yield CliCase(argv, stdin)


def fuzz(cases: Iterator[CliCase], n: int, worker: Worker, timeout: float) -> list[tuple[CliCase, str]]:
    found = []
    for i, case in enumerate(cases):
        if i >= n:
            break
        p = problem(worker.run(case.argv, case.stdin, timeout))
        if p is not None:
            found.append((case, p))
    return found


# -- the bounded CI run (the `files` and `worker` fixtures: tests/fuzz/conftest.py) -----------


def test_worker_reports_what_escapes(worker: Worker) -> None:
    """The harness itself: a good command passes, a bad flag is an error line, and what is
    not (a traceback) is caught."""
    assert problem(worker.run(["models", "list"])) is None
    bad = worker.run(["run", "--nope"])
    assert bad["rc"] == 2 and problem(bad) is None
    assert problem({"rc": 1, "out": "", "err": "Traceback (most recent call last):\nX\n", "escaped": None})
    assert problem({"rc": 1, "out": "", "err": "oops\n", "escaped": None})


@pytest.mark.parametrize("seed", [0])
def test_cli_flag_fuzz(files: Files, worker: Worker, seed: int) -> None:
    found = fuzz(cli_cases(files, seed), 120, worker, timeout=20.0)
    assert not found, "\n".join(f"{c.line()}\n    -> {p}" for c, p in found[:25])


def test_serve_flag_fuzz(files: Files, worker: Worker) -> None:
    """serve's flags, its bind and its refused load (it never gets to listen)."""
    found = fuzz(cli_cases(files, 0, only=sorted(SERVERS)), 100, worker, timeout=20.0)
    assert not found, "\n".join(f"{c.line()}\n    -> {p}" for c, p in found[:25])


def test_chat_load_fuzz(files: Files, worker: Worker) -> None:
    found = fuzz(chat_cases(files, 0), 12, worker, timeout=20.0)
    assert not found, "\n".join(f"{c.line()}\n    -> {p}" for c, p in found[:25])


# -- what the fuzzer found outside the classes other work fixes: each a regular test -----------


def test_a_binary_trace_is_an_error_line(files: Files, worker: Worker) -> None:
    """defrag-sim --trace on a file that is not UTF-8 text (was a UnicodeDecodeError)."""
    res = worker.run(["defrag-sim", "--policy", "paged", "--trace", files.binary])
    assert problem(res) is None and res["rc"] == 2
    # read a line at a time: its first line (bytes 0-10) is text, and not JSON
    assert "binary.bin:1: not JSON" in res["err"]


def test_option_kinds_are_read_from_the_verbs() -> None:
    """The fuzzer draws a value by what an option takes: when it read every option as a string
    (typer's vendored click), ints, floats and paths were never tried where they belong."""
    v = verbs()

    def kind(verb: str, name: str) -> type:
        return option_kind(next(p for p in v[verb].params if p.name == name))

    assert kind("run", "threads") is int
    assert kind("run", "temp") is float
    assert kind("state save", "output") is Path
