"""The attention layers of a decoder that may interleave sliding-window layers (the Gemma family,
OLMo 3): which layers slide, the RoPE each kind rotates with, the memory they ask for, and a
ubatch's rotations per kind, as the compiled decoder call takes them (one view per kind)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtool.memory.kv_cache import KVLayerSpec
from kvtool.memory.kv_cells import SWAParams
from kvtool.memory.spec import KVSpec
from kvtool.models.hparams import HParams, SWAHParams
from kvtool.models.inputs import ForwardInputs
from kvtool.models.rope import RopeParams, Rotation, apply_rope


@dataclass
class KVLayers:
    hp: HParams
    swa: SWAHParams | None  # None: no layer slides
    rope_global: RopeParams
    rope_swa: RopeParams  # what sliding layers rotate with (rope_global where none slides)
    # the kinds of layer present, in the order of the compiled call's views (global, sliding)
    kinds: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.kinds = sorted({self.is_swa(il) for il in range(self.hp.n_layer)})

    def is_swa(self, il: int) -> bool:
        return self.swa is not None and il in self.swa.layers

    def rope(self, il: int) -> RopeParams:
        return self.rope_swa if self.is_swa(il) else self.rope_global

    def ropes(self) -> list[RopeParams]:
        """The distinct RoPEs, whose tables a ubatch's inputs reserve."""
        return [self.rope_global] + ([self.rope_swa] if self.rope_swa is not self.rope_global else [])

    def memory_spec(self) -> KVSpec:
        hp = self.hp
        kv = {il: KVLayerSpec(hp.n_head_kv[il], hp.head_dim_k, hp.head_dim_v) for il in range(hp.n_layer)}
        if self.swa is None or not self.swa.layers:
            return KVSpec(kv, shift=self.rope_shift)
        return KVSpec(kv, shift=self.rope_shift, swa_layers=self.swa.layers, swa=SWAParams(self.swa.n_swa))

    def rope_shift(self, il: int, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Re-rotate cached K rows [n, n_head_kv, hd] of layer il by position deltas [n]."""
        p = self.rope(il)
        return apply_rope(k, p.rotation(delta), p)

    def rotations(self, inp: ForwardInputs) -> dict[bool, Rotation]:
        """The ubatch's rotations by kind (sliding or not)."""
        rot = self.rope_global.rotation(inp.pos, inp.bounds)
        swa = self.rope_swa.rotation(inp.pos, inp.bounds) if self.rope_swa is not self.rope_global else rot
        return {False: rot, True: swa}

    def views(self) -> list[int]:
        """Per layer, the compiled call's view it attends with (its kind's)."""
        return [self.kinds.index(self.is_swa(il)) for il in range(self.hp.n_layer)]
