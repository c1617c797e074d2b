"""A chat conversation kept in sync with one sequence of a context's memory.

Each turn renders the whole conversation with the chat template, tokenizes it and hands it to
kvtool.resume_seq, which keeps the longest prefix already in the memory and decodes only the
rest (what llama-server does with its prompt cache), so a turn decodes just its new tokens and
any template works. A memory that cannot be cut back (sliding window, recurrent, hybrid) keeps
a context checkpoint 4 tokens before each prompt's end (kvtool.common.checkpoints), so a turn
whose rendering differs from what the memory holds near its end resumes from there; a saved
conversation carries its checkpoints."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvtool
from kvtool.commands.common import signals
from kvtool.commands.common.generate import Generation, TextStream, Timings, generate, shift_context
from kvtool.commands.common.progress import PROMPT_CHUNK
from kvtool.common import slot_state
from kvtool.common.checkpoints import CheckpointParams, SlotCheckpoints, needs_checkpoints


def chat_section(info: kvtool.StateInfo) -> dict[str, Any]:
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
        raise kvtool.StateError("this state holds no chat conversation")
    if tokens is None or len(tokens) != info.seqs[0].pos_max + 1:
        raise kvtool.StateError("corrupted state: the conversation's tokens do not match its cells")
    return chat


def _common_prefix(a: list[int], b: list[int]) -> list[int]:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return b[:n]


class ChatSession:
    """Messages plus the token ids of `seq` held in the memory. `ignore_eos` bans
    end-of-generation tokens (llama.cpp's --ignore-eos). `keep` turns on llama.cpp's
    --context-shift: a reply that fills the context keeps its first `keep` tokens (and the
    BOS, as llama.cpp; < 0: the whole prompt), discards half of the rest and goes on."""

    def __init__(
        self,
        ctx: kvtool.Context,
        sampler: kvtool.Sampler,
        system: str | None = None,
        seq: int = 0,
        use_template: bool = True,
        ignore_eos: bool = False,
        keep: int | None = None,
        n_checkpoints: int = 0,
    ) -> None:
        if keep is not None and not ctx.memory.can_shift():
            raise kvtool.KvtoolError("--context-shift: this model's memory cannot shift positions")
        self.ctx = ctx
        self.keep = keep
        self.sampler = sampler
        self.system = system
        self.seq = seq
        self.use_template = use_template
        self.ignore_eos = ignore_eos
        self.messages: list[dict[str, str]] = []
        self.cached: list[int] = []  # tokens of `seq` in the memory, positions 0..n-1
        self.pending: list[int] = []  # the reply's last sampled token, decoded with the next turn
        self.timings = Timings()
        n_cp = n_checkpoints if needs_checkpoints(ctx) else 0  # only the end-of-prompt ones
        self.checkpoints = SlotCheckpoints(CheckpointParams(n_max=n_cp, min_step=0))
        self.clear()

    def clear(self) -> None:
        """Forget the conversation (the system message stays) and its cells."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.ctx.memory.seq_rm(self.seq, -1, -1)
        self.checkpoints.clear()
        self.cached, self.pending = [], []
        self.shifted = False  # a context shift dropped tokens: `cached` is no rendering's prefix
        self.sampler.reset()

    def prompt_tokens(self) -> list[int]:
        """The whole conversation rendered with the chat template, as token ids."""
        model = self.ctx.model
        rendered = model.apply_chat_template(self.messages, add_generation_prompt=True)
        return model.tokenize(rendered, add_special=True, parse_special=True)

    def respond(
        self,
        user_text: str,
        n_predict: int = -1,
        on_text: Callable[[str], None] | None = None,
        on_prompt: Callable[[int, int], None] | None = None,
        on_tokens: Callable[[list[int], int], None] | None = None,
    ) -> tuple[str, Generation]:
        """Adds the user's turn, generates the reply (streamed through on_text), records it.
        `on_prompt(done, total)` follows the prompt's decoding, PROMPT_CHUNK tokens at a time;
        `on_tokens(tokens, n_held)` sees the turn's prompt tokens before they are decoded, and
        how many of them the memory already holds.

        A turn is all or nothing: an exception (an interrupt, a refused prompt) before the reply
        began leaves the messages as they were; once the reply began, what was generated is
        recorded before anything is raised (an interrupt meanwhile waits for it)."""
        n_messages = len(self.messages)
        gen: Generation | None = None
        recorded = False
        stream = TextStream(self.ctx.model)
        parts: list[str] = []

        def emit(tok: int) -> None:
            piece = stream.push(tok)
            if piece:
                parts.append(piece)
                if on_text is not None:
                    on_text(piece)

        try:
            tokens = self._turn_tokens(user_text)
            if on_tokens is not None:
                on_tokens(tokens, len(_common_prefix(self.cached, tokens)))
            t0 = time.perf_counter()
            kept, logits = self._decode_prompt(tokens, on_prompt)
            self.timings.n_prompt += len(tokens) - kept
            self.timings.t_prompt += time.perf_counter() - t0
            self.cached = list(tokens)
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
                n_keep=self._n_keep(),
            )
            with signals.held():
                text = self._record(gen, stream, parts, on_text)
                recorded = True
        except BaseException:
            if gen is None:  # the reply did not begin: the turn is dropped
                # resume_seq leaves a prefix of what the sequence held: cut `cached` to it
                self.cached = self.cached[: self.ctx.memory.seq_pos_max(self.seq) + 1]
                del self.messages[n_messages:]
            elif not recorded:  # interrupted on its way out of generate(): the reply was shown
                with signals.held():
                    self._record(gen, stream, parts, on_text)
            raise
        if gen.error is not None:  # recorded first: the conversation matches the memory
            raise gen.error
        return text, gen

    def regen_refusal(self) -> str | None:
        """Why the last reply cannot be generated again (llama-cli's /regen), or None."""
        if not self.use_template:
            return "/regen needs the chat template (--no-chat continues raw text)"
        if len(self.messages) < 2 or self.messages[-1]["role"] != "assistant":
            return "no reply to regenerate"
        if self.shifted:  # the memory no longer holds a rendering of the conversation
            return "a context shift dropped part of the conversation: /regen cannot go back"
        return None

    def regenerate(
        self,
        n_predict: int = -1,
        on_text: Callable[[str], None] | None = None,
        on_prompt: Callable[[int, int], None] | None = None,
        on_tokens: Callable[[list[int], int], None] | None = None,
    ) -> tuple[str, Generation]:
        """llama-cli's /regen: the last reply is dropped and generated again for the same user
        message (the memory keeps the conversation up to it). A turn as `respond`'s: an
        exception before the new reply began puts the old one back."""
        why = self.regen_refusal()
        if why is not None:
            raise kvtool.KvtoolError(why)
        last = self.messages[-2:]
        n_messages = len(self.messages) - 2
        del self.messages[-2:]
        try:
            return self.respond(last[0]["content"], n_predict, on_text, on_prompt, on_tokens)
        except BaseException:
            if len(self.messages) == n_messages:  # no new reply began: the old one stays
                self.messages.extend(last)
            raise

    def _turn_tokens(self, user_text: str) -> list[int]:
        """The user's turn added: the prompt's tokens, the memory shifted to fit if it must."""
        if self.use_template:
            self.messages.append({"role": "user", "content": user_text})
            tokens = self.prompt_tokens()
            # a shifted memory matches no rendering, and a turn that will need a shift must
            # extend the memory: then append the template's new text to what the memory holds
            append = self.shifted or (self.keep is not None and len(tokens) > self.ctx.n_ctx_seq)
            tail = self._turn_tail() if append else None
            if tail is not None:
                tokens = self.cached + self.pending + tail
        else:
            said = self.cached + self.pending  # raw text continues after the whole reply
            # llama-completion: the first prompt's special tokens are parsed (<start_of_turn> is one
            # token), later typed input is plain text
            first = not said
            tokens = said + self.ctx.model.tokenize(user_text, add_special=first, parse_special=first)
        if not tokens:  # llama.cpp's tools: an empty prompt is a BOS, or nothing to decode
            raise kvtool.KvtoolError("input is empty: the prompt has no tokens and the model adds no BOS")
        return self._shift_to_fit(tokens)

    def _record(
        self, gen: Generation, stream: TextStream, parts: list[str], on_text: Callable[[str], None] | None
    ) -> str:
        """The reply as generated: its last bytes shown, its tokens in `cached`/`pending`, its
        text in the messages. Returns the text."""
        tail = stream.flush()
        if tail:
            parts.append(tail)
            if on_text is not None and gen.error is None:
                try:
                    on_text(tail)
                except BaseException as e:  # recorded below, like the generation's own
                    gen.error = e
        # The memory holds every generated token but the last one sampled (decoded next turn).
        said, n_held = self.cached + gen.tokens, self.ctx.memory.seq_pos_max(self.seq) + 1
        for k, d in gen.shifts:  # the positions each context shift discarded
            said = said[:k] + said[k + d :]
        self.shifted = self.shifted or bool(gen.shifts)
        self.cached, self.pending = said[:n_held], said[n_held:]
        text = "".join(parts)
        if self.use_template:
            self.messages.append({"role": "assistant", "content": text})
        return text

    def _turn_tail(self) -> list[int] | None:
        """The tokens the template puts after the last reply, up to the new generation prompt
        (end of turn, the user's message...), or None when the template does not render the
        reply verbatim (then the whole conversation is decoded again)."""
        msgs = self.messages
        if len(msgs) < 2 or msgs[-2]["role"] != "assistant":
            return None
        model = self.ctx.model
        base = model.apply_chat_template(msgs[:-2], add_generation_prompt=True) + msgs[-2]["content"]
        full = model.apply_chat_template(msgs, add_generation_prompt=True)
        if not full.startswith(base):
            return None
        return model.tokenize(full[len(base) :], add_special=False, parse_special=True)

    def _shift_to_fit(self, tokens: list[int]) -> list[int]:
        """With a context shift, a turn that extends the memory but does not fit shifts it
        (halving what follows the kept tokens until it fits); returns the turn's tokens."""
        n_ctx, n_keep = self.ctx.n_ctx_seq, self._n_keep()
        n_held = len(self.cached)
        if n_keep is None or len(tokens) <= n_ctx or tokens[:n_held] != self.cached:
            return tokens
        while len(tokens) > n_ctx:
            n_discard = shift_context(self.ctx, self.seq, n_held, n_keep)
            if not n_discard:
                break  # resume_seq says it does not fit
            tokens = tokens[:n_keep] + tokens[n_keep + n_discard :]
            self.cached = self.cached[:n_keep] + self.cached[n_keep + n_discard :]
            n_held -= n_discard
            self.shifted = True
        return tokens

    def _n_keep(self) -> int | None:
        """Positions a context shift keeps: `keep` tokens after the BOS (llama.cpp's n_keep)."""
        if self.keep is None:
            return None
        if self.keep < 0:  # llama.cpp: the whole prompt
            return len(self.cached)
        bos = self.ctx.model.vocab.bos
        return min(self.keep + int(bool(self.cached) and self.cached[0] == bos), len(self.cached))

    def _decode_prompt(
        self, tokens: list[int], on_prompt: Callable[[int, int], None] | None
    ) -> tuple[int, Any]:
        """resume_seq on growing prefixes of `tokens` (from the nearest checkpoint where the
        memory cannot be cut back), so that a long prompt reports progress and a checkpoint is
        taken where one is due: each call keeps what the previous one decoded. Returns
        (positions kept, logits)."""
        cps = self.checkpoints
        self.cached = held = cps.rewind(self.ctx, self.seq, tokens, self.cached)
        cps.start(tokens)
        kept, logits = -1, None
        n = len(_common_prefix(held, tokens))
        while True:
            start, n = n, min(len(tokens), n + PROMPT_CHUNK) if on_prompt is not None else len(tokens)
            if (stop := cps.next_stop(start)) > 0:
                n = min(n, stop)
            k, logits = kvtool.resume_seq(self.ctx, self.seq, tokens[:n], held)
            kept = k if kept < 0 else kept
            self.cached = held = tokens[:n]  # on an error in the next chunk, this much is in
            if cps.due(n):
                cps.add(self.ctx, self.seq, n)
            if on_prompt is not None:
                on_prompt(n - kept, len(tokens) - kept)
            if n == len(tokens):
                return kept, logits

    # -- saving and resuming --------------------------------------------------------------------
    def _state_args(self) -> dict[str, Any]:
        chat = {"system": self.system, "messages": self.messages}
        return {
            "sampler": self.sampler,
            **slot_state.with_checkpoints(self.cached, self.checkpoints, {"chat": chat}),
        }

    def state_data(self) -> bytes:
        """The conversation as a sequence state: its cells, token ids, messages and sampler."""
        return self.ctx.state_seq_get_data(self.seq, **self._state_args())

    def save_state(self, path: str | Path) -> int:
        """Writes `state_data()` to a file atomically; returns the bytes written."""
        return self.ctx.state_save_file(path, self.seq, **self._state_args())

    def restore_data(self, data: bytes) -> kvtool.StateInfo:
        """Resumes a conversation saved by `state_data` on this session's sequence (any model
        context that fits it). Every part (the conversation, the cells, the sampler) is checked
        and staged before any is applied: on StateError nothing has changed."""
        info = kvtool.inspect_state(data)
        chat = chat_section(info)
        has_cps = slot_state.APP_KEY in (info.app or {})  # states saved before checkpoints have none
        cp_tokens, cps = slot_state.checkpoints_of(info, self.ctx.model.n_vocab) if has_cps else ([], [])
        sampler = kvtool.Sampler(self.sampler.params)  # staged: swapped in once the cells are in
        if not info.restore_sampler(sampler):
            sampler = self.sampler  # none saved: the session's own goes on
        info = self.ctx.state_seq_set_data(data, self.seq)  # checks everything, then applies
        self.system = chat.get("system")
        self.messages = [dict(m) for m in chat["messages"]]
        self.cached, self.pending = list(info.tokens() or []), []
        self.checkpoints.put(cp_tokens, cps)
        self.shifted = False
        self.sampler = sampler
        return info

    def load_state(self, path: str | Path) -> kvtool.StateInfo:
        """Resumes the conversation saved in a file by `save_state` (read once; see
        `restore_data`): on StateError nothing has changed."""
        data = _read_state(Path(path))
        try:
            return self.restore_data(data)
        except kvtool.StateError as e:  # which file: a chat reads several (--session, /load)
            raise kvtool.StateError(f"{path}: {e}") from None


def _read_state(path: Path) -> bytes:
    """A state file's bytes; a missing, special or unreadable file is a one-line StateError."""
    if not path.exists():
        raise kvtool.StateError(f"no state file {path}")
    if not path.is_file():  # a directory, or a FIFO that would block the chat
        raise kvtool.StateError(f"{path} is not a state file")
    try:
        return path.read_bytes()
    except OSError as e:
        raise kvtool.StateError(f"cannot read {path}: {e.strerror}") from None
