"""Tokenizer: a thin wrapper over the `tokenizers` library with Qwen2.5's chat format.

Loading reads `tokenizer.json` from a checkpoint directory, and from `tokenizer_config.json` the EOS, pad
and BOS tokens and the `chat_template` (`chat_template.jinja` takes precedence, as in transformers).
Prompts in DAPO's data are chat lists ({role, content}). With a chat template they are rendered by it,
as transformers' `apply_chat_template` renders it (model/chat_template.py); without one, by Qwen2.5's
ChatML format, built in:

    <|im_start|>system\\n{system}<|im_end|>\\n
    <|im_start|>{role}\\n{content}<|im_end|>\\n          for every other message, in order
    <|im_start|>assistant\\n                             when add_generation_prompt

Default system message: like Qwen2.5's own template, when the first message is not a system message the
built-in rendering inserts a system turn with `default_system` ("You are Qwen, created by Alibaba Cloud.
You are a helpful assistant."); `default_system=None` inserts nothing. A system message that is not first
is rendered in place, as Qwen2.5 does. Only text messages (no tools) are supported.

What transformers rebuilds. transformers 5 loads the tokenizer of a `model_type: qwen2` checkpoint as
`Qwen2Tokenizer`, which keeps only the vocabulary, merges and added tokens of tokenizer.json and puts its
own normalizer (NFC), pre-tokenizer (Qwen2's split regex, then byte-level) and decoder around them. A
tokenizer encodes the same in both libraries only if it has exactly that pipeline: `qwen2_pipeline`
builds it, `train_bpe_tokenizer` trains inside it, and `Tokenizer.transformers_mismatch` names what a
loaded tokenizer does differently.

`save` writes a directory that transformers' AutoTokenizer loads as the same tokenizer: a tokenizer that
was loaded from a directory copies that directory's files unchanged; a trained one writes tokenizer.json
and a tokenizer_config.json with its special and added tokens. Either way the chat template that renders
prompts is in it (for the built-in rendering: an equivalent jinja template).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as _HFTokenizer

from errors import CheckpointError
from model.chat_template import qwen25_template, render_template, template_from_config
from model.hf_adapter import read_json

QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHAT_ROLES = ("system", "user", "assistant")

# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer and Qwen2.5's tokenizer.json): contractions,
# letter runs with one leading non-letter, single digits, punctuation runs, newlines, other whitespace.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# What a Hugging Face tokenizer directory may hold; `save` copies those present (and the extra templates).
TOKENIZER_FILES = (
    "tokenizer.json",
    CONFIG_FILE,
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    TEMPLATE_FILE,
)
EXTRA_TEMPLATES_DIR = "additional_chat_templates"
# An added token's fields in tokenizer_config.json's added_tokens_decoder, as transformers writes them.
ADDED_TOKEN_FIELDS = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
# BPE model options Qwen2Tokenizer leaves unset.
UNSET_BPE_OPTIONS = tuple(
    "byte_fallback fuse_unk ignore_merges continuing_subword_prefix end_of_word_suffix dropout unk_token".split()
)


def qwen2_pipeline(tokenizer: _HFTokenizer) -> _HFTokenizer:
    """Give `tokenizer` (a BPE) the normalizer, pre-tokenizer and decoder that transformers' Qwen2Tokenizer
    builds: NFC, Split(QWEN2_SPLIT_REGEX, isolated) + ByteLevel(no prefix space, no regex), ByteLevel."""
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...} (`value`: its JSON value)."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _without_offsets(value: Any) -> Any:  # a JSON value, returned as such
    """A tokenizer.json part without its `trim_offsets` flags (they change offsets, never ids)."""
    if isinstance(value, dict):
        return {k: _without_offsets(v) for k, v in value.items() if k != "trim_offsets"}
    if isinstance(value, list):
        return [_without_offsets(v) for v in value]
    return value


class Tokenizer:
    """Text <-> token ids, EOS/pad/BOS ids, and chat formatting (a jinja chat template, or Qwen2.5's built in).

    source_dir: the directory the tokenizer was loaded from; `save` copies its files unchanged.
    """

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        eos_token: str = ENDOFTEXT,
        pad_token: str | None = None,
        default_system: str | None = QWEN25_DEFAULT_SYSTEM,
        *,
        bos_token: str | None = None,
        chat_template: str | None = None,
        source_dir: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self.default_system = default_system
        self.eos_token = eos_token
        self.pad_token = pad_token if pad_token is not None else eos_token
        self.bos_token = bos_token
        self.chat_template = chat_template
        self.source_dir = source_dir
        for label, token in (("eos", self.eos_token), ("pad", self.pad_token), ("bos", self.bos_token)):
            if token is not None and tokenizer.token_to_id(token) is None:
                raise ValueError(f"{label} token {token!r} is not in the tokenizer's vocabulary")

    # -- loading and saving -------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        """Load `tokenizer.json`, and `tokenizer_config.json` / `chat_template.jinja` if present."""
        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise FileNotFoundError(f"{tok_path} not found (a tokenizer directory needs tokenizer.json)")
        try:
            tokenizer = _HFTokenizer.from_file(tok_path)
        except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot parse
            raise CheckpointError(f"{tok_path} is not a readable tokenizer ({exc})") from None
        config_path = os.path.join(path, CONFIG_FILE)
        config = read_json(config_path) if os.path.isfile(config_path) else {}
        template_path = os.path.join(path, TEMPLATE_FILE)
        template: str | None
        if os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as f:
                template = f.read()
        else:
            template = template_from_config(config.get("chat_template"), config_path)
        return cls(
            tokenizer,
            eos_token=_token_content(config.get("eos_token")) or ENDOFTEXT,
            pad_token=_token_content(config.get("pad_token")),
            bos_token=_token_content(config.get("bos_token")),
            chat_template=template,
            source_dir=path,
        )

    def save(self, path: str) -> None:
        """Write a tokenizer directory that `transformers.AutoTokenizer` loads as this tokenizer.

        Loaded from a directory: its tokenizer files are copied unchanged, plus `chat_template.jinja` with
        the built-in rendering when the directory had no template. Otherwise: tokenizer.json and a
        tokenizer_config.json naming the special tokens, every added token and the chat template.
        """
        os.makedirs(path, exist_ok=True)
        if self.source_dir is not None and os.path.abspath(self.source_dir) != os.path.abspath(path):
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(self.source_dir, name)):
                    shutil.copyfile(os.path.join(self.source_dir, name), os.path.join(path, name))
            extra = os.path.join(self.source_dir, EXTRA_TEMPLATES_DIR)
            if os.path.isdir(extra):
                shutil.copytree(extra, os.path.join(path, EXTRA_TEMPLATES_DIR), dirs_exist_ok=True)
            if self.chat_template is None:
                with open(os.path.join(path, TEMPLATE_FILE), "w", encoding="utf-8") as f:
                    f.write(qwen25_template(self.default_system))
            return
        if self.source_dir is not None:
            return  # saving onto the directory it came from: nothing to change
        self._tok.save(os.path.join(path, "tokenizer.json"))
        added = {
            str(i): {key: getattr(t, key) for key in ADDED_TOKEN_FIELDS}
            for i, t in sorted(self._tok.get_added_tokens_decoder().items())
        }
        config = {
            # Where transformers honours the class (no model_type that overrides it), tokenizer.json is
            # used as it is; for a qwen2 checkpoint, the rebuilt Qwen2Tokenizer has the same pipeline.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": None,
            "add_bos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": False,
            "errors": "replace",
            "model_max_length": 131072,
            "chat_template": self.chat_template or qwen25_template(self.default_system),
        }
        with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)

    def transformers_mismatch(self) -> str | None:
        """What transformers' Qwen2Tokenizer would do differently with this tokenizer.json (None: nothing).

        Checked against `qwen2_pipeline`: the normalizer, the pre-tokenizer (offset trimming aside, which
        changes no id), the decoder's type, and the BPE model's options."""
        ours = _without_offsets(json.loads(self._tok.to_str()))
        want = _without_offsets(json.loads(qwen2_pipeline(_HFTokenizer(models.BPE())).to_str()))
        problems = [
            f"the {part} is {json.dumps(ours.get(part))} instead of {json.dumps(want[part])}"
            for part in ("normalizer", "pre_tokenizer")
            if ours.get(part) != want[part]
        ]
        decoder = (ours.get("decoder") or {}).get("type")
        if decoder != "ByteLevel":
            problems.append(f"the decoder is {decoder} instead of ByteLevel")
        model = ours.get("model", {})
        if model.get("type") != "BPE":
            problems.append(f"the model is {model.get('type')} instead of BPE")
        problems += [f"the BPE model sets {key} = {model[key]!r}" for key in UNSET_BPE_OPTIONS if model.get(key)]
        return "; ".join(problems) or None

    # -- ids ----------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._known_id(self.eos_token)

    @property
    def pad_id(self) -> int:
        return self._known_id(self.pad_token)

    def _known_id(self, token: str) -> int:
        """The id of a token `__init__` found in the vocabulary."""
        tid = self._tok.token_to_id(token)
        assert tid is not None, f"{token!r} is not in the tokenizer's vocabulary"
        return tid

    @property
    def bos_id(self) -> int:
        """The BOS id a model config names: the BOS token's, else <|endoftext|>'s (as Qwen2.5's configs do:
        it has no BOS token and adds none when encoding), else the EOS id."""
        for token in (self.bos_token, ENDOFTEXT):
            tid = None if token is None else self._tok.token_to_id(token)
            if tid is not None:
                return tid
        return self.eos_id

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
        """Prompt text for a list of {"role", "content"} messages: the chat template's rendering, or the
        built-in Qwen2.5 ChatML one (see the module docstring)."""
        if self.chat_template is None:
            return render_chat(messages, self.default_system, add_generation_prompt)
        _check_messages(messages)
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        return render_template(self.chat_template, messages, add_generation_prompt, special)

    def encode_chat(self, messages: Sequence[Mapping], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `apply_chat_template(messages, add_generation_prompt)`."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


def render_chat(
    messages: Sequence[Mapping], default_system: str | None = QWEN25_DEFAULT_SYSTEM, add_generation_prompt: bool = True
) -> str:
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


def _check_messages(messages: object) -> None:
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"message {i} has role {m['role']!r}; supported roles: {', '.join(CHAT_ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"message {i} content must be text, got {type(m['content']).__name__}")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, phrases: Sequence[str] = ()) -> Tokenizer:
    """Train a byte-level BPE on `texts` with at most `vocab_size` tokens (special tokens and phrases included).

    The pipeline is Qwen2's (`qwen2_pipeline`), so transformers rebuilds the tokenizer exactly: every digit
    is its own piece (numbers are spelled digit by digit, as in Qwen2.5), merges stay within words, and any
    text round-trips. The special tokens <|endoftext|>, <|im_start|>, <|im_end|> get ids 0, 1, 2; the first is EOS
    and pad.

    phrases: texts that become one token each (added tokens, not special: they decode as text), matched
    wherever they occur before the rest is split. A prompt template repeated verbatim in every example
    then costs a few tokens: the synthetic demo task's prompts shrink about three-fold, and so does the
    cost of every training step.
    """
    special_tokens, phrases = [ENDOFTEXT, IM_START, IM_END], list(phrases)
    minimum = len(pre_tokenizers.ByteLevel.alphabet()) + len(special_tokens) + len(phrases)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size {vocab_size} is below {minimum}: the 256 byte symbols plus "
            f"{len(special_tokens)} special tokens and {len(phrases)} phrases"
        )
    tokenizer = qwen2_pipeline(_HFTokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(phrases),
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, so nothing is ever unknown
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # Added after training: added tokens present during training would be renumbered by it.
    tokenizer.add_tokens([AddedToken(p, special=False, normalized=False) for p in phrases])
    return Tokenizer(tokenizer, eos_token=ENDOFTEXT)
