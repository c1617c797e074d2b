"""A chat template from a GGUF cannot exhaust the machine (issue 14, defect 9): each render runs
under a time limit and bounds on the size of every value it builds and on memory growth;
exceeding one is a one-line TemplateError."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from kvtool.chat_template import ChatTemplate
from kvtool.errors import TemplateError
from kvtool.template_sandbox import Limits
from kvtool.template_sizes import format_size, percent_size, replace_size, text_size
from tests.helpers.cli import kvtool_cli
from tests.helpers.tiny_gguf import write_tiny_llama

SMALL = Limits(time_s=0.5, max_chars=1 << 20, max_growth_bytes=64 << 20)
MSGS = [{"role": "user", "content": "hi"}]

SIZE = [
    "{{ 'x' * 10**10 }}",
    "{{ ['x'] * 10**9 }}",
    "{{ 'x'|center(10**10) }}",
    "{{ 'x'.ljust(10**10) }}",
    "{{ 'x'.zfill(10**10) }}",
    "{{ ('\t' * 1000).expandtabs(10**8) }}",
    "{{ '%999999999d' % 1 }}",
    "{{ '%*d' % (10**9, 1) }}",
    "{{ '%.999999999f'|format(1.5) }}",
    "{{ '{:>999999999}'.format('x') }}",
    "{{ '{:>{w}}'.format('x', w=10**9) }}",
    "{{ ('x' * 1000)|replace('', 'y' * 10000) }}",
    "{{ ('x' * 1000).replace('x', 'y' * 10000) }}",
    "{{ 'a\nb\nc'|indent(10**9) }}",
    # string growth in a loop, with ~ and with +
    "{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    # one large value referenced many times, then made into text
    "{% set s = 'x' * 1000000 %}{% set l = [s, s, s, s] %}{{ l }}",
    "{% set s = 'x' * 1000000 %}{{ [s, s]|join }}",
    "{% set s = 'x' * 1000000 %}{{ [s, s]|tojson }}",
    "{% set s = 'x' * 1000000 %}{{ s ~ s }}",
    "{% set s = 'x' * 1000000 %}{{ ''.join([s, s]) }}",
    # built-ins whose size their arguments tell (issue 28, item 9)
    "{{ lipsum(n=2000000) }}",
    "{{ lipsum(5, False, 20, 10**9) }}",
    "{{ range(10)|slice(2000000000)|list }}",
    "{{ range(3)|batch(2000000000, 'x')|list }}",
    "{{ 'x'.encode() * 10**10 }}",
]
TIME = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{% set l = [1] * 1000 %}{% for a in l %}{% for b in l %}{% for c in l %}"
    "{% endfor %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% set x = messages|map(attribute='role')|list %}{% endfor %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    # built-ins that yield item by item, each item a hook (one call ran for a minute)
    "{{ range(10)|slice(1000000)|list|length }}",
    "{{ range(100000)|map('string')|map('center', 5)|map('trim')|list|length }}"
    "{{ range(100000)|map('string')|map('center', 5)|map('trim')|list|length }}" * 3,
]


def _render_error(src: str, limits: Limits = SMALL) -> str:
    with pytest.raises(TemplateError) as info:
        ChatTemplate(src, limits=limits).apply(MSGS)
    text = str(info.value)
    assert "\n" not in text and text.startswith("chat template 'builtin' "), text
    return text


@pytest.mark.parametrize("src", SIZE)
def test_a_value_too_large_is_refused(src: str) -> None:
    assert "larger than 1048576" in _render_error(src)


@pytest.mark.parametrize("src", TIME)
def test_a_render_past_its_time_limit_stops(src: str) -> None:
    assert "time limit (0.5 s)" in _render_error(src)


def test_a_sort_too_large_for_the_time_limit_is_refused_by_its_size() -> None:
    """A sort runs in one C call no hook can stop: more than 2**20 items are refused first."""
    src = "{% set x = range(100000)|list %}{{ (x * 20)|sort|length }}"
    limits = Limits(time_s=5.0, max_chars=1 << 24, max_growth_bytes=1 << 30)
    assert "sorts 2000000 items with 'sort'" in _render_error(src, limits)
    assert ChatTemplate("{{ range(1000)|list|sort|length }}", limits=SMALL).apply(MSGS) == "1000"


def test_recursion_and_huge_ranges_are_one_line() -> None:
    _render_error("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}")  # Python's recursion limit
    _render_error("{% for i in range(10**6) %}{% for j in range(10**6) %}{% endfor %}{% endfor %}")


def test_many_medium_values_are_bounded_by_memory() -> None:
    """No one value is too large, but together they would fill the memory."""
    src = (
        "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
        "{% set ns.l = ns.l + [('x' * 500000) ~ i] %}{% endfor %}"
    )
    limits = Limits(time_s=60.0, max_chars=1 << 20, max_growth_bytes=64 << 20)
    assert "more than 64 MiB of memory" in _render_error(src, limits)


def test_real_templates_render_as_before_under_the_limits() -> None:
    src = (
        "{%- set ns = namespace(out='') -%}{%- for m in messages -%}"
        "{%- set ns.out = ns.out ~ '<|' ~ m['role'] ~ '|>' ~ m['content'] | trim ~ '\n' -%}{%- endfor -%}"
        "{{ ns.out }}{{ messages | tojson }}{{ '%s|%5d' % ('a', 3) }}{{ '{:>4}'.format('b') }}"
        "{% for m in messages if m.role == 'user' %}{{ loop.index }}/{{ loop.length }}{% endfor %}"
    )
    msgs = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}]
    want = (
        "<|user|>hi\n<|assistant|>yo\n" + '[{"role": "user", "content": " hi "}, '
        '{"role": "assistant", "content": "yo"}]' + "a|    3" + "   b" + "1/1"
    )
    assert ChatTemplate(src, limits=SMALL).apply(msgs) == want


def test_size_estimates_are_upper_bounds() -> None:
    for fmt, args in [("%5d|%-3s|%.2f", (7, "ab", 1.234)), ("%*d", (6, 1)), ("%(a)8s", {"a": "x"})]:
        assert percent_size(fmt, args, 1 << 20) >= len(fmt % args)
    for fmt, a, kw in [("{:>9}{}", ("x", "yy"), {}), ("{a:{w}}", (), {"a": "q", "w": 7})]:
        assert format_size(fmt, a, kw, 1 << 20) >= len(fmt.format(*a, **kw))
    for s, old, new in [("abcab", "ab", "xyz"), ("abc", "", "--"), ("aaa", "a", "")]:
        assert replace_size(s, old, new) == len(s.replace(old, new))
    nested = ["ab", ("c", ["dd"]), {"k": "vv"}]
    assert text_size(nested, 1 << 20) >= len(str(nested)) - 20
    assert text_size(["x" * 100] * 10**6, 1000) > 1000  # past the limit after one step


def test_a_hostile_gguf_template_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = gguf.GGUFWriter.add_name

    def add_name_and_template(self: gguf.GGUFWriter, name: str) -> None:
        real(self, name)
        self.add_chat_template("{{ 'x'|center(10**11) }}")

    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFWriter, "add_name", add_name_and_template)
        model = write_tiny_llama(tmp_path / "hostile.gguf")
    r = kvtool_cli(
        monkeypatch, capsys, "run", "-m", str(model), "--jinja", "-p", "hi", "-n", "2", "-c", "512"
    )
    assert "builds a 'center' result larger than" in r.one_error_line()
