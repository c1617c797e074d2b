"""The paged policy (vLLM's block manager): a sequence owns whole pages of `page_size` cells
taken from a free list, so there are no holes between sequences; the unused tail of each
sequence's last page is the waste (internal fragmentation). Attention reads whole pages, so
n_kv counts the pages' cells."""

from __future__ import annotations

from collections import deque

import numpy as np

from kvtool.commands.defrag_sim.held import INF, Held
from kvtool.commands.defrag_sim.policies import Policy
from kvtool.commands.defrag_sim.series import Stats, Track

N_SEQ_IDS = 64


class PagedStream:
    """One stream's pages; the same interface as CellStream."""

    def __init__(self, size: int, policy: Policy, stats: Stats, track: Track) -> None:
        self.ps = policy.page_size
        self.size = size
        self.free_pages: deque[int] = deque(range(size // self.ps))  # FIFO, as vLLM's free queue
        self.pages: dict[int, list[int]] = {}
        self.ntok = np.zeros(N_SEQ_IDS, dtype=np.int64)
        self.stats = stats
        self.track = track
        self.compacted_at: list[int] = []
        self._used = 0
        self._n_pages = 0
        self.held = Held()  # each sequence's positions (what a partial removal takes)

    def _report(self, t: int) -> None:
        self.track.set(t, self._used, self._n_pages * self.ps)

    def _take(self, seq: int, n: int) -> None:
        new = self._need(seq, n)
        pl = self.pages.setdefault(seq, [])
        for _ in range(new):
            pl.append(self.free_pages.popleft())
        self.ntok[seq] += n
        self._used += n
        self._n_pages += new

    def _need(self, seq: int, n: int) -> int:
        return -(-int(self.ntok[seq] + n) // self.ps) - len(self.pages.get(seq, ()))

    def owners(self) -> np.ndarray:
        """[size] the sequence of each cell, -1 on free pages, -2 on the unused tail of a page."""
        out = np.full(self.size, -1, dtype=np.int16)
        for seq, pl in self.pages.items():
            for i, page in enumerate(pl):
                fill = self.ps if i < len(pl) - 1 else int(self.ntok[seq]) - i * self.ps
                out[page * self.ps : page * self.ps + fill] = seq
                out[page * self.ps + fill : (page + 1) * self.ps] = -2
        return out

    def before_decode(self, t: int) -> None:
        return

    def place(self, t: int, parts: list[tuple[int, int, int]]) -> list[int]:
        """One ubatch of (seq, first pos, n_tokens); returns the sequences that found no pages."""
        dropped: list[int] = []
        if sum(self._need(s, n) for s, _, n in parts) <= len(self.free_pages):
            for s, p, n in parts:
                self._take(s, n)
                self.held.add(s, p, n)
        else:
            self.stats.failed_allocs += 1
            for s, p, n in parts:
                if self._need(s, n) <= len(self.free_pages):
                    self._take(s, n)
                    self.held.add(s, p, n)
                else:
                    dropped.append(s)
        self._report(t)
        return dropped

    def run(self, t: int, seqs: list[int], pos: np.ndarray, k: int) -> int:
        """The first steps of k (one token per sequence each) for which pages remain."""
        n = len(seqs)
        nt = self.ntok[seqs]
        j0 = (-nt) % self.ps  # the step at which each sequence first needs a new page
        cnt = np.where(j0 < k, (k - 1 - j0) // self.ps + 1, 0)
        ii = np.repeat(np.arange(n), cnt)
        jj = j0[ii] + self.ps * (np.arange(len(ii)) - np.repeat(np.cumsum(cnt) - cnt, cnt))
        order = np.lexsort((ii, jj))  # page requests in the order the steps make them
        ii, jj = ii[order], jj[order]
        j = k if len(ii) <= len(self.free_pages) else int(jj[len(self.free_pages)])
        if not j:
            return 0
        done = jj < j
        for i in ii[done].tolist():
            self.pages.setdefault(seqs[i], []).append(self.free_pages.popleft())
        self.ntok[seqs] += j
        for s in seqs:
            self.held.add(s, int(pos[s]), j)
        used = self._used + n * (np.arange(j) + 1)
        pages = self._n_pages + np.cumsum(np.bincount(jj[done], minlength=j))
        self._used, self._n_pages = int(used[-1]), int(pages[-1])
        self.track.steps(t, used, pages * self.ps)
        return j

    def free(self, t: int, seq: int, lo: int = 0, hi: int = INF) -> None:
        """seq_rm(seq, lo, hi): the sequence keeps the pages its remaining tokens need."""
        n = self.held.remove(seq, lo, hi)
        pl = self.pages.pop(seq, [])
        self._used -= n
        self.ntok[seq] -= n
        keep = -(-int(self.ntok[seq]) // self.ps)
        if keep:
            self.pages[seq] = pl[:keep]
        self.free_pages.extend(pl[keep:])
        self._n_pages -= len(pl) - keep
        self._report(t)
