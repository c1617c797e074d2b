"""A loaded model: weights, vocabulary and chat template (llama_model + llama_vocab)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from kvtool.backend.device_file import on_device
from kvtool.backend.linear import QUANT_MAX_ROWS, check_weights_mode, computes_natively, weights_for_device
from kvtool.backend.ops import Backend
from kvtool.batch import UBatch
from kvtool.chat_template import ChatTemplate, select_chat_template
from kvtool.device import resolve_device
from kvtool.errors import ModelLoadError
from kvtool.gguf_file import GGUFFile
from kvtool.kernels import cpu_lib
from kvtool.memory.base import MemoryContext
from kvtool.memory.spec import MemorySpec
from kvtool.models import ARCHITECTURES, SplitForward
from kvtool.models.hparams import HParams, bad_key
from kvtool.models.hparams_check import check_model
from kvtool.models.inputs import ForwardInputs
from kvtool.models.tensors import ModelTensors
from kvtool.threads import compute_threads
from kvtool.vocab import Vocab


class Model:
    """One set of weights; any number of `Context`s (conversations) can share it."""

    def __init__(
        self,
        path: str | Path,
        weights: str = "auto",
        device: str | torch.device | None = None,
        *,
        compiled: bool = True,
    ) -> None:
        """`weights`: "auto" keeps quantized weights quantized for the CPU's quantized matmuls
        (see kvtool/backend/linear.py) and is bf16 on CUDA; "f32" dequantizes everything to float32
        (the exact path); "f16"/"bf16" keep matrices dense in that type. `device`: "cpu"
        (None) or "cuda": the weights are dequantized there once, at load. `compiled=False`:
        torch computes every op on the CPU, none of the compiled kernels (the reference they are
        tested against). `backend` says which implementations compute (kvtool/backend)."""
        check_weights_mode(weights)
        self.device = resolve_device(device)
        weights = weights_for_device(weights, self.device)
        self.weights = weights
        self.backend = Backend.choose(self.device, weights, compiled)
        self.path = Path(path)
        self.file = GGUFFile(path)
        arch = self.file.arch
        if arch not in ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch[:40]!r} (supported: {', '.join(sorted(ARCHITECTURES))})"
            )
        self.vocab = Vocab.from_gguf(self.file)
        self.hparams = HParams.from_gguf(self.file, self.vocab.n_vocab)
        check_model(self.file, self.hparams, self.vocab.n_vocab)  # before any weight is read
        tensors = ModelTensors(on_device(self.file, self.device), self.hparams, self.backend)
        try:
            self.impl = ARCHITECTURES[arch](tensors)
        except KeyError as e:
            raise ModelLoadError(f"{self.path.name}: missing or malformed {e}") from e
        tensors.refuse_unclaimed()
        # the architecture again where its forward splits into inputs and device work
        self._split: SplitForward | None = self.impl if isinstance(self.impl, SplitForward) else None
        template = self.file.get("tokenizer.chat_template", None)
        if template is not None and not isinstance(template, str):  # llama.cpp refuses the load too
            raise bad_key(self.file, "tokenizer.chat_template", template, "not a string")
        self.use_chat_template(jinja=False)
        self.fingerprint = self.file.fingerprint()
        self.file.check_intact()
        self._native = computes_natively(self.file, weights, QUANT_MAX_ROWS, self.backend.compiled)

    def use_chat_template(self, jinja: bool) -> None:
        """Chooses the chat template as llama.cpp does; jinja=True renders the GGUF's own (--jinja)."""
        self.chat_template: ChatTemplate = select_chat_template(
            self.file.get("tokenizer.chat_template", None),
            self.arch,
            bos_token=self._special_text(self.vocab.bos),
            eos_token=self._special_text(self.vocab.eos),
            jinja=jinja,
        )

    def _special_text(self, token: int | None) -> str:
        return self.vocab.token_text(token) if token is not None and token >= 0 else ""

    # -- description ----------------------------------------------------------------------------
    @property
    def arch(self) -> str:
        return self.file.arch

    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def n_ctx_train(self) -> int:
        return self.hparams.n_ctx_train

    @property
    def name(self) -> str:
        name = self.file.get("general.name", None)
        return name if isinstance(name, str) and name else self.path.stem

    def n_params(self) -> int:
        return sum(int(torch.Size(self.file.tensor_shape(n)).numel()) for n in self.file.tensor_names())

    def size_bytes(self) -> int:
        return self.path.stat().st_size

    # -- text -----------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int], special: bool = False) -> str:
        return self.vocab.detokenize(ids, special=special)

    def token_to_piece(self, token: int, special: bool = True) -> bytes:
        return self.vocab.token_to_piece(token, special=special)

    def is_eog(self, token: int) -> bool:
        return self.vocab.is_eog(token)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.chat_template.apply(messages, add_generation_prompt=add_generation_prompt)

    # -- compute --------------------------------------------------------------------------------
    def memory_spec(self) -> MemorySpec:
        """The memory each layer needs; a context builds it with its own parameters."""
        return self.impl.memory_spec()

    def inputs(self, ub: UBatch) -> ForwardInputs | None:
        """The ubatch's inputs on the device, for an architecture whose forward splits into
        inputs and device work (kvtool/models/inputs.py); None for the others."""
        return self._split.inputs(ub) if self._split is not None else None

    def compute(self, inp: ForwardInputs, ub: UBatch, mctx: MemoryContext) -> torch.Tensor:
        """`forward` from `inputs(ub)`: device work only (what a CUDA graph captures)."""
        assert self._split is not None, self.arch
        return self._split.compute(inp, ub, mctx)

    def forward(self, ub: UBatch, mctx: MemoryContext) -> torch.Tensor:
        many = ub.n_tokens > QUANT_MAX_ROWS  # a prompt: the batch threads (-tb)
        if not self._native:
            n = compute_threads(many)
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)
            return self.impl.forward(ub, mctx)
        # A few rows: the compiled kernels' pool has the threads and torch computes on one (its
        # other ops are too small to share). Many rows: torch's GEMMs get them. Between ubatches
        # torch stays on one thread: its idle OpenMP workers spin for a while after every
        # parallel region, and would take the cores from the pool's (measured 20 against 12.8
        # ms per token on two cores).
        n = compute_threads(many)
        cpu_lib.set_threads(n)
        torch.set_num_threads(n if many else 1)
        try:
            return self.impl.forward(ub, mctx)
        finally:
            torch.set_num_threads(1)
