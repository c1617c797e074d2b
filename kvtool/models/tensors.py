"""A model file's tensors as an architecture asks for them (llama.cpp's create_tensor).

An architecture names each of its tensors once, where it loads it, with the shape that its
hyper-parameters give. Sizes are `Dim`s, which carry the keys they come from, so a tensor that
is missing or shaped otherwise is one ModelLoadError naming the tensor, its shape and those keys
with their values, before the tensor is read. Every tensor asked for is claimed, and `Model`
refuses a file with tensors that no code claimed (llama.cpp: "wrong number of tensors"): kvtool
would leave their part of the computation out. The keys' own types and ranges are checked as they
are read (kvtool/models/hparams.py); what holds for every file is kvtool/models/hparams_check.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from kvtool.backend.linear import Embedding, Linear, LinearGroup, load_linear, output_linear
from kvtool.errors import ModelLoadError
from kvtool.gguf_file import GGUFFile
from kvtool.models.hparams import HParams, bad_key, per_layer

if TYPE_CHECKING:  # kvtool.backend.ops imports the models' building blocks
    from kvtool.backend.ops import Backend


@dataclass(frozen=True)
class Dim:
    """A size and the hyper-parameters that give it, as "arch.key value" strings."""

    n: int
    keys: tuple[str, ...] = ()

    def _with(self, other: Dim | int, n: int) -> Dim:
        keys = other.keys if isinstance(other, Dim) else ()
        return Dim(n, self.keys + tuple(k for k in keys if k not in self.keys))

    def __mul__(self, other: Dim | int) -> Dim:
        return self._with(other, self.n * int(other))

    __rmul__ = __mul__

    def __add__(self, other: Dim | int) -> Dim:
        return self._with(other, self.n + int(other))

    __radd__ = __add__

    def __floordiv__(self, other: int) -> Dim:
        return Dim(self.n // other, self.keys)

    def __int__(self) -> int:
        return self.n

    __index__ = __int__


Shape = Sequence[Dim | int]


@dataclass(frozen=True)
class AttnDims:
    """The sizes of one attention layer."""

    embd: Dim
    n_head: Dim
    n_head_kv: Dim
    head_k: Dim
    head_v: Dim

    @property
    def q(self) -> Dim:
        return self.n_head * self.head_k

    @property
    def k(self) -> Dim:
        return self.n_head_kv * self.head_k

    @property
    def v(self) -> Dim:
        return self.n_head_kv * self.head_v

    @property
    def out(self) -> Dim:
        """The output projection's input: every query head's values."""
        return self.n_head * self.head_v


def _strip(shape: Sequence[int]) -> tuple[int, ...]:
    """A shape without leading 1s (ggml's trailing ones)."""
    i = 0
    while i < len(shape) - 1 and shape[i] == 1:
        i += 1
    return tuple(shape[i:])


class ModelTensors:
    """The tensors of one file as an architecture claims them: `tensor`, `linear`, `group`...
    each check the tensor against its declared shape first. `backend` (kvtool/backend) is the
    implementation of each op the model computes with, its weights mode the one the linear
    layers follow (kvtool/backend/linear.py)."""

    def __init__(self, f: GGUFFile, hp: HParams, backend: Backend) -> None:
        self.f, self.hp, self.backend = f, hp, backend
        self.weights = backend.weights
        self._claimed: set[str] = set()

    # -- sizes -----------------------------------------------------------------------------------
    def dim(self, key: str, n: int) -> Dim:
        """Size n given by `{arch}.key`."""
        return Dim(n, (f"{self.f.arch}.{key} {n}",))

    @property
    def n_embd(self) -> Dim:
        return self.dim("embedding_length", self.hp.n_embd)

    @property
    def n_vocab(self) -> Dim:
        return Dim(self.hp.n_vocab, (f"n_vocab {self.hp.n_vocab} (tokenizer.ggml.tokens)",))

    @cached_property
    def _n_ff(self) -> list[int]:
        key = f"{self.f.arch}.feed_forward_length"
        return per_layer(self.f, key, self.f.get(key), self.hp.n_layer)

    def n_ff(self, il: int) -> Dim:
        """Layer il's feed-forward size (at least 1)."""
        n = self._n_ff[il]
        if n < 1:
            raise bad_key(self.f, f"{self.f.arch}.feed_forward_length", n, f"must be at least 1 (layer {il})")
        return self.dim("feed_forward_length", n)

    def attention(self, il: int, rope: bool = True) -> AttnDims:
        """Layer il's attention sizes, refused unless usable: heads that group evenly, positive
        head sizes, and (`rope`) an even rotated size within the head."""
        hp, a = self.hp, self.f.arch + "."
        n_kv = hp.n_head_kv[il]
        if hp.n_head < 1:
            raise bad_key(
                self.f, a + "attention.head_count", hp.n_head, f"layer {il} has attention: must be at least 1"
            )
        if n_kv < 1 or hp.n_head % n_kv:
            why = f"must divide attention.head_count {hp.n_head} (layer {il})"
            raise bad_key(self.f, a + "attention.head_count_kv", n_kv, why)
        if hp.head_dim_k < 1 or hp.head_dim_v < 1:
            raise bad_key(
                self.f,
                a + "attention.key_length",
                (hp.head_dim_k, hp.head_dim_v),
                "head sizes must be positive",
            )
        if rope and (hp.n_rot < 2 or hp.n_rot > hp.head_dim_k or hp.n_rot % 2):
            why = f"must be even and within the head size {hp.head_dim_k}"
            raise bad_key(self.f, a + "rope.dimension_count", hp.n_rot, why)
        return AttnDims(
            self.n_embd,
            self.dim("attention.head_count", hp.n_head),
            self.dim("attention.head_count_kv", n_kv),
            self.dim("attention.key_length", hp.head_dim_k),
            self.dim("attention.value_length", hp.head_dim_v),
        )

    # -- claims ----------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return self.f.has_tensor(name)

    def check(self, name: str, shape: Shape | None = None, numel: Dim | int | None = None) -> None:
        """Claims tensor `name`: ModelLoadError unless the file has it with this shape (numpy
        order), or with `numel` elements for a tensor the loader reshapes."""
        f = self.f
        if not f.has_tensor(name):
            why = f" ({f.arch}.block_count {self.hp.n_layer})" if re.match(r"blk\.\d+\.", name) else ""
            raise ModelLoadError(f"{f.path.name}: missing tensor {name}{why}")
        self._claimed.add(name)
        got = f.tensor_shape(name)
        dims = list(shape) if shape is not None else [numel] if numel is not None else []
        keys = tuple(dict.fromkeys(k for d in dims if isinstance(d, Dim) for k in d.keys))
        if numel is not None:
            n = 1
            for d in got:
                n *= d
            if n == int(numel):
                return
            want = f"{int(numel)} elements"
        elif shape is None or _strip(got) == _strip([int(d) for d in shape]):
            return
        else:
            want = str(tuple(int(d) for d in shape))
        raise ModelLoadError(f"{f.path.name}: tensor {name} is {got}, but {', '.join(keys)} make it {want}")

    def tensor(self, name: str, shape: Shape | None = None, numel: Dim | int | None = None) -> torch.Tensor:
        """Tensor `name` as float32 (see `check`)."""
        self.check(name, shape, numel)
        return self.f.tensor(name)

    def optional(
        self, name: str, shape: Shape | None = None, numel: Dim | int | None = None
    ) -> torch.Tensor | None:
        """`tensor`, or None where the file does not have it."""
        return self.tensor(name, shape, numel) if self.has(name) else None

    def linear(self, name: str, shape: Shape, bias: str | None = None) -> Linear:
        """The linear layer of weight `name` ([n_out, n_in]), with the optional bias `bias` [n_out]."""
        self.check(name, shape)
        b = self.optional(bias, shape[:1]) if bias is not None else None
        return load_linear(self.f, name, self.weights, b, self.backend.compiled)

    def group(
        self,
        parts: Sequence[tuple[str, Shape]],
        biases: Sequence[str | None] = (),
        split: Shape | None = None,
    ) -> LinearGroup:
        """Linear layers over one input (`LinearGroup`): weights (name, shape) with optional biases
        (`biases[i]` names weight i's, of n_out elements); `split`: the output sizes of one weight
        that holds several (a fused Q/K/V or gate/up)."""
        for name, shape in parts:
            self.check(name, shape)
        bs = list(biases) + [None] * (len(parts) - len(biases))
        loaded = [
            self.optional(b, s[:1]) if b is not None else None for b, (_, s) in zip(bs, parts, strict=True)
        ]
        sizes = [int(d) for d in split] if split is not None else None
        return LinearGroup(self.f, [n for n, _ in parts], self.weights, loaded, sizes, self.backend.compiled)

    def embedding(self) -> Embedding:
        """The token embedding `token_embd.weight` [n_vocab, n_embd]."""
        self.check("token_embd.weight", (self.n_vocab, self.n_embd))
        return Embedding(self.f, "token_embd.weight", self.weights)

    def output(self, tok_embd: Embedding, required: bool = False) -> Linear:
        """The output projection `output.weight` [n_vocab, n_embd]; tied to the token embedding
        where the file has none and it is not `required`."""
        if required or self.has("output.weight"):
            self.check("output.weight", (self.n_vocab, self.n_embd))
        return output_linear(self.f, self.weights, tok_embd, self.backend.compiled)

    def unclaimed(self) -> list[str]:
        """The file's tensors that nothing claimed."""
        return [n for n in self.f.tensor_names() if n not in self._claimed]

    def refuse_unclaimed(self) -> None:
        """ModelLoadError naming the first tensor that nothing claimed, if any."""
        rest = self.unclaimed()
        if rest:
            more = f" (and {len(rest) - 1} more)" if len(rest) > 1 else ""
            raise ModelLoadError(
                f"{self.f.path.name}: tensor {rest[0]}{more} is not used by kvtool's {self.f.arch} "
                "architecture (a variant kvtool does not support)"
            )
