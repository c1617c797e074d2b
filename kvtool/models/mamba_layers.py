"""Pieces shared by the Mamba architectures: the short causal convolution with its state, and
the skeleton of a recurrent model (embeddings, per-layer residual blocks, output head)."""

from __future__ import annotations

import abc

import torch

from kvtool.backend.linear import linear_normed
from kvtool.batch import UBatch
from kvtool.memory.base import MemoryContext
from kvtool.memory.recurrent import RSView
from kvtool.memory.views import rs_view
from kvtool.models.layers import rms_norm
from kvtool.models.tensors import ModelTensors


def ssm_conv(
    state: torch.Tensor,  # [n_seqs, d_conv - 1, C] the inputs before the ubatch, oldest first
    x: torch.Tensor,  # [n_seqs, T, C]
    w: torch.Tensor,  # [C, d_conv] (ggml's ssm_conv1d)
    b: torch.Tensor,  # [C]
    n_states: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution (ggml_ssm_conv + bias): y [n_seqs, T, C] and the conv
    states after each of the last `n_states` tokens [n_seqs, n_states, d_conv - 1, C]."""
    k = w.shape[1]
    T = x.shape[1]
    xp = torch.cat([state.to(x.dtype), x], dim=1)  # [S, d_conv - 1 + T, C]
    y = torch.einsum("stck,ck->stc", xp.unfold(1, k, 1), w) + b  # unfold: [S, T, C, d_conv]
    states = xp.unfold(1, k - 1, 1)[:, T + 1 - n_states :]  # [S, n_states, C, d_conv - 1]
    return y, states.transpose(2, 3)


def seq_blocks(x: torch.Tensor, ub: UBatch) -> torch.Tensor:
    """[n_tokens, n] -> [n_seqs, n_seq_tokens, n]: the ubatch's rows are grouped by sequence."""
    return x.view(ub.n_seqs, ub.n_seq_tokens, x.shape[-1])


def store(view: RSView, conv: torch.Tensor, ssm: torch.Tensor) -> None:
    """Hands the trailing states [n_seqs, n_states, ...] to the memory."""
    view.store(conv.contiguous(), ssm.contiguous())


class RecurrentLM(abc.ABC):
    """Token embeddings, `n_layer` pre-norm residual blocks (`block(il, h, ub, view)`), a final
    RMS norm and the output head (tied to the embeddings when `output.weight` is absent)."""

    def __init__(self, t: ModelTensors) -> None:
        self.n_layer = n_layer = t.hp.n_layer
        self.eps, self.ops = t.hp.eps, t.backend
        E = t.n_embd
        self.tok_embd = t.embedding()  # [n_vocab, n_embd]
        self.output_norm = t.tensor("output_norm.weight", (E,))
        self.output = t.output(self.tok_embd)  # tied embeddings if absent
        self.attn_norm = [t.tensor(f"blk.{il}.attn_norm.weight", (E,)) for il in range(n_layer)]

    @abc.abstractmethod
    def block(self, il: int, h: torch.Tensor, ub: UBatch, view: RSView) -> torch.Tensor:
        """Layer il's mixer on the normed rows h [n_tokens, n_embd]: what the residual adds."""

    def forward(self, ub: UBatch, mctx: MemoryContext) -> torch.Tensor:
        """Logits [n_outputs, n_vocab] for the ubatch rows flagged as outputs, in row order."""
        x = self.tok_embd(torch.from_numpy(ub.token))  # [n_tokens, n_embd]
        for il in range(self.n_layer):
            h = rms_norm(x, self.attn_norm[il], self.eps)
            x = x + self.block(il, h, ub, rs_view(mctx, il))
        x = x[torch.from_numpy(ub.output).to(x.device)]
        return linear_normed(self.output, x, self.output_norm, self.eps, rms_norm)
