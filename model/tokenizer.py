"""Tokenizer: a thin wrapper over the `tokenizers` library with Qwen2.5's chat format.

Loading reads `tokenizer.json` (and `tokenizer_config.json` for the EOS/pad tokens when present)
from a checkpoint directory. Prompts in DAPO's data are chat lists ({role, content}); they are
rendered with Qwen2.5's ChatML template, implemented here in Python:

    <|im_start|>system\\n{system}<|im_end|>\\n
    <|im_start|>{role}\\n{content}<|im_end|>\\n          for every other message, in order
    <|im_start|>assistant\\n                             when add_generation_prompt

Default system message: like Qwen2.5's own template, when the first message is not a system
message a system turn with `default_system` ("You are Qwen, created by Alibaba Cloud. You are a
helpful assistant.") is inserted; pass `default_system=None` to insert nothing. A system message
that is not first is rendered in place, as Qwen2.5 does. A `chat_template` stored in
tokenizer_config.json is not executed (only text messages, no tools, are supported).

`train_bpe_tokenizer` trains a small byte-level BPE for the synthetic arithmetic task. Digits are
pre-split one per token (as Qwen2.5 does), so numbers are spelled digit by digit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

__all__ = ["Tokenizer", "train_bpe_tokenizer", "render_chat", "QWEN25_DEFAULT_SYSTEM", "CHAT_TEMPLATE_JINJA"]

QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHAT_ROLES = ("system", "user", "assistant")

# The same rendering as `Tokenizer.apply_chat_template`, as a jinja template for tokenizer_config.json,
# so `transformers.AutoTokenizer` formats prompts identically from a directory written by `save`.
_JINJA_HEAD = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set rest = messages[1:] -%}"
    "{%- else -%}"
)
_JINJA_TAIL = (
    "{%- set rest = messages -%}"
    "{%- endif -%}"
    "{%- for m in rest -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def _jinja_template(default_system: str | None) -> str:
    if default_system is None:
        return _JINJA_HEAD + _JINJA_TAIL
    insert = "{{ '<|im_start|>system\\n' + " + json.dumps(default_system) + " + '<|im_end|>\\n' }}"
    return _JINJA_HEAD + insert + _JINJA_TAIL


CHAT_TEMPLATE_JINJA = _jinja_template(QWEN25_DEFAULT_SYSTEM)


def _token_content(value) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


class Tokenizer:
    """Text <-> token ids, EOS/pad ids, and Qwen2.5 chat formatting."""

    def __init__(self, tokenizer: _HFTokenizer, eos_token: str = ENDOFTEXT, pad_token: str | None = None,
                 default_system: str | None = QWEN25_DEFAULT_SYSTEM):
        self._tok = tokenizer
        self.default_system = default_system
        self.eos_token = eos_token
        self.pad_token = pad_token if pad_token is not None else eos_token
        for label, token in (("eos", self.eos_token), ("pad", self.pad_token)):
            if tokenizer.token_to_id(token) is None:
                raise ValueError(f"{label} token {token!r} is not in the tokenizer's vocabulary")

    # -- loading and saving -------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str, default_system: str | None = QWEN25_DEFAULT_SYSTEM) -> "Tokenizer":
        """Load `tokenizer.json` (+ `tokenizer_config.json` if present) from a checkpoint directory."""
        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise FileNotFoundError(f"{tok_path} not found (a tokenizer directory needs tokenizer.json)")
        tokenizer = _HFTokenizer.from_file(tok_path)
        config = {}
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path) as f:
                config = json.load(f)
        eos = _token_content(config.get("eos_token")) or ENDOFTEXT
        pad = _token_content(config.get("pad_token"))
        return cls(tokenizer, eos_token=eos, pad_token=pad, default_system=default_system)

    def save(self, path: str) -> None:
        """Write tokenizer.json + tokenizer_config.json (loadable by `transformers.AutoTokenizer`)."""
        os.makedirs(path, exist_ok=True)
        self._tok.save(os.path.join(path, "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": None,
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 131072,
            "chat_template": _jinja_template(self.default_system),
        }
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)

    # -- ids ----------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._tok.token_to_id(self.eos_token)

    @property
    def pad_id(self) -> int:
        return self._tok.token_to_id(self.pad_token)

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end a chat response: EOS plus <|im_end|> and <|endoftext|> where they exist."""
        ids = [self.eos_id]
        for token in (IM_END, ENDOFTEXT):
            tid = self._tok.token_to_id(token)
            if tid is not None and tid not in ids:
                ids.append(tid)
        return ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) map to their ids.
        No BOS/EOS is added (Qwen2.5 uses none)."""
        if not isinstance(text, str):
            raise TypeError(f"encode needs a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat ---------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = True) -> str:
        """Qwen2.5 ChatML text for a list of {"role", "content"} messages (see the module docstring)."""
        return render_chat(messages, self.default_system, add_generation_prompt)

    def encode_chat(self, messages: Sequence[Mapping], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `apply_chat_template(messages, add_generation_prompt)`."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


def render_chat(messages: Sequence[Mapping], default_system: str | None = QWEN25_DEFAULT_SYSTEM,
                add_generation_prompt: bool = True) -> str:
    """Qwen2.5 ChatML rendering without a tokenizer (used to build a tokenizer's training text)."""
    _check_messages(messages)
    parts = []
    if messages and messages[0]["role"] == "system":
        parts.append(f"{IM_START}system\n{messages[0]['content']}{IM_END}\n")
        messages = messages[1:]
    elif default_system is not None:
        parts.append(f"{IM_START}system\n{default_system}{IM_END}\n")
    for m in messages:
        parts.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


def _check_messages(messages) -> None:
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"message {i} has role {m['role']!r}; supported roles: {', '.join(CHAT_ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"message {i} content must be text, got {type(m['content']).__name__}")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int,
                        special_tokens: Sequence[str] = (ENDOFTEXT, IM_START, IM_END),
                        default_system: str | None = QWEN25_DEFAULT_SYSTEM, split_words: bool = True) -> Tokenizer:
    """Train a byte-level BPE on `texts` with at most `vocab_size` tokens (special tokens included).

    Pre-tokenisation: every digit is its own piece (`Digits(individual_digits=True)`), then GPT-2
    style byte-level splitting, so any text round-trips and numbers are never merged across digits.
    The special tokens get the first ids (0, 1, 2, ...); the first one is EOS and pad.

    split_words=False lets merges cross word boundaries: text repeated verbatim in every example (a
    prompt template) then collapses into a few tokens. The synthetic demo task uses it: its prompts
    shrink about five-fold, and so does the cost of every training step.
    """
    special_tokens = list(special_tokens)
    if not special_tokens:
        raise ValueError("train_bpe_tokenizer needs at least one special token (the first is EOS)")
    minimum = len(pre_tokenizers.ByteLevel.alphabet()) + len(special_tokens)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size {vocab_size} is below {minimum}: the 256 byte symbols plus "
                         f"{len(special_tokens)} special tokens")
    tokenizer = _HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_words),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, so nothing is ever unknown
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tokenizer, eos_token=special_tokens[0], default_system=default_system)
