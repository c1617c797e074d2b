"""Linear layers and token embeddings over GGUF weights, in the form the `weights` mode asks for.

`weights="f32"` dequantizes every tensor to float32 at load (the exact path the tiny-model
oracle tests use). `weights="auto"` keeps quantized weights quantized and switches by the number
of rows: up to QUANT_MAX_ROWS a quantized matmul reads 4-8 bits per weight (the compiled block
matmul over the file's bytes, kernels/qmatmul.c, where the backend computes with the compiled
kernels (`compiled`, kvtool/backend) and it has the format; else torch's int4pack kernel where
the format maps onto it exactly). Above, the formats with
qmatmul's panel kernel (every format with AVX-512 VNNI, all but Q8_0 with AVX2) stay in the
compiled kernel; the others take a dense float32 GEMM on a copy dequantized on first such use
(prompts, large batches). Other formats are dequantized to float32 at load. The compiled kernel
quantizes activations per weight type as llama.cpp does; the residual stream, norms and softmax
stay float32.

`weights="f16"` / `"bf16"` keep matrices and the token embedding dense in that type (the GPU
default is bf16: "auto" means bf16 on CUDA, whose matmuls have no int4pack path); a matmul
takes its input in the weight's type and returns float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from kvtool.errors import ModelLoadError
from kvtool.gguf_file import GGUFFile, TensorInfo
from kvtool.kernels import qmatmul
from kvtool.kernels.dequant import F32, dequantize, supported_types
from kvtool.kernels.int4pack import Int4Packed, int4_groups, int4_linear, n_planes_of, pack, packable

WeightsMode = Literal["auto", "f32", "f16", "bf16"]
WEIGHTS_MODES: tuple[str, ...] = ("auto", "f32", "f16", "bf16")
_DENSE_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}

# Rows up to which the quantized matmul beats the dense float32 GEMM. Measured on this project's
# AVX2 machine (SmolLM2, 2 threads, compiled kernel): per matmul with the dense weight warm in
# the caches, native/dense time 0.82 at 16 rows, 0.97 at 32, 1.40 at 64 (gate/up), and 0.45 at 32
# for the 113 MB float32 output matrix; in the model, where no layer's dense weight stays cached,
# batched decode of 32 sequences went from 250 to 143 ms a step with the kernel (docs/benchmarks.md).
# Up to here the row kernels sum every row in one order (llama.cpp's), so a row's bits do not
# depend on the rows it shares a call with; above, the panel kernel (qmatmul_job.h's
# PANEL_MIN_ROWS) takes the formats it has.
QUANT_MAX_ROWS = 32


class Linear(Protocol):
    """y = x @ W.T (+ b) for x [n, n_in] float32 -> [n, n_out] float32."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


# An RMS norm (x, weight, eps) -> normed x: the models' own, for the paths that norm separately.
NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


class DenseLinear:
    """A dense weight (and optional bias) applied with F.linear; a float32 weight computes
    exactly as before, an f16/bf16 one takes its input in its type and returns float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [n_out, n_in]
        self.bias = bias if bias is None else bias.to(weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float32:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).float()


def _quant_kernel(infos: Sequence[TensorInfo], compiled: bool) -> str | None:
    """The kernel that computes these weights (one type, one width) stacked: "native" (the
    compiled block matmul, kernels/qmatmul.c, where the backend has it: `compiled`), "int4"
    (torch's int4pack) or None (keep dense)."""
    alike = len({int(i.qtype) for i in infos}) == 1 and len({i.shape[1] for i in infos}) == 1
    native = alike and len(infos) <= qmatmul.MAX_SEGS
    native = native and all(qmatmul.supported(i.qtype, i.shape) for i in infos)
    if native and compiled and qmatmul.available():
        return "native"
    if all(packable(i.qtype, i.shape) for i in infos) and len({n_planes_of(i.qtype) for i in infos}) == 1:
        return "int4"
    return None


class QuantLinear:
    """Quantized weights stacked along n_out when several share an input (one matmul for Q, K
    and V): the compiled block matmul over the file's bytes where it has the format, else
    torch's int4pack; the dense float32 copy is built on the first many-row call."""

    def __init__(
        self, f: GGUFFile, names: Sequence[str], bias: torch.Tensor | None = None, compiled: bool = True
    ) -> None:
        self._file, self._names = f, list(names)
        infos = [f.tensor_info(n) for n in names]
        self.native: qmatmul.QWeight | None = None
        self.packed: Int4Packed | None = None
        if _quant_kernel(infos, compiled) == "native":
            raws = [f.tensor_bytes(n) for n in names]
            self.native = qmatmul.QWeight(raws, infos[0].qtype, [i.shape for i in infos])  # type: ignore[misc]
        else:
            raws = [f.tensor_bytes(n) for n in names]
            groups = [int4_groups(r, i.qtype, i.shape) for r, i in zip(raws, infos, strict=True)]  # type: ignore[arg-type]
            self.packed = pack(*groups)
        self.bias = bias
        self._dense: torch.Tensor | None = None

    def dense(self) -> torch.Tensor:
        """The float32 weight [n_out, n_in], exactly as `gguf.quants.dequantize` gives it."""
        if self._dense is None:
            parts = [self._file.tensor(n) for n in self._names]
            self._dense = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self._dense

    def computes_natively(self, n_rows: int) -> bool:
        """Whether `n_rows` rows go to the compiled kernel (a few rows, or the panel kernel for
        many), rather than to int4pack or the dense GEMM."""
        return self.native is not None and (n_rows <= QUANT_MAX_ROWS or self.native.panels)

    def normed(self, x: torch.Tensor, w: torch.Tensor, eps: float, norm: NormFn) -> torch.Tensor:
        """self(norm(x, w, eps)), the RMS norm inside the compiled call where that applies (a
        normed row feeds only this matmul)."""
        if self.native is None or not self.computes_natively(x.shape[0]):
            return self(norm(x, w, eps))
        y = self.native(x, norm=(w, eps))
        return y + self.bias if self.bias is not None else y

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and self.computes_natively(x.shape[0]):
            y = self.native(x)
        elif x.shape[0] > QUANT_MAX_ROWS:
            return F.linear(x, self.dense(), self.bias)
        else:
            assert self.packed is not None
            y = int4_linear(x, self.packed)
        return y + self.bias if self.bias is not None else y


def glu_native(
    x: torch.Tensor,
    gate_up: LinearGroup,
    down: Linear,
    norm: tuple[torch.Tensor, float] | None = None,
    gelu: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """down(act(gate(x')) * up(x')) as one call of the compiled kernel, x' = x RMS-normed with
    norm = (w, eps) if given, else x; act silu, or with `gelu` ggml's CPU GELU by that table
    (qmatmul.ffn_glu). None where it does not apply (more than QUANT_MAX_ROWS rows of a format
    without the panel kernel, weights not in it, biases): then compute it op by op."""
    f, n = gate_up.fused, x.shape[0]
    if f is None or f.native is None or f.bias is not None or not f.computes_natively(n):
        return None
    if not isinstance(down, QuantLinear) or down.native is None or down.bias is not None:
        return None
    if not down.computes_natively(n) or len(gate_up.sizes) != 2 or gate_up.sizes[0] != gate_up.sizes[1]:
        return None
    return qmatmul.ffn_glu(x, f.native, down.native, norm=norm, gelu=gelu)


def computes_natively(f: GGUFFile, weights: str, n_rows: int, compiled: bool) -> bool:
    """Whether a ubatch of `n_rows` rows has its matmuls in the compiled kernel (any of the
    file's matrices in one of its formats, the backend `compiled`), which then computes on
    threads of its own."""
    if weights != "auto" or n_rows > QUANT_MAX_ROWS or not compiled:
        return False
    infos = (f.tensor_info(n) for n in f.tensor_names())
    return any(len(i.shape) == 2 and qmatmul.supported(i.qtype, i.shape) for i in infos)


def check_types(f: GGUFFile) -> None:
    """Raises ModelLoadError naming the first tensor of a type kvtool cannot read (the types
    kernels/dequant has)."""
    ok = supported_types()
    for name in f.tensor_names():
        if f.tensor_info(name).qtype not in ok:
            raise ModelLoadError(
                f"{f.path.name}: tensor {name} has type {f.tensor_type(name)}, which kvtool cannot read"
            )


def check_weights_mode(weights: str) -> None:
    if weights not in WEIGHTS_MODES:
        raise ModelLoadError(f"unknown weights mode '{weights}' (one of: {', '.join(WEIGHTS_MODES)})")


def weights_for_device(weights: str, device: torch.device) -> str:
    """The mode a device computes with: "auto" (int4pack, a CPU kernel) is bf16 on CUDA."""
    return "bf16" if weights == "auto" and device.type == "cuda" else weights


def _dense(f: GGUFFile, name: str, weights: str) -> torch.Tensor:
    w = f.tensor(name)
    return w.to(_DENSE_DTYPES[weights]) if weights in _DENSE_DTYPES else w


def load_linear(
    f: GGUFFile, name: str, weights: str, bias: torch.Tensor | None = None, compiled: bool = True
) -> Linear:
    """The linear layer for GGUF tensor `name` ([n_out, n_in] in numpy order); `compiled`: the
    backend computes with the compiled CPU kernels (kvtool/backend)."""
    if weights == "auto" and _quant_kernel([f.tensor_info(name)], compiled) is not None:
        return QuantLinear(f, [name], bias, compiled)
    return DenseLinear(_dense(f, name, weights), bias)


class LinearGroup:
    """Several linear layers over one input (Q/K/V, gate/up): one stacked packed matmul whose
    output is split when every weight packs alike, else one layer each (also when the weights
    differ in type but the compiled kernel has each: a compiled call each beats int4pack). The
    float32 mode keeps one F.linear per weight, exactly as before."""

    def __init__(
        self,
        f: GGUFFile,
        names: Sequence[str],
        weights: str,
        biases: Sequence[torch.Tensor | None],
        split: Sequence[int] | None = None,
        compiled: bool = True,
    ) -> None:
        """`split`: the output sizes when one weight holds several outputs (phi3's fused Q/K/V);
        `compiled`: as `load_linear`'s."""
        infos = [f.tensor_info(n) for n in names]
        rows = [i.shape[0] for i in infos]
        self.sizes = list(split) if split is not None else rows
        kernel = _quant_kernel(infos, compiled) if weights == "auto" else None
        if kernel == "int4" and all(_quant_kernel([i], compiled) == "native" for i in infos):
            # weights of several types (Gemma 3's Q5_0 Q and K with a Q8_0 V): one compiled call
            # each beats one int4pack matmul of all (Gemma 3 270M: 190 us a layer and token for
            # the stacked int4pack call), and many rows keep the panel kernel
            kernel = None
        fuse = kernel is not None
        self.fused: QuantLinear | None = None
        self.parts: list[Linear] = []
        if fuse:
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat(
                    [b if b is not None else torch.zeros(n) for b, n in zip(biases, rows, strict=True)]
                )
            self.fused = QuantLinear(f, names, bias, compiled)
        else:
            self.parts = [load_linear(f, n, weights, b, compiled) for n, b in zip(names, biases, strict=True)]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[n, n_in] -> one [n, n_out_i] per weight, in the order of `names`."""
        if self.fused is not None:
            return list(self.fused(x).split(self.sizes, dim=-1))
        out = [p(x) for p in self.parts]
        return out if len(out) == len(self.sizes) else list(torch.cat(out, -1).split(self.sizes, dim=-1))

    def normed(self, x: torch.Tensor, w: torch.Tensor, eps: float, norm: NormFn) -> list[torch.Tensor]:
        """self(norm(x, w, eps)), the RMS norm inside the compiled call where that applies."""
        if self.fused is not None:
            return list(self.fused.normed(x, w, eps, norm).split(self.sizes, dim=-1))
        return self(norm(x, w, eps))


def linear_normed(lin: Linear, x: torch.Tensor, w: torch.Tensor, eps: float, norm: NormFn) -> torch.Tensor:
    """lin(norm(x, w, eps)), the norm inside the compiled call where `lin` is one that takes it."""
    if isinstance(lin, QuantLinear):
        return lin.normed(x, w, eps, norm)
    return lin(norm(x, w, eps))


def linear_rows(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    """lin over the last dim of x [..., n_in] -> [..., n_out]: a Linear takes rows [n, n_in]."""
    y = lin(x.reshape(-1, x.shape[-1]))
    return y.view(*x.shape[:-1], y.shape[-1])


class Embedding:
    """Token embedding rows. With `weights="auto"` only the rows asked for are dequantized (from
    the memory-mapped file, bit for bit as a full dequantization gives them)."""

    def __init__(self, f: GGUFFile, name: str, weights: str) -> None:
        info = f.tensor_info(name)
        self._qtype, self._shape = info.qtype, info.shape
        lazy = weights == "auto" and info.qtype != F32  # float32 data is a free view of the map
        self.dense: torch.Tensor | None = None if lazy else _dense(f, name, weights)
        # [n_vocab, bytes per row]: rows of every GGML type start on block boundaries
        self._rows = f.tensor_bytes(name).view(info.shape[0], -1)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] int64 (on any device) -> [n, n_embd] float32 on the weights' device."""
        if self.dense is not None:
            return self.dense[ids.to(self.dense.device)].float()
        return dequantize(self._rows[ids], self._qtype, (int(ids.shape[0]), self._shape[1]))


def output_linear(f: GGUFFile, weights: str, tok_embd: Embedding, compiled: bool = True) -> Linear:
    """The output projection; tied to the token embedding when the file has no output.weight."""
    if f.has_tensor("output.weight"):
        return load_linear(f, "output.weight", weights, compiled=compiled)
    if tok_embd.dense is not None:
        return DenseLinear(tok_embd.dense)
    return load_linear(f, "token_embd.weight", weights, compiled=compiled)
