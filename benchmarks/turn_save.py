"""What keeping a chat turn costs: `kvtool run --session` saves the conversation after every
turn (its sequence state, written atomically: a temporary file, fsync, rename, fsync of the
folder, under the session's version check), as many tokens long as the conversation. Prints
one row per model and length, against a decode step of the same model for scale.

    .venv/bin/python -m benchmarks.turn_save [-m smollm2 -m gemma3-270m] [-n 512 -n 2048] [-r 5]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import kvtool
from benchmarks.state_identity import median_ms
from kvtool.common import files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", action="append", help="known name or GGUF path (repeat)")
    ap.add_argument("-n", "--tokens", action="append", type=int, help="conversation length (repeat)")
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument(
        "--dir", type=Path, default=None, help="where the session is written (default: a temp folder)"
    )
    args = ap.parse_args()
    print("| model | tokens | state MB | state bytes ms | turn save ms (write, fsync) | decode step ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.model or ["smollm2", "gemma3-270m"]:
        m = kvtool.load_model(name)
        for n in args.tokens or [512, 2048]:
            ctx = kvtool.Context(m, kvtool.ContextParams(n_ctx=n + 256, n_batch=512, n_ubatch=512))
            ids = (m.tokenize("The quick brown fox jumps over the lazy dog. " * (n // 8 + 1)))[:n]
            kvtool.decode_tokens(ctx, ids, 0, 0)
            ctx.state_seq_get_data(0, tokens=ids)  # the model's content hash, once
            data_ms = median_ms(lambda ctx=ctx, ids=ids: ctx.state_seq_get_data(0, tokens=ids), args.reps)
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                path = Path(tmp) / "chat.kvs"
                version = files.FileVersion(path)

                def save(ctx=ctx, ids=ids, path=path, version=version) -> int:  # type: ignore[no-untyped-def]
                    data = ctx.state_seq_get_data(0, tokens=ids)
                    return files.write_file(path, data, files.STATE_FILE, version=version)

                save_ms = median_ms(save, args.reps)
                size = path.stat().st_size
            step_ms = median_ms(
                lambda ctx=ctx, n=n, t=ids[0]: (
                    kvtool.decode_tokens(ctx, [t], 0, n),
                    ctx.memory.seq_rm(0, n, -1),
                ),
                args.reps,
            )
            print(f"| {name} | {n} | {size / 1e6:.1f} | {data_ms:.0f} | {save_ms:.0f} | {step_ms:.1f} |")


if __name__ == "__main__":
    main()
