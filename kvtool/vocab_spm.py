"""llama.cpp's SPM tokenizer (`tokenizer.ggml.model = llama`): score-driven bigram merging.

Start from single characters and repeatedly merge the adjacent pair whose concatenation is a
token with the highest score (the leftmost pair on ties); leftover characters that are not
tokens fall back to `<0xXX>` byte tokens. This is not a unigram (Viterbi) search, and it
cannot be expressed as `tokenizers` BPE merges either: BPE ranks are fixed per pair, while
here equal scores are broken by position, so it is written out here.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class SpmMerger:
    """Tokenizes one whitespace-escaped text fragment the way llama.cpp's SPM session does."""

    def __init__(
        self,
        token_to_id: dict[str, int],
        scores: Sequence[float],
        byte_ids: Sequence[int | None],
        unk: int | None,
    ) -> None:
        self._ids = token_to_id
        self._scores = scores
        self._byte_ids = byte_ids  # token of each byte value: `<0xXX>`, else the 1-char token
        self._unk = unk

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (spaces already replaced by U+2581)."""
        n = len(text)
        if n == 0:
            return []
        ids, scores = self._ids, self._scores
        # symbol i starts at character i and spans size[i] characters (0 once merged into its left)
        size = [1] * n
        prev = list(range(-1, n - 1))
        nxt = [*range(1, n), -1]

        def pair(left: int, right: int) -> tuple[float, int, int, int] | None:
            length = size[left] + size[right]
            token = ids.get(text[left : left + length])
            return None if token is None else (-scores[token], left, right, length)

        heap = [p for i in range(1, n) if (p := pair(i - 1, i)) is not None]
        heapq.heapify(heap)
        while heap:
            _, left, right, length = heapq.heappop(heap)
            # stale: one side was merged away or grew since this pair was queued
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
                continue
            size[left] = length
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            for a, b in ((prev[left], left), (left, nxt[left])):
                if a >= 0 and b >= 0 and (p := pair(a, b)) is not None:
                    heapq.heappush(heap, p)
        out: list[int] = []
        i = 0
        while i >= 0:
            piece = text[i : i + size[i]]
            token = ids.get(piece)
            if token is not None:
                out.append(token)
            else:
                out.extend(self._bytes(piece))
            i = nxt[i]
        return out

    def _bytes(self, piece: str) -> list[int]:
        out = []
        for b in piece.encode("utf-8"):
            token = self._byte_ids[b]
            # llama.cpp aborts when a byte has no token; the unknown token is the useful answer
            if token is None:
                token = self._unk
            if token is not None:
                out.append(token)
        return out
