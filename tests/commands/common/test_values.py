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


def test_a_list_is_refused_before_it_is_built() -> None:
    """A range that lists nothing, too many values or values past a C int is refused: the
    count is known before any value is built (`-p 1-1000000000` took minutes and gigabytes)."""
    for bad, why in [
        ("512-128", "lists nothing"),
        ("1-1000000000", "more than 1024"),
        ("1-1000000000000000000", "at most 2147483647"),
        ("2147483648", "at most 2147483647"),
        ("1-600,1-600", "more than 1024"),
        ("0-8*2", "does not advance"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_int_list(bad)
    assert len(parse_int_list("1-1024")) == 1024
    assert parse_int_list("1-2147483647*2")[-1] == 2**30
