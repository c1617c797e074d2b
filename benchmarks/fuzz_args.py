"""The command line the fuzz scripts share: how many minutes to run, and the seed of the cases."""

from __future__ import annotations

import argparse


def fuzz_parser(doc: str, seed: int) -> argparse.ArgumentParser:
    """A parser described by the first line of `doc` (the script's docstring), with --minutes
    (10) and --seed (`seed`); the script adds its own options."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=seed)
    return ap
