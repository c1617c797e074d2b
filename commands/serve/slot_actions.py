"""llama-server's slot actions, `POST /slots/{id}?action=save|restore|erase` (with
--slot-save-path): a slot's state goes to a file in kvtool's verified state format, its context
checkpoints included (kvtool.common.slot_state), and comes back into the same slot, another one,
or another server of the same model. Files are read and written off the engine's thread; a slot
that is serving a request is waited for, as llama-server defers the action."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

import kvtool
from kvtool.commands.serve import api
from kvtool.commands.serve.app import Server
from kvtool.common import slot_state
from kvtool.common.slots import Slot

T = TypeVar("T")
_BUSY = object()  # the slot serves a request: try again at the next step


async def _on_idle(s: Server, slot: Slot, fn: Callable[[], T]) -> T:
    """Runs `fn` on the engine's thread once the slot is idle (at most --timeout seconds)."""
    deadline = time.monotonic() + s.p.timeout
    while True:
        out = await asyncio.wrap_future(s.loop.call(lambda: _BUSY if slot.busy else fn()))
        if out is not _BUSY:
            return out  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise api.ApiError(
                408, f"slot {slot.id} stayed busy for --timeout {s.p.timeout:g} s", "timeout_error"
            )
        await asyncio.sleep(0.05)


def _file(s: Server, body: dict[str, Any]) -> tuple[str, Path]:
    name = body.get("filename")
    if not isinstance(name, str) or not slot_state.valid_filename(name):
        raise api.bad("Invalid filename")
    assert s.p.slot_save_path is not None
    return name, s.p.slot_save_path / name


async def slot_action(s: Server, r: HttpRequest) -> Response:
    if s.p.slot_save_path is None:
        raise api.ApiError(
            501,
            "This server does not support slots action. Start it with `--slot-save-path`",
            "not_supported_error",
        )
    raw = r.path_params["id_slot"]
    sched = s.loop.sched
    if not raw.isdigit() or int(raw) >= len(sched.slots):
        raise api.bad("Invalid slot ID")
    slot, ctx = sched.slots[int(raw)], sched.ctx
    action = r.query_params.get("action")
    t0 = time.perf_counter()
    if action == "erase":
        n = await _on_idle(s, slot, lambda: slot_state.erase(ctx, slot))
        return JSONResponse({"id_slot": slot.id, "n_erased": n})
    if action not in ("save", "restore"):
        raise api.bad("Invalid action")
    name, path = _file(s, await s.body(r))
    if action == "save":
        data, n = await _on_idle(s, slot, lambda: (slot_state.encode(ctx, slot), len(slot.held)))
        try:
            written = await asyncio.to_thread(slot_state.write_file, path, data)
        except kvtool.StateError as e:
            raise api.ApiError(500, f"Unable to save slot: {e}", "server_error") from None
        ms = 1e3 * (time.perf_counter() - t0)
        out = {"id_slot": slot.id, "filename": name, "n_saved": n, "n_written": written}
        return JSONResponse(out | {"timings": {"save_ms": ms}})
    try:
        data = await asyncio.to_thread(slot_state.read_file, path)
        n = await _on_idle(s, slot, lambda: slot_state.restore(ctx, slot, data))
    except kvtool.StateError as e:
        raise api.bad(f"Unable to restore slot: {e}") from None
    ms = 1e3 * (time.perf_counter() - t0)
    out = {"id_slot": slot.id, "filename": name, "n_restored": n, "n_read": len(data)}
    return JSONResponse(out | {"timings": {"restore_ms": ms}})
