"""Chat templates: a checkpoint's jinja `chat_template`, rendered the way transformers renders it.

A Hugging Face tokenizer directory may carry the template that formats a conversation into the model's
prompt text (`chat_template.jinja`, or `chat_template` in tokenizer_config.json). transformers renders it
with jinja2's ImmutableSandboxedEnvironment (trim_blocks, lstrip_blocks, the loopcontrols extension), a
`tojson` filter that does not escape HTML, and the globals `raise_exception` and `strftime_now`; the
template sees `messages`, `add_generation_prompt`, `tools` and `documents` (None here) and the tokenizer's
special tokens by name (`bos_token`, `eos_token`, ...). The same settings here give the same text.

`qwen25_template(default_system)` is the project's built-in Qwen2.5 ChatML rendering written as such a
template (for text messages: no tools), so an exported tokenizer carries the rendering training used.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import jinja2


def _raise_exception(message: str) -> NoReturn:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,  # what a template passes: any JSON-serialisable value
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters (<, >, &, '), which chat templates must not do.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_template(
    template: str,
    messages: Sequence[Mapping],
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str | None] | None = None,
) -> str:
    """Render a jinja chat template for `messages` as transformers' `apply_chat_template(tokenize=False)` does.

    special_tokens: {"bos_token": ..., "eos_token": ...}; entries that are None are not passed (transformers
    passes only the special tokens a tokenizer has). Messages are passed as plain dicts without None values.
    """
    tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return _compile(template).render(
        messages=plain, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **tokens
    )


def template_from_config(value: Any, where: str) -> str | None:  # value: a JSON value
    """The default template from a tokenizer_config.json `chat_template` entry: a string, or a list of
    {"name", "template"} entries (older transformers' way of storing several) of which "default" is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(
        f"{where}: chat_template must be a string or a list of {{'name', 'template'}} entries with "
        f"a 'default' one, got {type(value).__name__}"
    )


# The built-in rendering (model/tokenizer.py's `render_chat`) as a template. Whitespace control ("{%-"/"-%}")
# and string literals only, so trim_blocks/lstrip_blocks do not touch the output.
_HEAD = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set rest = messages[1:] -%}"
    "{%- else -%}"
)
_TAIL = (
    "{%- set rest = messages -%}"
    "{%- endif -%}"
    "{%- for m in rest -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def qwen25_template(default_system: str | None) -> str:
    """The jinja text of the built-in Qwen2.5 ChatML rendering with `default_system` (None: no default)."""
    if default_system is None:
        return _HEAD + _TAIL
    # json.dumps escapes quotes, backslashes and control characters, which makes a valid jinja string
    # literal; ensure_ascii=False keeps characters outside the BMP whole (not as surrogate-pair escapes).
    insert = "{{ '<|im_start|>system\\n' + " + json.dumps(default_system, ensure_ascii=False) + " + '<|im_end|>\\n' }}"
    return _HEAD + insert + _TAIL
