"""Names light to import: `kvtool --help` lists the policies and `parallel --trace` checks its
file's kind without loading numpy."""

from kvtool.common import files

POLICIES = ("non-contiguous", "contiguous", "threshold", "on-fail", "paged")

# what `parallel --trace` may replace: a trace it wrote before (or an empty file)
TRACE_KIND = files.FileKind("a kvtool trace", rb'\{"kvtool_trace"', "the trace")
