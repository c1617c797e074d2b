"""Chat templates: a GGUF's own Jinja template (untrusted, sandboxed) or a llama.cpp named format.

A GGUF's ``tokenizer.chat_template`` is rendered the way Hugging Face transformers renders it
(sandboxed Jinja, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``,
``tojson``). Models without one get one of llama.cpp's hard-coded formats (src/llama-chat.cpp),
written here as small Jinja templates so every template goes through the same renderer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any, NoReturn

import jinja2

from kvtool.errors import TemplateError
from kvtool.template_sandbox import BoundedSandbox, Limits, render

# A rendered prompt beyond this is an attack or a bug, not a conversation.
MAX_OUTPUT_CHARS = Limits().max_chars

# llama.cpp's trim() strips C isspace(), a narrower set than Python's str.strip().
_C_SPACE = r"{%- set ws = ' \t\n\v\f\r' -%}"

NAMED_TEMPLATES: dict[str, str] = {
    "chatml": r"""
{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""",
    # Gemma has no system role: system text is trimmed, concatenated and put at the top of the
    # next non-model turn; "assistant" is spelled "model".
    "gemma": _C_SPACE
    + r"""
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
{%- if message['role'] == 'system' -%}
{%- set ns.system = ns.system + message['content'] | trim(ws) -%}
{%- else -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{- '<start_of_turn>' + role + '\n' -}}
{%- if ns.system and role != 'model' -%}
{{- ns.system + '\n\n' -}}
{%- set ns.system = '' -%}
{%- endif -%}
{{- message['content'] | trim(ws) + '<end_of_turn>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
""",
    "llama3": _C_SPACE
    + r"""
{%- for message in messages -%}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' -}}
{{- message['content'] | trim(ws) + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
""",
    "phi3": r"""
{%- for message in messages -%}
{{- '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}
""",
    "phi4": r"""
{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '<|im_sep|>' + message['content'] + '<|im_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant<|im_sep|>' -}}{%- endif -%}
""",
    # IBM Granite 3.x (llama.cpp's granite 4 formats differ only for tool calls, which kvtool's
    # conversations do not hold: Granite 4 templates render with Jinja)
    "granite": r"""
{%- for message in messages -%}
{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' -}}
{%- if message['role'] == 'assistant_tool_call' -%}{{- '<|tool_call|>' -}}{%- endif -%}
{{- message['content'] + '<|end_of_text|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_of_role|>assistant<|end_of_role|>' -}}{%- endif -%}
""",
    # llama.cpp's plain "llama2": no <<SYS>> block (system text is a line of the first turn), no
    # BOS inside the history, and no generation prompt (the open [INST] turn is the prompt).
    "llama2": r"""
{{- '[INST] ' -}}
{%- set ns = namespace(inside=true) -%}
{%- for message in messages -%}
{%- if not ns.inside -%}{{- '[INST] ' -}}{%- set ns.inside = true -%}{%- endif -%}
{%- if message['role'] == 'system' -%}{{- message['content'] + '\n' -}}
{%- elif message['role'] == 'user' -%}{{- message['content'] + ' [/INST]' -}}
{%- else -%}{{- message['content'] + '</s>' -}}{%- set ns.inside = false -%}
{%- endif -%}
{%- endfor -%}
""",
}

# Architectures whose models need their own format when the GGUF carries no template. llama.cpp
# itself falls back to chatml for every model; Gemma models answer chatml prompts poorly, so
# kvtool uses llama.cpp's "gemma" format for them. Everything else falls back to chatml as
# llama.cpp does (llama included: a llama-architecture GGUF without a template is as likely a
# SmolLM-style chatml model as a Llama-2 chat model).
_ARCH_TEMPLATES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma"}


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError("chat template raised: " + " ".join(str(message).split()))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # transformers' variant: keeps non-ASCII text as is (jinja's own tojson escapes it for HTML).
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    lineno = getattr(exc, "lineno", None)
    return f"line {lineno}: {text}" if isinstance(exc, jinja2.TemplateSyntaxError) else text


class ChatTemplate:
    """A compiled chat template.

    ``name`` is ``"builtin"`` for a GGUF's own template, else the named format's name;
    ``source`` is the Jinja text. Compiling fails early: a syntax error raises TemplateError.
    Each render runs under ``limits`` (time, size of any value built, memory growth; see
    kvtool.template_sandbox): exceeding one raises TemplateError.
    """

    def __init__(
        self,
        source: str,
        name: str = "builtin",
        bos_token: str = "",
        eos_token: str = "",
        limits: Limits | None = None,
    ) -> None:
        self.name = name
        self.source = source
        self.limits = limits or Limits()
        self._bos_token = bos_token
        self._eos_token = eos_token
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        env.filters["tojson"] = _tojson
        env.guard_filters()
        try:
            self._template = env.from_string(source)
        except Exception as exc:  # untrusted text: any failure to compile is the template's fault
            raise TemplateError(f"chat template {name!r} does not compile: {_one_line(exc)}") from exc

    @classmethod
    def named(cls, name: str, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """One of llama.cpp's named formats (see ``NAMED_TEMPLATES``)."""
        if name not in NAMED_TEMPLATES:
            known = ", ".join(sorted(NAMED_TEMPLATES))
            raise TemplateError(f"unknown chat template {name!r} (known: {known})")
        return cls(NAMED_TEMPLATES[name], name=name, bos_token=bos_token, eos_token=eos_token)

    def apply(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (dicts with ``role`` and ``content``) into one prompt string.

        ``add_generation_prompt`` opens an assistant turn at the end (llama.cpp's ``add_ass``).
        """
        chunks: Iterator[str] = render(
            self._template,
            self.limits,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._bos_token,
            eos_token=self._eos_token,
        )
        out: list[str] = []
        size = 0
        try:
            for chunk in chunks:
                size += len(chunk)
                if size > MAX_OUTPUT_CHARS:
                    raise TemplateError(
                        f"chat template {self.name!r} output exceeds {MAX_OUTPUT_CHARS} chars"
                    )
                out.append(chunk)
        except TemplateError as exc:
            if str(exc).startswith("chat template "):
                raise
            raise TemplateError(f"chat template {self.name!r} {exc}") from None
        except Exception as exc:  # untrusted code: any failure while rendering is the template's fault
            raise TemplateError(f"chat template {self.name!r} failed: {_one_line(exc)}") from exc
        return "".join(out)


def detect_template(source: str) -> str | None:
    """The named format a GGUF template is an instance of, by llama.cpp's markers in its order
    (llm_chat_detect_template), or None when kvtool has no named format for it."""
    if "<|im_start|>" in source:
        if "<|im_sep|>" in source:
            return "phi4"
        return None if "<end_of_utterance>" in source else "chatml"
    if "[INST]" in source:  # llama.cpp's Mistral and Llama 2 formats: rendered with Jinja here
        return None
    if "<|assistant|>" in source and "<|end|>" in source:
        return "phi3"
    if "<start_of_turn>" in source:
        return "gemma"
    if "<|start_header_id|>" in source and "<|end_header_id|>" in source:
        return "llama3"
    if "<|start_of_role|>" in source and "<tool_call>" not in source and "<tools>" not in source:
        return "granite"
    return None


def select_chat_template(
    builtin: str | None, arch: str, bos_token: str = "", eos_token: str = "", jinja: bool = False
) -> ChatTemplate:
    """The template for a model, as llama.cpp's llama_chat_apply_template chooses it: a GGUF
    template of a known family is rendered with that family's named format (so SmolLM2's
    conversations render exactly as llama.cpp renders them), any other GGUF template is rendered
    with Jinja, and a GGUF without one gets its architecture's named format, else chatml.
    `jinja=True` always renders the GGUF's own template (llama.cpp's --jinja)."""
    if builtin:
        family = None if jinja else detect_template(builtin)
        if family is None:
            return ChatTemplate(builtin, name="builtin", bos_token=bos_token, eos_token=eos_token)
        t = ChatTemplate.named(family, bos_token=bos_token, eos_token=eos_token)
        t.name = f"{family} (detected from the GGUF template)"
        return t
    return ChatTemplate.named(_ARCH_TEMPLATES.get(arch, "chatml"), bos_token=bos_token, eos_token=eos_token)
