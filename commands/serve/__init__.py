"""`kvtool serve`: llama-server on kvtool's engine. An OpenAI-compatible HTTP server (Starlette
on uvicorn) over one context: -np slots, each a sequence (split streams unless -kvu), served by
the scheduler `kvtool parallel` uses too, on its own thread."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import typer

import kvtool
from kvtool.commands import app, common
from kvtool.commands.common import signals
from kvtool.commands.common.text import plain
from kvtool.commands.serve import access_log

err = common.text.lazy_console(stderr=True)


_parallel_range = common.values.bounds(-1, 63)


def _check_parallel(value: int) -> int:
    """-np: 1-63 slots, or -1 (auto); 0 is refused, as llama-server refuses it."""
    if value == 0:
        raise typer.BadParameter("must be -1 (auto) or in [1, 63], got 0")
    return int(_parallel_range(value))


def _names(model: str, path: str, alias: str | None) -> tuple[str, ...]:
    """The names a request's `model` may give: the aliases (-a, comma-separated) first, then
    -m as typed, the file's name and its stem."""
    aliases = [a.strip() for a in (alias or "").split(",") if a.strip()]
    p = Path(path)
    names = [*aliases, model, p.name, p.stem]
    return tuple(dict.fromkeys(names))


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a taken port is one line, at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise kvtool.KvtoolError(f"--host {host}: {e.strerror}") from None
    except ValueError:  # IDNA refuses it (a label over 63 characters, bytes not UTF-8), or a NUL
        raise kvtool.KvtoolError(f"--host {host}: not a host name or address") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise kvtool.KvtoolError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


GRACE = 5.0  # seconds requests in flight may take to finish once a stop is asked for


def _server_class(on_grace: Callable[[], object]) -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server; SIGINT, SIGTERM or SIGHUP starts its graceful shutdown (a second SIGINT
        forces it): requests in flight get GRACE seconds, then `on_grace` ends their tasks so
        that their answers close normally, before uvicorn would cancel them. The command then
        ends normally, exit 0, instead of re-raising the signal as uvicorn does."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            def stop(sig: int) -> None:
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                elif not self.should_exit:
                    note = f"serve: stopping: requests in flight get {GRACE:g} s (Ctrl-C again: at once)\n"
                    # os.write: a signal handler must not take the console's lock; after SIGHUP
                    # the terminal may be gone (EIO), and the stop goes on without the note
                    with contextlib.suppress(OSError):
                        os.write(2, note.encode())
                    timer = threading.Timer(GRACE, on_grace)
                    timer.daemon = True
                    timer.start()
                self.should_exit = True

            with signals.redirected(stop):
                yield

    return Server


@app.command("serve")
@common.flags
def serve(
    load: common.LoadFlags = common.LoadFlags(),
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on (only this one is bound).")
    ] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option(
            "--port", help="Port to listen on (0: any free one).", callback=common.values.bounds(0, 65535)
        ),
    ] = 8080,
    n_parallel: Annotated[
        int,
        typer.Option(
            "-np",
            "--parallel",
            help="Slots: requests served at once (-1: auto, 4 slots sharing one unified KV buffer, each "
            "up to the whole context, as llama-server).",
            callback=_check_parallel,
        ),
    ] = -1,
    context: common.ContextFlags = common.ContextFlags(),
    compaction: common.DefragFlags = common.DefragFlags(),
    cont_batching: common.ContBatchingOpt = True,
    cache_prompt: Annotated[
        bool,
        typer.Option(
            "--cache-prompt/--no-cache-prompt",
            help="Reuse the longest prefix a slot holds (a request's cache_prompt overrides it).",
        ),
    ] = True,
    sps: Annotated[
        float,
        typer.Option(
            "-sps",
            "--slot-prompt-similarity",
            help="Share of the prompt an idle slot must hold to be chosen for it (0: least recently used).",
            callback=common.values.bounds(0.0, 1.0),
        ),
    ] = 0.1,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", help="Keys a request must give (Bearer or X-Api-Key), comma-separated."),
    ] = None,
    alias: Annotated[
        str | None, typer.Option("-a", "--alias", help="Model names for the API, comma-separated.")
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            "-to",
            "--timeout",
            help="Seconds a request may take, waiting included.",
            callback=common.values.bounds(0.0, lo_open=True),
        ),
    ] = 600.0,
    max_queue: Annotated[
        int,
        typer.Option(
            "--max-queue",
            help="Requests that may wait for a slot; past them: 503 with Retry-After.",
            callback=common.values.bounds(0),
        ),
    ] = 64,
    metrics: Annotated[
        bool, typer.Option("--metrics", help="Serve /metrics (Prometheus text, with the KV ledger).")
    ] = False,
    slots: Annotated[bool, typer.Option("--slots/--no-slots", help="Serve /slots.")] = True,
    ctx_checkpoints: common.options.CtxCheckpointsOpt = 32,
    checkpoint_min_step: Annotated[
        int,
        typer.Option(
            "-cms",
            "--checkpoint-min-step",
            help="Tokens between two checkpoints inside a prompt (0: only 4 before its end).",
            callback=common.values.bounds(0),
        ),
    ] = 8192,
    cache_ram: Annotated[
        int,
        typer.Option(
            "-cram",
            "--cache-ram",
            help="MiB of host RAM for the prompts slots drop (-1: no limit, 0: none).",
            callback=common.values.bounds(-1),
        ),
    ] = 8192,
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            "--cache-dir",
            help="Folder of the disk prompt cache: what RAM drops, and every prompt at shutdown.",
        ),
    ] = None,
    cache_disk: Annotated[
        int,
        typer.Option(
            "--cache-disk",
            help="MiB of files --cache-dir may hold (-1: no limit).",
            callback=common.values.bounds(-1),
        ),
    ] = 16384,
    slot_save_path: Annotated[
        Path | None,
        typer.Option(
            "--slot-save-path",
            help="Folder of the files of POST /slots/{id}?action=save|restore (default: none, no actions).",
        ),
    ] = None,
    jinja: common.JinjaOpt = True,
) -> None:
    """An OpenAI-compatible server (llama-server): chat, completions, slots, metrics."""
    import uvicorn

    from kvtool.commands.serve.app import ServeParams, Server, build_app
    from kvtool.commands.serve.loop import EngineLoop
    from kvtool.commands.serve.routes import ROUTES
    from kvtool.common.checkpoints import CheckpointParams
    from kvtool.common.disk_cache import DiskCache
    from kvtool.common.ram_cache import RamCache
    from kvtool.common.scheduler import Scheduler, SchedulerParams

    for flag, folder in (("--slot-save-path", slot_save_path), ("--cache-dir", cache_dir)):
        if folder is not None and not folder.is_dir():
            raise kvtool.KvtoolError(f"{flag} {folder}: not a directory")
    # closed on every way out: a model that fails to load leaves nothing listening (the
    # process may go on, as a test's or a fuzzer's does)
    with contextlib.closing(_bind(host, port)) as sock:
        m = common.load_model(load, err)
        if jinja and m.file.get("tokenizer.chat_template", None) is not None:
            m.use_chat_template(jinja=True)
        if n_parallel == -1:  # llama-server's auto: 4 slots over one unified buffer
            n_parallel, context = 4, dataclasses.replace(context, kv_unified=True)
        cp = context.params(n_parallel, compaction.setting())
        ctx = common.make_context(m, cp, err)
        disk = None
        if cache_dir is not None:
            report = lambda line: err.print(plain(line))  # noqa: E731
            disk = DiskCache(cache_dir, m, cache_disk << 20 if cache_disk >= 0 else -1, report)
        ram = None
        if cache_ram != 0 or disk is not None:  # with --cache-ram 0 entries go straight to disk
            ram = RamCache(cache_ram << 20 if cache_ram >= 0 else -1, None if disk is None else disk.put)
        sched = Scheduler(
            ctx,
            SchedulerParams(
                n_parallel,
                slot_prompt_similarity=sps,
                cont_batching=cont_batching,
                n_step_tokens=ctx.n_batch,
                checkpoints=CheckpointParams(ctx_checkpoints, checkpoint_min_step),
                sources=tuple(t for t in (ram, disk) if t is not None),
            ),
        )
        keys = tuple(k.strip() for k in (api_key or "").split(",") if k.strip())
        params = ServeParams(
            _names(load.model, str(m.path), alias),
            keys,
            max_queue,
            timeout,
            metrics,
            slots,
            cache_prompt,
            slot_save_path,
        )
        loop = EngineLoop(sched)
        server = Server(m, loop, params)
        config = uvicorn.Config(
            build_app(server, ROUTES),
            log_config=access_log.LOG_CONFIG,
            log_level=None,  # the levels are the config's
            access_log=True,
            lifespan="off",
            timeout_graceful_shutdown=int(GRACE) + 5,
        )
        bound = sock.getsockname()
        err.print(
            plain(
                f"serve: {m.path.name} on {m.backend.name}, {n_parallel} slots of {ctx.n_ctx_seq} tokens "
                f"({'unified' if context.kv_unified else 'split'} KV, {context.type_k}/{context.type_v}), "
                f"model names: {', '.join(params.model_names)}"
            )
        )
        err.print(plain(f"main: server is listening on http://{host}:{bound[1]} - starting the main loop"))
        sys.stderr.flush()
        loop.start()
        try:
            stop_all = lambda: loop.call(lambda: sched.fail_all("the server stopped", stop="cancelled"))  # noqa: E731
            _server_class(stop_all)(config).run(sockets=[sock])
        finally:
            loop.stop()
            if disk is not None and ram is not None:  # every prompt a slot or RAM holds goes to disk
                for slot in sched.slots:
                    ram.offer(ctx, slot)
                ram.flush()
                disk.close()
    # after SIGHUP the terminal may be gone: the stop went well, exit 0 (rich answers a broken
    # pipe with SystemExit(1), a terminal hung up with EIO)
    with contextlib.suppress(OSError, SystemExit):
        err.print(plain("serve: stopped"))
