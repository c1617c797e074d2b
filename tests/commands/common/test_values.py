"""llama-bench's value lists and ranges."""

from __future__ import annotations

import pytest

from kvtool.commands.common.values import parse_int_list


def test_parse_int_list_values_and_ranges() -> None:
    assert parse_int_list("512") == [512]
    assert parse_int_list("128,256") == [128, 256]
    assert parse_int_list("1-4") == [1, 2, 3, 4]
    assert parse_int_list("64-512*2") == [64, 128, 256, 512]
    assert parse_int_list("0-300+100,7") == [0, 100, 200, 300, 7]
    for bad in ("", "a", "1-4*1", "-3", "1,,2"):
        with pytest.raises(ValueError):
            parse_int_list(bad)
