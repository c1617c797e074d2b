"""`python -m kvtool.commands` runs the CLI (what the `kvtool` console script calls)."""

from kvtool.commands import console

console()
