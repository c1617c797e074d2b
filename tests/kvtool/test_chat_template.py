"""Chat templates against llama.cpp's outputs (tests/data/*/chat_template.json) and the sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtool.chat_template import NAMED_TEMPLATES, ChatTemplate, detect_template, select_chat_template
from kvtool.errors import TemplateError

DATA = Path(__file__).resolve().parents[1] / "data"
SMOLLM2 = json.loads((DATA / "smollm2" / "chat_template.json").read_text())["chat"]
GEMMA3 = json.loads((DATA / "gemma3-270m" / "chat_template.json").read_text())["chat"]
SMOLLM2_DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)


def _results(chat: dict, template: str) -> list[dict]:
    rows = [r for r in chat["results"] if r["template"] == template]
    assert rows, template
    return rows


@pytest.mark.parametrize("row", _results(SMOLLM2, "builtin"), ids=lambda r: r["name"])
def test_smollm2_builtin_matches_llama_cpp(row: dict) -> None:
    tmpl = ChatTemplate(SMOLLM2["builtin_template"])
    out = tmpl.apply(row["messages"], add_generation_prompt=row["add_ass"])
    if row["messages"][0]["role"] == "system":
        assert out == row["text"]
    else:
        # llama_chat_apply_template does not run Jinja: it sees <|im_start|> and writes plain
        # chatml. The template itself inserts SmolLM's default system turn when the chat has none,
        # which is what rendering the template (as transformers and llama.cpp --jinja do) gives.
        assert out == SMOLLM2_DEFAULT_SYSTEM + row["text"]


@pytest.mark.parametrize("row", _results(SMOLLM2, "builtin"), ids=lambda r: r["name"])
def test_smollm2_as_selected_matches_llama_cpp(row: dict) -> None:
    """The default selection (family detection, as llama_chat_apply_template) matches 4/4."""
    tmpl = select_chat_template(SMOLLM2["builtin_template"], "llama")
    assert tmpl.apply(row["messages"], add_generation_prompt=row["add_ass"]) == row["text"]


@pytest.mark.parametrize("row", _results(GEMMA3, "named:gemma"), ids=lambda r: r["name"])
def test_gemma_named_matches_llama_cpp(row: dict) -> None:
    out = ChatTemplate.named("gemma").apply(row["messages"], add_generation_prompt=row["add_ass"])
    assert out == row["text"]


@pytest.mark.parametrize(
    "row",
    _results(GEMMA3, "builtin(null->chatml fallback)") + _results(SMOLLM2, "builtin"),
    ids=lambda r: r["name"],
)
def test_chatml_named_matches_llama_cpp(row: dict) -> None:
    # llama.cpp renders both of these as chatml: gemma by fallback, SmolLM2 by template detection.
    out = ChatTemplate.named("chatml").apply(row["messages"], add_generation_prompt=row["add_ass"])
    assert out == row["text"]


# llama.cpp's tests/test-chat-template.cpp conversation and its expected (non-Jinja) outputs.
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Who are you"},
    {"role": "assistant", "content": "   I am an assistant   "},
    {"role": "user", "content": "Another question"},
]
EXPECTED = {
    "chatml": "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
    "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n"
    "<|im_start|>assistant\n   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother question<|im_end|>\n"
    "<|im_start|>assistant\n",
    "gemma": "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n"
    "<start_of_turn>model\nHi there<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n"
    "<start_of_turn>model\nI am an assistant<end_of_turn>\n"
    "<start_of_turn>user\nAnother question<end_of_turn>\n"
    "<start_of_turn>model\n",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nI am an assistant<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nAnother question<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "llama2": "[INST] You are a helpful assistant\nHello [/INST]Hi there</s>[INST] Who are you [/INST]"
    "   I am an assistant   </s>[INST] Another question [/INST]",
    "phi3": "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n"
    "<|assistant|>\nHi there<|end|>\n<|user|>\nWho are you<|end|>\n"
    "<|assistant|>\n   I am an assistant   <|end|>\n<|user|>\nAnother question<|end|>\n<|assistant|>\n",
    "phi4": "<|im_start|>system<|im_sep|>You are a helpful assistant<|im_end|>"
    "<|im_start|>user<|im_sep|>Hello<|im_end|><|im_start|>assistant<|im_sep|>Hi there<|im_end|>"
    "<|im_start|>user<|im_sep|>Who are you<|im_end|>"
    "<|im_start|>assistant<|im_sep|>   I am an assistant   <|im_end|>"
    "<|im_start|>user<|im_sep|>Another question<|im_end|><|im_start|>assistant<|im_sep|>",
    "granite": "<|start_of_role|>system<|end_of_role|>You are a helpful assistant<|end_of_text|>\n"
    "<|start_of_role|>user<|end_of_role|>Hello<|end_of_text|>\n"
    "<|start_of_role|>assistant<|end_of_role|>Hi there<|end_of_text|>\n"
    "<|start_of_role|>user<|end_of_role|>Who are you<|end_of_text|>\n"
    "<|start_of_role|>assistant<|end_of_role|>   I am an assistant   <|end_of_text|>\n"
    "<|start_of_role|>user<|end_of_role|>Another question<|end_of_text|>\n"
    "<|start_of_role|>assistant<|end_of_role|>",
}

# Templates of the families (from llama.cpp's tests/test-chat-template.cpp and the models' GGUFs)
# and the named format llama.cpp detects in each; None: kvtool renders the GGUF's own with Jinja.
DETECTED = [
    ("{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>'}}", "chatml"),
    ("{{'<|im_start|>' + m['role'] + '<|im_sep|>'}}", "phi4"),
    ("{{'<|' + m['role'] + '|>' + '\\n' + m['content'] + '<|end|>\\n' }}{{ '<|assistant|>\\n' }}", "phi3"),
    ("{{ '<|start_of_role|>user<|end_of_role|>' + m['content'] + '<|end_of_text|>' }}", "granite"),
    ("{{ '<|start_of_role|>' }}{# <tool_call> <tools> #}", None),  # Granite 4: tool calls
    ("{{ bos_token }}{{ '<|user|>\\n' + m['content'] + '\\n' }}{{ '<|assistant|>\\n' }}", None),  # OLMo 2
    ("{{ '[INST] ' + content + ' [/INST]' }}{{ '<|assistant|>' }}{{ '<|end|>' }}", None),  # Mistral first
]


@pytest.mark.parametrize(("source", "name"), DETECTED)
def test_families_are_detected_in_llama_cpps_order(source: str, name: str | None) -> None:
    assert detect_template(source) == name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_named_templates_match_llama_cpp_tests(name: str) -> None:
    assert ChatTemplate.named(name).apply(CONVERSATION) == EXPECTED[name]


def test_named_templates_cover_expected() -> None:
    assert set(NAMED_TEMPLATES) == set(EXPECTED)


def test_gemma_trims_c_whitespace_only_and_joins_systems() -> None:
    msgs = [
        {"role": "system", "content": " a\t"},
        {"role": "system", "content": "b\n"},
        {"role": "user", "content": "\u00a0q\v"},  # NBSP is not C isspace: llama.cpp keeps it
    ]
    out = ChatTemplate.named("gemma").apply(msgs, add_generation_prompt=False)
    assert out == "<start_of_turn>user\nab\n\n\u00a0q<end_of_turn>\n"


def test_add_generation_prompt_false_and_empty_chat() -> None:
    assert ChatTemplate.named("chatml").apply([], add_generation_prompt=False) == ""
    assert ChatTemplate.named("chatml").apply([]) == "<|im_start|>assistant\n"
    assert ChatTemplate.named("llama2").apply([]) == "[INST] "


def test_builtin_globals_and_filters() -> None:
    src = (
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}{{ eos_token }}"
        "{% if tools %}T{% endif %}"
        "{% for i in range(3) %}{% if i == 1 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    )
    out = ChatTemplate(src, bos_token="<s>", eos_token="</s>").apply([{"role": "user", "content": "é"}])
    assert out == '<s>{"role": "user", "content": "é"}</s>0'
    year = ChatTemplate("{{ strftime_now('%Y') }}").apply([])
    assert year.isdigit() and len(year) == 4


def test_trim_and_lstrip_blocks() -> None:
    src = "{% for m in messages %}\n  {% if true %}\n{{ m['content'] }}\n  {% endif %}\n{% endfor %}"
    assert ChatTemplate(src).apply([{"role": "user", "content": "x"}]) == "x\n"


def test_raise_exception_is_template_error() -> None:
    with pytest.raises(TemplateError, match="roles must alternate") as info:
        ChatTemplate("{{ raise_exception('roles must\\nalternate') }}").apply([])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "src",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ self._TemplateReference__context }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{{ messages[0].update(role='x') }}",
        "{{ 'a' * 10 ** 9 }}",
        "{{ 2 ** 100000000 }}",
        "{% set ns = namespace(s='ab') %}{% for i in range(80) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "{{ 1 / 0 }}",
        "{{ messages[5]['content'] }}",
    ],
)
def test_sandbox_payloads_raise(src: str) -> None:
    with pytest.raises(TemplateError) as info:
        ChatTemplate(src).apply([{"role": "user", "content": "x"}])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("src", ["{% for m in messages %}", "{{ }", "{% endif %}", "{{ a | nosuchfilter }}"])
def test_syntax_error_is_one_line_template_error(src: str) -> None:
    with pytest.raises(TemplateError) as info:
        ChatTemplate(src)
    assert "\n" not in str(info.value)


def test_unknown_named_template() -> None:
    with pytest.raises(TemplateError, match="unknown chat template 'zephyr'"):
        ChatTemplate.named("zephyr")


def test_select_chat_template() -> None:
    detected = select_chat_template(SMOLLM2["builtin_template"], "llama", "<|im_start|>", "<|im_end|>")
    assert detected.name.startswith("chatml") and detected.source == NAMED_TEMPLATES["chatml"]
    builtin = select_chat_template(SMOLLM2["builtin_template"], "llama", jinja=True)
    assert builtin.name == "builtin" and builtin.source == SMOLLM2["builtin_template"]
    unknown = select_chat_template("{{ messages[0]['content'] }}", "llama")
    assert unknown.name == "builtin"
    for arch in ("gemma", "gemma2", "gemma3"):
        assert select_chat_template(None, arch).name == "gemma"
        assert select_chat_template("", arch).name == "gemma"
    assert select_chat_template(None, "llama").name == "chatml"
    assert select_chat_template(None, "mamba").name == "chatml"
    assert select_chat_template(None, "gemma3").source == NAMED_TEMPLATES["gemma"]
