"""A chat conversation kept in sync with one sequence of a context's memory.

Each turn renders the whole conversation with the chat template, tokenizes it, keeps the
longest prefix already in the memory and decodes only the rest (what llama-server does with
its prompt cache), so a turn decodes just its new tokens and any template works."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtool.context import Context
from kvtool.errors import StateError
from kvtool.generate import Generation, TextStream, Timings, decode_tokens, generate
from kvtool.sampling import Sampler
from kvtool.state import StateInfo, inspect, read_file, write_atomic


def chat_section(info: StateInfo) -> dict[str, Any]:
    """The conversation a state carries (StateError if it carries none or it does not match)."""
    chat = (info.app or {}).get("chat")
    tokens = info.tokens()
    ok = (
        info.kind == "sequence"
        and isinstance(chat, dict)
        and isinstance(chat.get("messages"), list)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in chat["messages"]
        )
        and (chat.get("system") is None or isinstance(chat["system"], str))
    )
    if not ok or not isinstance(chat, dict):
        raise StateError("this state holds no chat conversation")
    if tokens is None or len(tokens) != info.seqs[0].pos_max + 1:
        raise StateError("corrupted state: the conversation's tokens do not match its cells")
    return chat


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChatSession:
    """Messages plus the token ids of `seq` held in the memory."""

    def __init__(
        self,
        ctx: Context,
        sampler: Sampler,
        system: str | None = None,
        seq: int = 0,
        use_template: bool = True,
    ) -> None:
        self.ctx = ctx
        self.sampler = sampler
        self.system = system
        self.seq = seq
        self.use_template = use_template
        self.ignore_eos = False  # llama.cpp's --ignore-eos: end-of-generation tokens are banned
        self.messages: list[dict[str, str]] = []
        self.cached: list[int] = []  # tokens of `seq` in the memory, positions 0..n-1
        self.timings = Timings()
        self.clear()

    def clear(self) -> None:
        """Forget the conversation (the system message stays) and its cells."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.ctx.memory.seq_rm(self.seq, -1, -1)
        self.cached = []
        self.sampler.reset()

    def _sync(self, tokens: list[int]) -> list[int]:
        """Drops the memory's tail that differs from `tokens`; returns the tokens to decode."""
        keep = min(common_prefix(self.cached, tokens), len(tokens) - 1)  # decode >= 1 for logits
        if not self.ctx.can_resume(self.seq, keep):
            keep = 0  # a sliding window forgot what the kept prefix needs: start over
        # Always cut the memory at `keep`: after a failed prompt decode it may hold more than `cached`.
        self.ctx.memory.seq_rm(self.seq, keep, -1)
        self.cached = self.cached[:keep]
        return tokens[keep:]

    def prompt_tokens(self) -> list[int]:
        """The whole conversation rendered with the chat template, as token ids."""
        model = self.ctx.model
        rendered = model.apply_chat_template(self.messages, add_generation_prompt=True)
        return model.tokenize(rendered, add_special=True, parse_special=True)

    def respond(
        self, user_text: str, n_predict: int = -1, on_text: Callable[[str], None] | None = None
    ) -> tuple[str, Generation]:
        """Adds the user's turn, generates the reply (streamed through on_text), records it."""
        if self.use_template:
            self.messages.append({"role": "user", "content": user_text})
            tokens = self.prompt_tokens()
        else:
            tokens = self.cached + self.ctx.model.tokenize(
                user_text, add_special=not self.cached, parse_special=False
            )
        try:
            new = self._sync(tokens)
            logits = decode_tokens(self.ctx, new, self.seq, len(self.cached), self.timings)
        except BaseException:
            if self.use_template:
                self.messages.pop()
            raise
        self.cached = list(tokens)
        stream = TextStream(self.ctx.model)
        parts: list[str] = []

        def emit(tok: int) -> None:
            piece = stream.push(tok)
            if piece:
                parts.append(piece)
                if on_text is not None:
                    on_text(piece)

        gen = generate(
            self.ctx,
            self.sampler,
            logits,
            len(self.cached),
            n_predict,
            emit,
            self.seq,
            self.timings,
            ignore_eos=self.ignore_eos,
        )
        tail = stream.flush()
        if tail:
            parts.append(tail)
            if on_text is not None:
                on_text(tail)
        # The memory holds every generated token but the last one sampled (decoded next turn).
        self.cached = (self.cached + gen.tokens)[: self.ctx.memory.seq_pos_max(self.seq) + 1]
        text = "".join(parts)
        if self.use_template:
            self.messages.append({"role": "assistant", "content": text})
        return text, gen

    # -- saving and resuming --------------------------------------------------------------------
    def state_data(self) -> bytes:
        """The conversation as a sequence state: its cells, token ids, messages and sampler."""
        chat = {"system": self.system, "messages": self.messages}
        return self.ctx.state_seq_get_data(
            self.seq, tokens=self.cached, sampler=self.sampler, app={"chat": chat}
        )

    def restore_data(self, data: bytes) -> StateInfo:
        """Resumes a conversation saved by `state_data` on this session's sequence (any model
        context that fits it). Checked first: on StateError nothing has changed."""
        chat = chat_section(inspect(data))
        info = self.ctx.state_seq_set_data(data, self.seq)
        self.system = chat.get("system")
        self.messages = [dict(m) for m in chat["messages"]]
        self.cached = list(info.tokens() or [])
        info.restore_sampler(self.sampler)
        return info

    def save_state(self, path: str | Path) -> int:
        """Writes `state_data()` to a file atomically; returns the bytes written."""
        return write_atomic(path, self.state_data())

    def load_state(self, path: str | Path) -> StateInfo:
        """Resumes the conversation saved in a file by `save_state`."""
        return self.restore_data(read_file(path))
