"""Recurrent state memory (llama.cpp's llama_memory_recurrent), for Mamba, Mamba-2, RWKV and the
recurrent layers of hybrids: the memory (memory.py) over its cells (cells.py) and state tensors
(states.py), a planned batch (context.py), its part of a state file (state_part.py), and the
types layers compute with (view.py)."""

from kvtool.memory.recurrent.memory import RecurrentMemory, RecurrentSpec
from kvtool.memory.recurrent.view import RSLayerSpec, RSView

__all__ = ["RSLayerSpec", "RSView", "RecurrentMemory", "RecurrentSpec"]
