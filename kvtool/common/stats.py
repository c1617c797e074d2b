"""What the scheduler counts over its life: llama-server's metrics (prompt and generation tokens
and seconds, decode calls, busy slots per decode), and the reuse side of the KV ledger: prompt
tokens reused and from where, and requests that re-processed a prefix some slot held, and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# why a request re-processed a prefix that some slot held
REPROCESS_REASONS = {
    "cache_prompt_off": "the request asked for no prompt cache",
    "slot_busy": "the slot holding the prefix was serving another request",
    "below_similarity": "the best slot's share of the prompt was under -sps, another slot was chosen",
    "id_slot": "the request named another slot",
    "cannot_truncate": "the memory cannot be cut back to the common prefix (sliding window, recurrent)",
    "checkpoint_too_far_back": "the nearest checkpoint was before the end of the common prefix",
    "evicted": "the slot's cells were taken back (a full unified cache, an error)",
}


@dataclass
class SchedulerStats:
    """Totals since the scheduler started; times in seconds."""

    n_requests: int = 0  # finished, whatever the outcome
    n_prompt_processed: int = 0  # prompt tokens decoded
    n_prompt_cached: int = 0  # prompt tokens reused
    t_prompt: float = 0.0
    n_predicted: int = 0
    t_predicted: float = 0.0
    n_decode: int = 0  # ctx.decode calls that succeeded
    n_tokens_decoded: int = 0  # tokens in them
    n_busy_slots: int = 0  # summed over decode steps
    n_steps: int = 0
    n_tokens_max: int = 0  # the longest sequence a slot held (prompt + answer)
    n_cache_miss: int = 0  # decodes that found no room and were retried with half the batch
    n_evicted: int = 0  # idle slots whose cells were taken back for a batch that found no room
    reused: Counter[str] = field(default_factory=Counter)  # prompt tokens reused, by where from
    reprocessed: Counter[str] = field(default_factory=Counter)  # requests, by reason
    reprocessed_tokens: Counter[str] = field(default_factory=Counter)  # tokens they could have reused
