"""What `run` says when a chat starts on a terminal, as llama-cli's banner does: the model (its
type and size), the context, the KV cache's layout and size, the chat template, the commands."""

from __future__ import annotations

import kvtool
from kvtool.common.model_desc import model_desc

_MiB = 1 << 20


def template_source(m: kvtool.Model) -> str:
    """Where the chat template comes from, as the banner and -v name it."""
    name = m.chat_template.name
    return "the GGUF's own, Jinja" if name == "builtin" else name


def banner_lines(
    ctx: kvtool.Context, threads: int, system: str | None, commands: dict[str, str]
) -> list[str]:
    """The banner, line by line."""
    m, p = ctx.model, ctx.params
    n_seq = p.n_seq_max
    layout = "one buffer shared by the sequences" if p.kv_unified else "one stream per sequence"
    est = ctx.memory_estimate
    kv = f"K {p.type_k}, V {p.type_v}, {layout}, {(est.kv + est.states) / _MiB:.1f} MiB"
    if ctx.memory.kind != "kv":
        kv += f" ({ctx.memory.kind})"
    source = template_source(m)
    lines = [
        f"model      : {m.name} ({model_desc(m)}, {m.size_bytes() / _MiB:.2f} MiB)",
        f"file       : {m.path}",
        f"context    : n_ctx = {ctx.n_ctx} ({ctx.n_ctx_seq} per sequence, {n_seq} sequence"
        f"{'s' if n_seq > 1 else ''}), n_batch = {ctx.n_batch}, n_ubatch = {ctx.n_ubatch}",
        f"KV cache   : {kv}",
        f"device     : {'CPU, ' + str(threads) + ' threads' if m.device.type == 'cpu' else str(m.device)}",
        f"template   : {source}",
    ]
    if system:
        lines.append("using custom system prompt")
    lines += ["", "available commands:"]
    lines += [f"  {name:<13} {what}" for name, what in commands.items()]
    lines += ["  \\ at the end of a line goes on on the next one; Ctrl-C stops a reply", ""]
    return lines
