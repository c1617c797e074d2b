"""A loaded model described as llama.cpp's tools describe it (llama_model_desc)."""

from __future__ import annotations

from collections import Counter

import kvtool


def model_desc(model: kvtool.Model) -> str:
    """llama_model_desc's shape: architecture, size, weight type ("llama 135M Q4_1")."""
    n = model.n_params()
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{round(n / 1e6)}M" if n >= 1e6 else f"{round(n / 1e3)}K"
    ftype = model.file.get("general.file_type", None)
    if ftype is None:  # no declared type: name the most common tensor type
        types = Counter(model.file.tensor_type(t) for t in model.file.tensor_names())
        return f"{model.arch} {size} {types.most_common(1)[0][0] if types else '?'}"
    try:
        import gguf  # here: numpy and gguf are slow to import and --help needs neither

        kind = gguf.LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_")
    except ValueError:
        kind = "?"
    return f"{model.arch} {size} {kind}"
