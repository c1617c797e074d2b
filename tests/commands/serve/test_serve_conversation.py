"""A conversation through `kvtool serve` on every memory that cannot be cut back to any position
(sliding window, recurrent, both hybrids): continued, edited in its last turn, then regenerated.
Each request re-processes only what follows the slot's prefix or its nearest checkpoint (the
response's timings say which) and answers as a from-scratch run of the same prompt does (greedy).
The client keeps the token ids of each turn, as a llama-server client does with /completion."""

from __future__ import annotations

import pytest

from tests.commands.serve.conftest import MODEL, serving
from tests.commands.serve.test_serve_checkpoints import complete
from tests.commands.serve.test_serve_tiers import A as TURN1

MODELS = MODEL.parent
STEP = 64  # -cms
TAIL = 4  # the end-of-prompt checkpoint holds all but the prompt's last 4 tokens
# a last turn longer than the tiny Gemma 3's window cache (256 cells), so an edit in it goes
# back further than that cache can be cut back
TURN2 = [(i * 11) % 180 + 5 for i in range(300)]
EDITED = [*TURN2[:20], *[(i * 13) % 170 + 9 for i in range(280)]]


def checkpoints(*prompts: list[int]) -> list[int]:
    """Where the slot keeps checkpoints while it decodes `prompts` (each a continuation of the
    one before): every STEP tokens and TAIL before each prompt's end."""
    return sorted({n for p in prompts for n in (*range(STEP, len(p) - TAIL + 1, STEP), len(p) - TAIL)})


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-mamba2", "tiny-granitehybrid", "tiny-lfm2"])
def test_continue_edit_and_regenerate_resume_from_the_nearest_checkpoint(name: str) -> None:
    flags = ("-np", "2", "-c", "4096", "-ub", "8", "-cms", str(STEP))
    with serving(*flags, model=MODELS / f"{name}.gguf") as s:

        def turn(prompt: list[int]) -> tuple[list[int], tuple[int, str]]:
            """The conversation goes on in slot 0; slot 1 runs the prompt from scratch."""
            r = complete(s.url, prompt, id_slot=0)
            assert r["tokens"] == complete(s.url, prompt, id_slot=1, cache_prompt=False)["tokens"]
            return r["tokens"], (r["timings"]["cache_n"], r["timings"]["cache_source"])

        reply, reused = turn(TURN1)
        assert reused == (0, "")
        history = [*TURN1, *reply]
        continued = [*history, *TURN2]
        # the slot holds the first turn and the reply but its last token (sampled, never decoded)
        assert turn(continued)[1] == (len(history) - 1, "slot")
        edited = [*history, *EDITED]
        diverge = len(history) + 20
        nearest = max(n for n in checkpoints(TURN1, continued) if n <= diverge)
        assert diverge - nearest < STEP and turn(edited)[1] == (nearest, "checkpoint")
        # a regenerate decodes the prompt's last token again: a window cache cuts back to it,
        # the recurrent states go back to the end-of-prompt checkpoint
        want = (len(edited) - 1, "slot") if name == "tiny-gemma3" else (len(edited) - TAIL, "checkpoint")
        assert turn(edited)[1] == want
