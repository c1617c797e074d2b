"""The backend (llama.cpp's ggml backends and their buffer types): which implementation computes
each op, chosen once at model load for a device and a weights mode (ggml-cpu built for an
instruction set, ggml-cuda), and the weights in the formats the implementations read.

Model code (kvtool/models) names ops (`ops.attend`, `ops.rms_norm_ggml`, `ops.decoder`,
`ops.ssm_scan`...) and imports no kernel module; this package is where compute meets the
kernels: `Backend` and its ops here; linear.py, linear layers and token embeddings over GGUF
weights as the weights mode and the backend hold them (the compiled block matmul's bytes,
int4pack's planes, dense float32/f16/bf16) and the tensor types kvtool reads; device_file.py, a
GGUFFile whose tensors are dequantized on the device; decoder.py, the bridge to the compiled
decoder call.

On the CPU the compiled kernels (kernels/cpu_lib.py) take the ops they have wherever the backend
has them loaded: attention, RoPE with the K/V store, ggml's RMS norm, the quantized matmuls with
`--weights auto` (linear.py holds the weights in the kernel's format when told `compiled`) and
the whole-decoder call; where they are not (no compiler, a failed build, or `compiled=False`,
the tests' reference) torch computes every op. On CUDA, Triton (where it is installed) computes
the kernels that have a Triton version, torch the others. What remains decided per call is the
operands' shape: a few rows against many (kernels' MAX_ROWS, linear.QUANT_MAX_ROWS), a cache
type a kernel has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch

from kvtool.backend.decoder import compiled_layers, decoder_weights
from kvtool.batch import UBatch
from kvtool.kernels import attention_cpu, cpu_lib, rms_norm_cpu, rope_store_cpu
from kvtool.kernels.attention import attention
from kvtool.kernels.decoder_cpu import DecoderWeights
from kvtool.kernels.hadamard import fwht
from kvtool.kernels.short_conv import short_conv
from kvtool.kernels.ssd import ssd
from kvtool.kernels.ssm_scan import ssm_scan
from kvtool.kernels.store_kv import store_kv
from kvtool.kernels.wkv6 import wkv6
from kvtool.kernels.wkv7 import wkv7
from kvtool.memory.base import MemoryContext
from kvtool.memory.kv_cache_context import KVView
from kvtool.models.hparams import HParams
from kvtool.models.layers import DecoderLayer, DecoderOptions, rms_norm
from kvtool.models.rope import RopeParams, Rotation, apply_rope

# what a model holds of the compiled decoder call: built by `Backend.decoder`, run by `decoder_layers`
Decoder: TypeAlias = DecoderWeights

# cpu_lib.simd()'s names as a backend column shows them (llama-bench's CPU features)
_ISA = {"avx512-vnni": "AVX512 VNNI", "avx2": "AVX2", "neon-dotprod": "NEON dotprod", "neon": "NEON"}


@dataclass(frozen=True)
class Backend:
    """The implementations a model computes with: `device`, the `weights` mode the device
    computes with, and `isa`, the instruction set of the compiled CPU kernels that take the ops
    they have ("" where none do: CUDA, or torch on the CPU)."""

    device: torch.device
    weights: str
    isa: str = ""

    @classmethod
    def choose(cls, device: torch.device, weights: str, compiled: bool = True) -> Backend:
        """The backend of a device: on the CPU the compiled kernels where they load (their
        warning says why not). `compiled=False`: torch computes every op (the reference the
        compiled kernels are checked against; for tests)."""
        load = device.type == "cpu" and compiled and cpu_lib.lib() is not None
        return cls(device, weights, cpu_lib.simd() if load else "")

    @property
    def compiled(self) -> bool:
        """Whether the compiled CPU kernels compute the ops they have."""
        return bool(self.isa)

    @property
    def name(self) -> str:
        """As llama-bench's backend column, with the CPU kernels' path: "CPU (AVX2)", "CPU
        (portable)" (plain C), "CPU (torch)" (no compiled kernels), "CUDA"."""
        if self.device.type != "cpu":
            return self.device.type.upper()
        return f"CPU ({_ISA.get(self.isa, self.isa)})" if self.isa else "CPU (torch)"

    # -- norms ------------------------------------------------------------------------------------
    def rms_norm_ggml(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """RMS norm with ggml's arithmetic (the sum of squares in double) where the compiled
        kernels compute: the bits of the compiled decoder call's norms, so that a forward that
        norms op by op and the call agree. torch's norm elsewhere."""
        if self.compiled and rms_norm_cpu.applies(x, w):
            return rms_norm_cpu.rms_norm_cpu(x, w, eps)
        return rms_norm(x, w, eps)

    # -- attention over the KV cache --------------------------------------------------------------
    def attend(
        self,
        view: KVView,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Stores the ubatch's K/V rows in the layer's cache, then attends per stream.

        q [n, n_head, d_k], k [n, n_head_kv, d_k], v [n, n_head_kv, d_v] -> [n, n_head * d_v]; k and
        v may also come as rows [n, n_head_kv * d] (what the cache stores: no reshape back and
        forth). The cache is read in its own type (f16/bf16/f32, or a quantized type's blocks):
        the kernel converts inside. Where the view asks for llama.cpp's Hadamard rotation, Q and K
        are rotated before K is stored, V before it is stored and the output back. `softcap`: the
        scores are soft-capped (kernels/attention_ref.py)."""
        n = q.shape[0]
        if view.rot_k:
            q, k = fwht(q, view.rot_k), fwht(k, view.rot_k)
        if view.rot_v:
            v = fwht(v, view.rot_v)
        store_kv(view.k_rows, k if k.dim() == 2 else k.reshape(n, -1), view.rows, view.type_k)
        store_kv(view.v_rows, v if v.dim() == 2 else v.reshape(n, -1), view.rows, view.type_v)
        return self._attend_stored(view, q, scale, softcap)

    def rope_attend(
        self,
        view: KVView,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        head_dim: int,
        rot: Rotation,
        rope: RopeParams,
        scale: float,
    ) -> torch.Tensor:
        """attend(view, rope(q), rope(k), v, scale) for q, k, v as rows [n, heads * head_dim]:
        with the compiled kernels the rotation and the K/V store are one call
        (kernels/rope_store_cpu.c, which rotates q and k in place), else op by op."""
        n = q.shape[0]
        if (
            self.compiled
            and rot.cs is not None
            and rope_store_cpu.applies(q, k, v, view.k_rows, view.v_rows, view.type_k, view.type_v)
        ):
            cs, k_rows, v_rows = rot.cs, view.k_rows, view.v_rows
            rope_store_cpu.rope_store(
                q, k, v, head_dim, cs, rope.n_rot, rope.neox, k_rows, v_rows, view.rows,
                view.type_k, view.type_v, view.rot_k, view.rot_v,
            )  # fmt: skip
            return self._attend_stored(view, q.view(n, -1, head_dim), scale)
        q = apply_rope(q.reshape(n, -1, head_dim), rot, rope)
        k = apply_rope(k.reshape(n, -1, head_dim), rot, rope)
        return self.attend(view, q, k, v, scale)

    def _attend_stored(
        self, view: KVView, q: torch.Tensor, scale: float, softcap: float = 0.0
    ) -> torch.Tensor:
        # the ubatch's K/V rows are in the cache (q rotated where the view asks): attend per stream
        n = q.shape[0]
        n_s = view.streams.stop - view.streams.start
        qs = q.reshape(n_s, n // n_s, q.shape[1], q.shape[2])  # [n_stream_ub, n / n_stream_ub, n_head, d_k]
        ks, vs = view.attended()  # [n_stream_ub, n_kv, n_head_kv, d (a quantized type: its blocks' bytes)]
        tk, tv = view.type_k, view.type_v
        cpu = self.compiled and attention_cpu.applies(qs, ks, vs, tk, tv)
        seen = view.cells if view.cells is not None else view.mask  # on CUDA the cells (no mask)
        assert seen is not None
        out = attention(qs, ks, vs, seen, scale, tk, tv, compiled=cpu, softcap=softcap)
        out = out.reshape(n, -1)
        return fwht(out, view.rot_v) if view.rot_v else out

    # -- the whole-decoder call -------------------------------------------------------------------
    def decoder(self, layers: Sequence[DecoderLayer], hp: HParams, opts: DecoderOptions) -> Decoder | None:
        """The compiled decoder call's description of a model's layers (built once, at load), or
        None where the backend has no compiled kernels or a layer's weights are not all in them."""
        if not self.compiled:
            return None
        return decoder_weights(layers, hp, opts)

    @staticmethod
    def decoder_layers(
        decoder: Decoder | None,
        ub: UBatch,
        mctx: MemoryContext,
        x: torch.Tensor,
        cs: Sequence[torch.Tensor | None],
    ) -> int:
        """Runs the first layers of a small ubatch in the compiled decoder call (`decoder`), in
        place on x; how many it ran (0: none, the model computes them op by op)."""
        return compiled_layers(decoder, ub, mctx, x, cs)

    # -- recurrent scans: one implementation per device (Triton on CUDA, torch elsewhere) ---------
    ssm_scan = staticmethod(ssm_scan)
    ssd = staticmethod(ssd)
    wkv6 = staticmethod(wkv6)
    wkv7 = staticmethod(wkv7)
    short_conv = staticmethod(short_conv)
