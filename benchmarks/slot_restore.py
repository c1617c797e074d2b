"""Prints what a slot state (a RAM, disk or slot-file entry of `kvtool serve`) holds and where
the time of loading it into a slot goes: the sequence's own state, each checkpoint's bytes, and
the time of each step of kvtool.common.slot_state.restore beside loading the sequence's state
alone (what llama-server copies in).

    .venv/bin/python benchmarks/slot_restore.py [-m gemma3-270m] [-n 2000] [--cms 512] [-r 3]

One prompt of n tokens is decoded in one slot with checkpoints as serve keeps them (every --cms
tokens and 4 before the end); the slot's state is encoded as serve encodes it, then restored
into a second slot r times.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvtool
from kvtool.common import slot_state
from kvtool.common.checkpoints import CheckpointParams, SlotCheckpoints
from kvtool.common.slots import Slot


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="gemma3-270m")
    ap.add_argument("-n", "--n-tokens", type=int, default=2000)
    ap.add_argument("--cms", type=int, default=512, help="tokens between two checkpoints (serve's -cms)")
    ap.add_argument("-r", "--repeat", type=int, default=3)
    a = ap.parse_args()
    model = kvtool.load_model(a.model)
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=2 * (a.n_tokens + 256), n_seq_max=2))
    tokens = [(i * 7) % (model.n_vocab - 3) + 3 for i in range(a.n_tokens)]
    params = CheckpointParams(32, a.cms)
    slot = Slot(0, 0, checkpoints=SlotCheckpoints(params))
    slot.checkpoints.start(tokens)
    done = 0
    while (stop := slot.checkpoints.next_stop(done)) > 0:
        kvtool.decode_tokens(ctx, tokens[done:stop], 0, done)
        done = stop
        slot.checkpoints.add(ctx, 0, done)
    kvtool.decode_tokens(ctx, tokens[done:], 0, done)
    slot.held = list(tokens)
    entry = slot_state.encode(ctx, slot)
    own = ctx.state_seq_get_data(0)
    print(f"{model.name}: {a.n_tokens} tokens, -cms {a.cms}")
    print(f"| part | bytes |\n|---|---|\n| the sequence's state | {len(own):,} |")
    for c in slot.checkpoints.items:
        print(f"| checkpoint at {c.n_tokens} | {c.nbytes:,} |")
    print(f"| the entry (slot_state.encode) | {len(entry):,} |\n")
    print("| slot_state.restore | its steps | the sequence's state alone |\n|---|---|---|")
    other = Slot(1, 1, checkpoints=SlotCheckpoints(params))
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        info = kvtool.inspect_state(entry)
        t_inspect = ms(t0)
        t0 = time.perf_counter()
        slot_state.checkpoints_of(info, model.n_vocab)
        t_cps = ms(t0)
        t0 = time.perf_counter()
        ctx.state_seq_set_data(entry, 1)
        t_set = ms(t0)
        t0 = time.perf_counter()
        slot_state.restore(ctx, other, entry)
        t_restore = ms(t0)
        t0 = time.perf_counter()
        ctx.state_seq_set_data(own, 1)
        t_own = ms(t0)
        print(
            f"| {t_restore:.0f} ms | inspect_state {t_inspect:.0f}, checkpoints_of {t_cps:.0f}, "
            f"state_seq_set_data of the entry {t_set:.0f} | {t_own:.0f} ms |"
        )


if __name__ == "__main__":
    main()
