"""Shared fixtures. TRITON_INTERPRET must be set before any Triton kernel is defined."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
