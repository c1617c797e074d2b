"""The policy names, light to import: `kvtool --help` lists them without loading numpy."""

POLICIES = ("non-contiguous", "contiguous", "threshold", "on-fail", "paged")
