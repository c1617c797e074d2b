"""`--plot FILE.png`: per policy, cells in use against n_kv over time (the gap is attention
spent on holes), and the cell map (which sequence holds each cell, over time)."""

from __future__ import annotations

import io
from typing import cast

import numpy as np

from kvtool.commands.defrag_sim.simulator import SimResult

FREE = (1.0, 1.0, 1.0)
TAIL = (0.15, 0.15, 0.15)  # allocated page cells that hold no token


def _rgb(cell_map: np.ndarray) -> np.ndarray:
    """[cells, time, 3]: a colour per sequence (20, cycling), white when free, dark for page tails."""
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap

    tab20 = cast(ListedColormap, colormaps["tab20"])  # a fixed list of 20 colours
    pal = np.array(tab20.colors)[[0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 1, 3, 5, 7, 9, 11, 13, 15]]
    m = cell_map.T  # [cells, time]
    out = np.empty((*m.shape, 3))
    out[:] = FREE
    used = m >= 0
    out[used] = pal[m[used] % len(pal)]
    out[m == -2] = TAIL
    return out


def plot(results: list[SimResult], title: str) -> bytes:
    """The figure as PNG bytes (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(
        n, 2, figsize=(14, 2.3 * n + 0.8), squeeze=False, gridspec_kw={"width_ratios": [1.5, 1]}
    )
    for (ax, axm), r in zip(axes, results, strict=True):
        steps = np.arange(len(r.used))
        ax.fill_between(steps, 0, r.used, color="#4c72b0", alpha=0.55, lw=0, label="cells in use")
        ax.fill_between(steps, r.used, r.nkv, color="#dd5555", alpha=0.55, lw=0, label="holes (n_kv - used)")
        ax.plot(steps, r.nkv, color="#aa2222", lw=0.6, label="n_kv")
        ax.axhline(r.capacity, color="black", ls="--", lw=0.8, label="capacity")
        for t in r.compacted_at[:2000]:
            ax.axvline(t, ymin=0.97, ymax=1.0, color="green", lw=0.5)
        st = r.stats
        ax.set_title(
            f"{r.policy.name}: holes {r.holes_pct:.1f}% of n_kv, failed allocs {st.failed_allocs}, "
            f"dropped {st.dropped}, compactions {st.compactions} ({st.cells_moved} cells moved)",
            fontsize=9,
            loc="left",
        )
        ax.set_xlim(0, max(len(steps) - 1, 1))
        ax.set_ylim(0, r.capacity * 1.05)
        ax.set_ylabel("cells")
        ax.tick_params(labelsize=8)
        axm.imshow(
            _rgb(r.cell_map),
            aspect="auto",
            origin="lower",
            interpolation="antialiased",
            extent=(float(r.map_steps[0]), float(r.map_steps[-1]) + 1, 0, r.cell_map.shape[1]),
        )
        axm.set_title("cell map (colour: sequence, white: free, black: page tail)", fontsize=9, loc="left")
        axm.set_ylabel("cell")
        axm.tick_params(labelsize=8)
    axes[0][0].legend(fontsize=7, loc="upper right", ncol=2)
    axes[-1][0].set_xlabel("decode step (green ticks: compactions)")
    axes[-1][1].set_xlabel("decode step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    plt.close(fig)
    return png.getvalue()
