"""What RWKV-6 and RWKV-7 share: the block skeleton with its two token shifts, layer norms, the
per-head group norm, and the recurrent memory they declare.

Each layer keeps, per sequence, a token-shift state (2, n_embd) (the last normed input of the
time mix and of the channel mix) and a WKV state (n_head, head_size, head_size), both in the
RSView that `mctx.layer_view(il)` gives (llama.cpp's build_rwkv_token_shift_load/store).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtool.backend.linear import Embedding, Linear
from kvtool.batch import UBatch
from kvtool.memory.base import MemoryContext
from kvtool.memory.recurrent import RecurrentSpec, RSLayerSpec
from kvtool.memory.views import rs_view
from kvtool.models.hparams import RWKVHParams
from kvtool.models.tensors import ModelTensors

GROUP_NORM_EPS = 64e-5  # llama.cpp's eps for the per-head norm of the WKV output


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """ggml_norm (mean and biased variance over the last dim) then * w + b (llama.cpp's LLM_NORM)."""
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def head_group_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, head_size: int) -> torch.Tensor:
    """x [..., n_embd] normed per head of `head_size` channels, then * w + b over n_embd."""
    shape = x.shape
    xh = x.reshape(*shape[:-1], shape[-1] // head_size, head_size)
    return F.layer_norm(xh, (head_size,), eps=GROUP_NORM_EPS).reshape(shape) * w + b


def token_shift(x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """The previous token's row for every row of x [n_seqs, n_seq_tokens, n_embd]: the saved row
    `prev` [n_seqs, n_embd] for the first token of each sequence."""
    return torch.cat([prev[:, None, :].to(x.dtype), x[:, :-1]], dim=1)


@dataclass
class RWKVCommon:
    """The weights outside the blocks and the norms every block has."""

    tok_embd: Embedding  # [n_vocab, n_embd]
    tok_norm: torch.Tensor  # [n_embd] (+ bias): RWKV's ln0 right after the embedding
    tok_norm_b: torch.Tensor
    output_norm: torch.Tensor
    output_norm_b: torch.Tensor
    output: Linear  # [n_vocab, n_embd]
    attn_norm: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (weight, bias), before the time mix
    attn_norm_2: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, before the channel mix

    @classmethod
    def load(cls, t: ModelTensors) -> RWKVCommon:
        E = t.n_embd

        def norm(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return t.tensor(f"{name}.weight", (E,)), t.tensor(f"{name}.bias", (E,))

        tok_embd = t.embedding()
        return cls(
            tok_embd=tok_embd,
            tok_norm=t.tensor("token_embd_norm.weight", (E,)),
            tok_norm_b=t.tensor("token_embd_norm.bias", (E,)),
            output_norm=t.tensor("output_norm.weight", (E,)),
            output_norm_b=t.tensor("output_norm.bias", (E,)),
            output=t.output(tok_embd, required=True),
            attn_norm=[norm(f"blk.{il}.attn_norm") for il in range(t.hp.n_layer)],
            attn_norm_2=[norm(f"blk.{il}.attn_norm_2") for il in range(t.hp.n_layer)],
        )


@dataclass
class Carry:
    """What one layer hands to the next within a forward pass (RWKV-7's first-layer value)."""

    v_first: torch.Tensor | None = None


class RWKVModel(abc.ABC):
    """The RWKV block stack; subclasses give the time mix and the channel mix."""

    def __init__(self, t: ModelTensors) -> None:
        self.hp, self.ops = t.hp, t.backend
        self.rwkv = RWKVHParams.from_gguf(t.f, t.hp.n_embd)
        self.common = RWKVCommon.load(t)
        self.rescale_every_n_layers = 0  # RWKV-6 sets it from the file; RWKV-7 has none

    @abc.abstractmethod
    def time_mix(
        self, il: int, x: torch.Tensor, x_prev: torch.Tensor, state: torch.Tensor, carry: Carry, n_states: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, x_prev [n_seqs, n_seq_tokens, n_embd]; state [n_seqs, n_head, N, N] -> (output like
        x, the WKV states after each of the last `n_states` tokens [n_seqs, n_states, n_head, N, N])."""

    @abc.abstractmethod
    def channel_mix(self, il: int, x: torch.Tensor, x_prev: torch.Tensor) -> torch.Tensor:
        """x, x_prev [n, n_embd] -> [n, n_embd]."""

    def memory_spec(self) -> RecurrentSpec:
        n_embd, n_head, hs = self.hp.n_embd, self.rwkv.n_head, self.rwkv.head_size
        layer = RSLayerSpec(conv_shape=(2, n_embd), ssm_shape=(n_head, hs, hs))
        return RecurrentSpec(layers={il: layer for il in range(self.hp.n_layer)})

    def forward(self, ub: UBatch, mctx: MemoryContext) -> torch.Tensor:
        """Logits [n_outputs, n_vocab] for the ubatch rows flagged as outputs, in row order.

        The ubatch holds n_seqs blocks of n_seq_tokens rows, one block per sequence."""
        c, eps = self.common, self.rwkv.norm_eps
        n, n_seqs, n_st = ub.n_tokens, ub.n_seqs, ub.n_seq_tokens
        assert n == n_seqs * n_st, (n, n_seqs, n_st)
        x = layer_norm(c.tok_embd(torch.from_numpy(ub.token)), c.tok_norm, c.tok_norm_b, eps)  # [n, n_embd]
        carry = Carry()
        for il in range(self.hp.n_layer):
            view = rs_view(mctx, il)
            ns = view.n_states  # > 1: the memory keeps rollback snapshots of the trailing tokens
            x3 = x.view(n_seqs, n_st, -1)
            att = layer_norm(x3, *c.attn_norm[il], eps)
            tm, wkv_states = self.time_mix(il, att, token_shift(att, view.conv[:, 0]), view.ssm, carry, ns)
            ffn_inp = x3 + tm
            ffn = layer_norm(ffn_inp, *c.attn_norm_2[il], eps)
            ffn_prev = token_shift(ffn, view.conv[:, 1])
            shifts = torch.stack([att[:, -ns:], ffn[:, -ns:]], dim=2)  # [n_seqs, ns, 2, n_embd]
            if ns == 1:
                view.store(shifts[:, 0], wkv_states[:, 0])
            else:
                view.store(shifts, wkv_states)
            ffn_inp, ffn, ffn_prev = (t.reshape(n, -1) for t in (ffn_inp, ffn, ffn_prev))
            if il == self.hp.n_layer - 1:  # only output rows need the rest
                rows = torch.from_numpy(ub.output).to(x.device)
                ffn_inp, ffn, ffn_prev = ffn_inp[rows], ffn[rows], ffn_prev[rows]
            x = ffn_inp + self.channel_mix(il, ffn, ffn_prev)
            every = self.rescale_every_n_layers
            if every and (il + 1) % every == 0:
                x = x * 0.5
        return c.output(layer_norm(x, c.output_norm, c.output_norm_b, eps))
