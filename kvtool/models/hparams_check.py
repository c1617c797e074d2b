"""Hyper-parameters against tensors: the shape every weight must have, per architecture.

llama.cpp's loader asks for each tensor with the shape its hyper-parameters imply
(create_tensor) and refuses a file where they differ. This module does the same for every
architecture kvtool knows, before any weight is read: a mismatch is one ModelLoadError naming
the tensor, its shape and the keys (with their values) that size it, never a crash in the first
decode. The keys' own types and ranges are checked as they are read (kvtool/models/hparams.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvtool.errors import ModelLoadError
from kvtool.gguf_file import GGUFFile
from kvtool.kernels.dequant import supported_types
from kvtool.models.hparams import HParams, RWKVHParams, SSMHParams, SWAHParams, bad_key, per_layer, read_int


@dataclass(frozen=True)
class Want:
    """A tensor and what the hyper-parameters say about it."""

    name: str
    shape: tuple[int, ...] | None  # numpy order; leading 1s do not count (ggml's trailing ones)
    keys: tuple[str, ...]  # "key value" of each hyper-parameter that sizes it
    numel: int | None = None  # for a tensor the loader reshapes: only its size counts
    optional: bool = False


def _strip(shape: tuple[int, ...]) -> tuple[int, ...]:
    i = 0
    while i < len(shape) - 1 and shape[i] == 1:
        i += 1
    return tuple(shape[i:])


class _Keys:
    """Formats "arch.key value" for the error messages."""

    def __init__(self, f: GGUFFile) -> None:
        self.arch = f.arch

    def __call__(self, key: str, value: object) -> str:
        return f"{self.arch}.{key} {value}"


def _blocks(f: GGUFFile, hp: HParams) -> None:
    """Tensors of a block past block_count mean the count is wrong (llama.cpp: wrong number of
    tensors)."""
    for name in f.tensor_names():
        m = re.match(r"blk\.(\d+)\.", name)
        if m and int(m.group(1)) >= hp.n_layer:
            raise bad_key(f, f"{f.arch}.block_count", hp.n_layer, f"but the file has tensor {name}")


def _types(f: GGUFFile) -> None:
    ok = supported_types()
    for name in f.tensor_names():
        if f.tensor_info(name).qtype not in ok:
            raise ModelLoadError(
                f"{f.path.name}: tensor {name} has type {f.tensor_type(name)}, which kvtool cannot read"
            )


def _attention(f: GGUFFile, hp: HParams, il: int, k: _Keys, rope: bool) -> None:
    """The ranges attention needs in layer il (head counts, head sizes, rope dims)."""
    a = f.arch + "."
    n_kv = hp.n_head_kv[il]
    if hp.n_head < 1:
        raise bad_key(
            f, a + "attention.head_count", hp.n_head, f"layer {il} has attention: must be at least 1"
        )
    if n_kv < 1 or hp.n_head % n_kv:
        raise bad_key(
            f,
            a + "attention.head_count_kv",
            n_kv,
            f"must divide attention.head_count {hp.n_head} (layer {il})",
        )
    if hp.head_dim_k < 1 or hp.head_dim_v < 1:
        raise bad_key(
            f, a + "attention.key_length", (hp.head_dim_k, hp.head_dim_v), "head sizes must be positive"
        )
    if rope and (hp.n_rot < 2 or hp.n_rot > hp.head_dim_k or hp.n_rot % 2):
        raise bad_key(
            f, a + "rope.dimension_count", hp.n_rot, f"must be even and within the head size {hp.head_dim_k}"
        )


def _attn_tensors(
    hp: HParams, il: int, k: _Keys, bias: bool = False, qk_norm: bool = False, out_bias: bool = False
) -> Iterator[Want]:
    E, H, Hkv, dk, dv = hp.n_embd, hp.n_head, hp.n_head_kv[il], hp.head_dim_k, hp.head_dim_v
    p = f"blk.{il}."
    e, h, hkv = k("embedding_length", E), k("attention.head_count", H), k("attention.head_count_kv", Hkv)
    kl, vl = k("attention.key_length", dk), k("attention.value_length", dv)
    yield Want(p + "attn_q.weight", (H * dk, E), (h, kl, e))
    yield Want(p + "attn_k.weight", (Hkv * dk, E), (hkv, kl, e))
    yield Want(p + "attn_v.weight", (Hkv * dv, E), (hkv, vl, e))
    yield Want(p + "attn_output.weight", (E, H * dv), (e, h, vl))
    if bias:
        yield Want(p + "attn_q.bias", (H * dk,), (h, kl), optional=True)
        yield Want(p + "attn_k.bias", (Hkv * dk,), (hkv, kl), optional=True)
        yield Want(p + "attn_v.bias", (Hkv * dv,), (hkv, vl), optional=True)
    if out_bias:
        yield Want(p + "attn_output.bias", (E,), (e,), optional=True)
    if qk_norm:
        yield Want(p + "attn_q_norm.weight", (dk,), (kl,))
        yield Want(p + "attn_k_norm.weight", (dk,), (kl,))


def _ffn(
    f: GGUFFile, hp: HParams, il: int, k: _Keys, n_ff: list[int], names: tuple[str, str, str]
) -> Iterator[Want]:
    E, F = hp.n_embd, n_ff[il]
    if F < 1:
        raise bad_key(f, f"{f.arch}.feed_forward_length", F, f"must be at least 1 (layer {il})")
    e, ff = k("embedding_length", E), k("feed_forward_length", F)
    gate, up, down = (f"blk.{il}.{n}.weight" if n else "" for n in names)
    if gate:
        yield Want(gate, (F, E), (ff, e))
    yield Want(up, (F, E), (ff, e))
    yield Want(down, (E, F), (e, ff))


def _mamba(f: GGUFFile, hp: HParams, il: int, k: _Keys, s: SSMHParams) -> Iterator[Want]:
    p, E = f"blk.{il}.", hp.n_embd
    e, di = k("embedding_length", E), k("ssm.inner_size", s.d_inner)
    dc, ds, dt = (
        k("ssm.conv_kernel", s.d_conv),
        k("ssm.state_size", s.d_state),
        k("ssm.time_step_rank", s.dt_rank),
    )
    yield Want(p + "ssm_in.weight", (2 * s.d_inner, E), (di, e))
    yield Want(p + "ssm_conv1d.weight", (s.d_inner, s.d_conv), (di, dc))
    yield Want(p + "ssm_conv1d.bias", (s.d_inner,), (di,))
    yield Want(p + "ssm_x.weight", (s.dt_rank + 2 * s.d_state, s.d_inner), (dt, ds, di))
    yield Want(p + "ssm_dt.weight", (s.d_inner, s.dt_rank), (di, dt))
    yield Want(p + "ssm_dt.bias", (s.d_inner,), (di,))
    yield Want(p + "ssm_a", (s.d_inner, s.d_state), (di, ds))
    yield Want(p + "ssm_d", (s.d_inner,), (di,))
    yield Want(p + "ssm_out.weight", (E, s.d_inner), (e, di))
    yield Want(p + "ssm_dt_norm.weight", (s.dt_rank,), (dt,), optional=True)
    yield Want(p + "ssm_b_norm.weight", (s.d_state,), (ds,), optional=True)
    yield Want(p + "ssm_c_norm.weight", (s.d_state,), (ds,), optional=True)


def _mamba2(f: GGUFFile, hp: HParams, il: int, k: _Keys, s: SSMHParams) -> Iterator[Want]:
    p, E, nh, gn = f"blk.{il}.", hp.n_embd, s.dt_rank, s.n_group * s.d_state
    e, di = k("embedding_length", E), k("ssm.inner_size", s.d_inner)
    dc, ds, h = k("ssm.conv_kernel", s.d_conv), k("ssm.state_size", s.d_state), k("ssm.time_step_rank", nh)
    g = k("ssm.group_count", s.n_group)
    yield Want(p + "ssm_in.weight", (2 * s.d_inner + 2 * gn + nh, E), (di, g, ds, h, e))
    yield Want(p + "ssm_conv1d.weight", (s.d_inner + 2 * gn, s.d_conv), (di, g, ds, dc))
    yield Want(p + "ssm_conv1d.bias", (s.d_inner + 2 * gn,), (di, g, ds))
    for name in ("ssm_dt.bias", "ssm_a", "ssm_d"):
        yield Want(p + name, None, (h,), numel=nh)
    yield Want(p + "ssm_norm.weight", (s.n_group, s.d_inner // s.n_group), (g, di), optional=True)
    yield Want(p + "ssm_out.weight", (E, s.d_inner), (e, di))


def _llama_like(f: GGUFFile, hp: HParams, k: _Keys, n_ff: list[int], gemma: bool) -> Iterator[Want]:
    e = (k("embedding_length", hp.n_embd),)
    if gemma:
        SWAHParams.from_gguf(f, hp.n_layer, 0)  # its keys' types and ranges
    else:
        yield Want("rope_freqs.weight", None, (k("rope.dimension_count", hp.n_rot),), hp.n_rot // 2, True)
    for il in range(hp.n_layer):
        _attention(f, hp, il, k, rope=True)
        norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if gemma else [])
        for n in norms:
            yield Want(f"blk.{il}.{n}.weight", (hp.n_embd,), e)
        yield from _attn_tensors(hp, il, k, bias=not gemma, qk_norm=gemma)
        yield from _ffn(f, hp, il, k, n_ff, ("ffn_gate", "ffn_up", "ffn_down"))


def _hybrid(f: GGUFFile, hp: HParams, k: _Keys, n_ff: list[int], lfm2: bool) -> Iterator[Want]:
    """granitehybrid (Mamba-2 where head_count_kv is 0) and lfm2 (short convolutions there)."""
    E = hp.n_embd
    e = (k("embedding_length", E),)
    s = None
    if lfm2:
        n = read_int(f, f"{f.arch}.shortconv.l_cache", lo=2)
        lc = k("shortconv.l_cache", n)
    else:
        s = SSMHParams.from_gguf(f)
        s.check_mamba2(f)
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        for name in ("attn_norm", "ffn_norm"):
            yield Want(f"{p}{name}.weight", (E,), e)
        if hp.n_head_kv[il] > 0:
            _attention(f, hp, il, k, rope=lfm2 or bool(read_int(f, f"{f.arch}.rope.scaling.finetuned", True)))
            yield from _attn_tensors(hp, il, k, bias=not lfm2, qk_norm=lfm2, out_bias=not lfm2)
        elif s is None:
            yield Want(p + "shortconv.in_proj.weight", (3 * E, E), e)
            yield Want(p + "shortconv.conv.weight", (E, n), (*e, lc))
            yield Want(p + "shortconv.out_proj.weight", (E, E), e)
        else:
            yield from _mamba2(f, hp, il, k, s)
        yield from _ffn(f, hp, il, k, n_ff, ("ffn_gate", "ffn_up", "ffn_down"))


def _rwkv(f: GGUFFile, hp: HParams, k: _Keys, n_ff: list[int], v7: bool) -> Iterator[Want]:
    E, a = hp.n_embd, f.arch + "."
    r = RWKVHParams.from_gguf(f, E)
    e = (k("embedding_length", E),)
    for name in ("token_embd_norm", "output_norm"):
        yield Want(name + ".bias", (E,), e)
    if v7:
        lora = (
            ("w", "attention.decay_lora_rank"),
            ("a", "attention.iclr_lora_rank"),
            ("v", "attention.value_residual_mix_lora_rank"),
            ("g", "attention.gate_lora_rank"),
        )
        ranks = {x: (key, read_int(f, a + key, lo=1)) for x, key in lora}
    else:
        extra = read_int(f, a + "time_mix_extra_dim", lo=1)
        dextra = read_int(f, a + "time_decay_extra_dim", lo=1)
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        for name in ("attn_norm", "attn_norm_2"):
            yield Want(f"{p}{name}.weight", (E,), e)
            yield Want(f"{p}{name}.bias", (E,), e)
        for name in ("key", "value", "receptance", "output") + (() if v7 else ("gate",)):
            yield Want(f"{p}time_mix_{name}.weight", (E, E), e)
        if v7:
            yield Want(p + "time_mix_lerp_fused.weight", None, e, numel=6 * E)
            for x, (key, rank) in ranks.items():
                if x == "v" and il == 0:  # layer 0 has no value residual: llama.cpp sizes it as iclr
                    key, rank = ranks["a"]
                rk = (*e, k(key, rank))
                yield Want(f"{p}time_mix_{x}1.weight", (rank, E), rk)
                yield Want(f"{p}time_mix_{x}2.weight", (E, rank), rk)
                if x != "g":
                    yield Want(f"{p}time_mix_{x}0.weight", None, e, numel=E)
            for name in ("k_k", "k_a", "r_k"):
                yield Want(f"{p}time_mix_{name}.weight", None, e, numel=E)
            yield Want(p + "time_mix_ln.weight", (E,), e, optional=True)
            yield Want(p + "time_mix_ln.bias", (E,), e, optional=True)
        else:
            ex, dx = (*e, k("time_mix_extra_dim", extra)), (*e, k("time_decay_extra_dim", dextra))
            fused = f.has_tensor(p + "time_mix_lerp_fused.weight")
            yield Want(p + "time_mix_lerp_fused.weight", None, e, numel=5 * E, optional=not fused)
            for x in ("x",) if fused else ("x", "w", "k", "v", "r", "g"):
                yield Want(f"{p}time_mix_lerp_{x}.weight", None, e, numel=E)
            yield Want(p + "time_mix_w1.weight", (5 * extra, E), ex)
            yield Want(p + "time_mix_w2.weight", (5, E, extra), ex)
            hs = (*e, k("wkv.head_size", r.head_size))
            yield Want(p + "time_mix_first.weight", (r.n_head, r.head_size), hs)
            yield Want(p + "time_mix_decay.weight", None, e, numel=E)
            yield Want(p + "time_mix_decay_w1.weight", (dextra, E), dx)
            yield Want(p + "time_mix_decay_w2.weight", (E, dextra), dx)
            for name in ("key", "value", "receptance"):
                yield Want(f"{p}time_mix_{name}.bias", (E,), e, optional=True)
            yield Want(p + "time_mix_ln.weight", (E,), e)
            yield Want(p + "time_mix_ln.bias", (E,), e)
            yield Want(p + "channel_mix_lerp_r.weight", None, e, numel=E)
            yield Want(p + "channel_mix_receptance.weight", (E, E), e)
        yield Want(p + "channel_mix_lerp_k.weight", None, e, numel=E)
        yield from _ffn(f, hp, il, k, n_ff, ("", "channel_mix_key", "channel_mix_value"))


def _recurrent(f: GGUFFile, hp: HParams, k: _Keys, v2: bool) -> Iterator[Want]:
    s = SSMHParams.from_gguf(f)
    if v2:
        s.check_mamba2(f)
    for il in range(hp.n_layer):
        yield Want(f"blk.{il}.attn_norm.weight", (hp.n_embd,), (k("embedding_length", hp.n_embd),))
        yield from (_mamba2 if v2 else _mamba)(f, hp, il, k, s)


_Layers = Callable[[GGUFFile, HParams, _Keys, list[int]], Iterator[Want]]
_ARCH: dict[str, tuple[_Layers, str, bool]] = {  # layers, final norm, whether output.weight is required
    "llama": (lambda f, hp, k, ff: _llama_like(f, hp, k, ff, gemma=False), "output_norm", False),
    "gemma3": (lambda f, hp, k, ff: _llama_like(f, hp, k, ff, gemma=True), "output_norm", False),
    "granitehybrid": (lambda f, hp, k, ff: _hybrid(f, hp, k, ff, lfm2=False), "output_norm", False),
    "lfm2": (lambda f, hp, k, ff: _hybrid(f, hp, k, ff, lfm2=True), "token_embd_norm", False),
    "mamba": (lambda f, hp, k, ff: _recurrent(f, hp, k, v2=False), "output_norm", False),
    "mamba2": (lambda f, hp, k, ff: _recurrent(f, hp, k, v2=True), "output_norm", False),
    "rwkv6": (lambda f, hp, k, ff: _rwkv(f, hp, k, ff, v7=False), "output_norm", True),
    "rwkv7": (lambda f, hp, k, ff: _rwkv(f, hp, k, ff, v7=True), "output_norm", True),
}


def _wants(f: GGUFFile, hp: HParams, n_vocab: int) -> Iterator[Want]:
    layers, final_norm, output_required = _ARCH[f.arch]
    k = _Keys(f)
    nv, e = f"n_vocab {n_vocab} (tokenizer.ggml.tokens)", k("embedding_length", hp.n_embd)
    yield Want("token_embd.weight", (n_vocab, hp.n_embd), (nv, e))
    yield Want("output.weight", (n_vocab, hp.n_embd), (nv, e), optional=not output_required)
    yield Want(final_norm + ".weight", (hp.n_embd,), (e,))
    if f.arch in ("rwkv6", "rwkv7"):
        yield Want("token_embd_norm.weight", (hp.n_embd,), (e,))
    n_ff = per_layer(f, f"{f.arch}.feed_forward_length", f.get(f"{f.arch}.feed_forward_length"), hp.n_layer)
    yield from layers(f, hp, k, n_ff)


def check_model(f: GGUFFile, hp: HParams, n_vocab: int) -> None:
    """Raises ModelLoadError unless every tensor the architecture reads is present, readable and
    shaped as the hyper-parameters say (`n_vocab`: the tokenizer's token count)."""
    _blocks(f, hp)
    _types(f)
    if f.has(f"{f.arch}.vocab_size") and hp.n_vocab != n_vocab:
        raise bad_key(f, f"{f.arch}.vocab_size", hp.n_vocab, f"but the tokenizer has {n_vocab} tokens")
    for w in _wants(f, hp, n_vocab):
        if not f.has_tensor(w.name):
            if w.optional:
                continue
            m = re.match(r"blk\.(\d+)\.", w.name)
            why = f" ({f.arch}.block_count {hp.n_layer})" if m else ""
            raise ModelLoadError(f"{f.path.name}: missing tensor {w.name}{why}")
        got = f.tensor_shape(w.name)
        if w.numel is not None:
            n = 1
            for d in got:
                n *= d
            if n == w.numel:
                continue
            want = f"{w.numel} elements"
        elif w.shape is not None and _strip(got) == _strip(w.shape):
            continue
        else:
            want = str(w.shape)
        raise ModelLoadError(
            f"{f.path.name}: tensor {w.name} is {got}, but {', '.join(w.keys)} make it {want}"
        )
