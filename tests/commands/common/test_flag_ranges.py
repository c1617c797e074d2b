"""Every numeric flag of every verb is range-checked while the command line is parsed: a value
outside its range, NaN or infinite is one `error:` line naming the flag and exit 2, before any
model is loaded (issue 14, defect 8)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, get_args, get_origin, get_type_hints

import pytest
import typer
from typer.models import OptionInfo

from kvtool.commands import _register, app
from kvtool.commands.common.values import bounds
from tests.helpers.cli import kvtool_cli

CTX = {
    "-c": ["-1"],
    "-b": ["0", "-1"],
    "-ub": ["0"],
    "-t": ["0", "-1", "513", "100000"],
    "-tb": ["0", "513"],
    "-ngl": ["-1"],
}
SAMPLER = {
    "--temp": ["nan", "inf", "-inf"],
    "--top-k": ["-1"],
    "--top-p": ["-0.1", "1.5", "nan"],
    "--min-p": ["2", "-0.5"],
    "--repeat-penalty": ["0", "-1", "nan"],
    "--repeat-last-n": ["-2"],
    "--typical": ["nan"],
    "--presence-penalty": ["inf"],
    "--frequency-penalty": ["-inf"],
}
# verb (with the flags it requires) -> flag -> values out of range
TABLE: dict[tuple[str, ...], dict[str, list[str]]] = {
    ("run", "-p", "x"): {
        **CTX,
        **SAMPLER,
        "-n": ["-2"],
        "--keep": ["-2"],
        "-np": ["0", "-3", "65"],
        "--defrag-thold": ["1", "1.5", "nan", "inf"],
        "--rs-seq": ["-1"],
        "-ctxcp": ["-1"],
    },
    ("state", "save", "-o", "x.kvs", "-p", "x"): {**CTX, "--seq": ["-1", "64", "1000000000000"]},
    ("state", "load", "-i", "x.kvs"): {**CTX, "-n": ["-2"], "--seq": ["-1", "64"], "--temp": ["nan"]},
    ("parallel",): {
        **CTX,
        "-np": ["0", "64"],
        "-ns": ["-1", "2147483648"],
        "-n": ["-2"],
        "--junk": ["-1", "10001", "1000000000000"],
        "--temp": ["nan"],
        "--timeout": ["0", "-1", "nan"],
        "--defrag-thold": ["1"],
    },
    ("serve",): {
        **CTX,
        "--port": ["-1", "65536"],
        "-np": ["0", "64"],
        "-sps": ["-0.1", "1.5", "nan"],
        "-to": ["0", "-1", "nan"],
        "--max-queue": ["-1"],
        "--defrag-thold": ["1"],
        "-ctxcp": ["-1"],
        "-cms": ["-1"],
        "-cram": ["-2"],
        "--cache-disk": ["-2"],
    },
    ("bench",): {
        "-ngl": ["-1"],
        "-r": ["0"],
        "-b": ["0", "1,0"],
        "-ub": ["0"],
        "-t": ["0", "2,0", "513", "1,100000"],
        "-p": ["-1", "512-128", "1-1000000000", "99999999999"],
    },
    ("batched-bench",): {**CTX, "-npl": ["0", "65", "1,65"], "-npp": ["-1", "9-1"], "-ntg": ["-1"]},
    ("kv-types", "-p", "x"): {"-c": ["7"], "-b": ["0"], "-t": ["0"], "-tb": ["0"], "-ngl": ["-1"]},
    ("defrag-sim",): {
        "--clients": ["0", "65"],
        "--requests": ["0", "200001", "1000000000000"],
        "--rate": ["0", "nan"],
        "-c": ["0", "1048577", "1000000000000"],
        "-ub": ["0"],
        "--defrag-thold": ["-0.1", "1"],
        "--max-moves": ["0"],
        "--page-size": ["0"],
        "--copy-bw": ["0", "nan"],
    },
}
CASES = [(verb, flag, v) for verb, flags in TABLE.items() for flag, values in flags.items() for v in values]


@pytest.mark.parametrize(("verb", "flag", "value"), CASES)
def test_a_value_out_of_range_is_one_line_naming_the_flag(
    verb: tuple[str, ...],
    flag: str,
    value: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    # -m of a file that is no model: a check that came after loading would say so instead
    (tmp_path / "no.gguf").write_bytes(b"not a model")
    model = ["-m", str(tmp_path / "no.gguf")] if verb[0] not in ("defrag-sim",) else []
    r = kvtool_cli(
        monkeypatch,
        capsys,
        *verb,
        *model,
        f"{flag}={value}" if value[0] == "-" else flag,
        *([] if value[0] == "-" else [value]),
    )
    line = r.one_error_line()
    assert flag in line and "not a GGUF" not in line, line


def _numeric_options() -> list[tuple[str, str, object]]:
    """(verb, flag, callback) of every int or float option, read from the typer declarations."""
    _register()
    out: list[tuple[str, str, object]] = []

    def visit(group: typer.Typer, path: str) -> None:
        for cmd in group.registered_commands:
            assert cmd.callback is not None
            verb = f"{path} {cmd.name or cmd.callback.__name__}".strip()
            for hint in get_type_hints(cmd.callback, include_extras=True).values():
                if get_origin(hint) is not Annotated:
                    continue
                base, *meta = get_args(hint)
                info = next((m for m in meta if isinstance(m, OptionInfo)), None)
                if info is not None and (set(get_args(base)) or {base}) & {int, float}:
                    # in Annotated, typer reads a first positional "-x" as a spelling, not a default
                    first = [info.default] if str(info.default).startswith("-") else []
                    out.append((verb, str([*first, *info.param_decls][0]), info.callback))
        for g in group.registered_groups:
            assert g.typer_instance is not None
            visit(g.typer_instance, f"{path} {g.name}".strip())

    visit(app, "")
    return out


def test_every_numeric_flag_has_a_range_and_a_case() -> None:
    """A numeric flag added without a range check, or without a row above, fails here (seeds
    take any integer: llama.cpp reads them modulo 2**32, -1 is random)."""

    def path(verb: tuple[str, ...]) -> str:
        return " ".join(verb[: next((i for i, v in enumerate(verb) if v.startswith("-")), len(verb))])

    rows = {(path(verb), flag) for verb, flags in TABLE.items() for flag in flags}
    options = [(verb, flag, cb) for verb, flag, cb in _numeric_options() if flag not in ("-s", "--seed")]
    assert len(options) > 40
    assert [(verb, flag) for verb, flag, cb in options if cb is None] == []
    assert [(verb, flag) for verb, flag, _ in options if (verb, flag) not in rows] == []


def test_bounds_accept_their_edges() -> None:
    assert bounds(-1)(-1) == -1 and bounds(1)(None) is None
    assert bounds(0.0, 1.0)(0.0) == 0.0 and bounds(0.0, 1.0)(1.0) == 1.0
    assert bounds(hi=1.0, hi_open=True)(-5.0) == -5.0
    for check, bad in [(bounds(0.0, lo_open=True), 0.0), (bounds(), math.nan), (bounds(), -math.inf)]:
        with pytest.raises(typer.BadParameter):
            check(bad)
