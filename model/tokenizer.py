"""Tokenizer: a thin wrapper over a transformers tokenizer, with Qwen2.5's chat format built in.

`Tokenizer.from_dir` loads a checkpoint's tokenizer directory with transformers' `AutoTokenizer`, so loading
(tokenizer.json, the special tokens of tokenizer_config.json, the chat template from chat_template.jinja or
the config), encoding, decoding, chat rendering (`apply_chat_template(..., tokenize=False)`) and `save`
(`save_pretrained`) are transformers' own: the ids training sees are the ids `AutoTokenizer.from_pretrained`
gives for the exported policy. The wrapper adds Qwen2.5's conventions (EOS <|endoftext|> when the directory
names none, pad = EOS when it names no pad token, the stop ids, a BOS id for model configs), the check that
the EOS, pad and BOS tokens are in tokenizer.json's vocabulary, and the check of chat messages.

Prompts in DAPO's data are chat lists ({role, content}). A tokenizer without a chat template gets Qwen2.5's
ChatML format as its template (`qwen25_template`):

    <|im_start|>system\\n{system}<|im_end|>\\n
    <|im_start|>{role}\\n{content}<|im_end|>\\n          for every other message, in order
    <|im_start|>assistant\\n                             when add_generation_prompt

Default system message: like Qwen2.5's own template, when the first message is not a system message the
built-in template inserts a system turn with `default_system` ("You are Qwen, created by Alibaba Cloud.
You are a helpful assistant."); `default_system=None` inserts nothing. A system message that is not first
is rendered in place, as Qwen2.5 does. Only text messages (no tools) are supported. `render_chat` renders
the same text without a tokenizer (to build a tokenizer's training text).

What transformers rebuilds. transformers 5 loads the tokenizer of a `model_type: qwen2` checkpoint as
`Qwen2Tokenizer`, which keeps only the vocabulary, merges and added tokens of tokenizer.json and puts its
own normalizer (NFC), pre-tokenizer (Qwen2's split regex, then byte-level) and decoder around them; a
directory without config.json is loaded with tokenizer.json's pipeline as it is. `qwen2_pipeline` builds
exactly Qwen2Tokenizer's pipeline and `train_bpe_tokenizer` trains inside it, so a trained tokenizer encodes
the same either way: saved, loaded back and exported beside a Qwen2 config.json, it gives the same ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as _HFTokenizer

from errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHAT_ROLES = ("system", "user", "assistant")

# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer and Qwen2.5's tokenizer.json): contractions,
# letter runs with one leading non-letter, single digits, punctuation runs, newlines, other whitespace.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The built-in rendering (`render_chat`) as a jinja template. Whitespace control ("{%-"/"-%}") and string
# literals only, so transformers' trim_blocks/lstrip_blocks do not touch the output.
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


class Tokenizer:
    """Text <-> token ids, EOS/pad/BOS ids, and chat rendering, all done by the transformers tokenizer `hf`.

    Where `hf` has no chat template it gets the built-in Qwen2.5 one with `default_system`; where it names no
    EOS token, <|endoftext|>; where it names no pad token, its EOS token. `hf` is what a library that takes a
    transformers tokenizer (TRL, `generate`) is given: it encodes as this wrapper does.
    """

    def __init__(self, hf: PreTrainedTokenizerBase, default_system: str | None = QWEN25_DEFAULT_SYSTEM) -> None:
        self.hf = hf
        self._default_system = default_system
        if hf.chat_template is None:
            hf.chat_template = qwen25_template(default_system)
        if hf.eos_token is None:
            hf.eos_token = ENDOFTEXT
        if hf.pad_token is None:
            hf.pad_token = hf.eos_token

    # -- loading and saving -------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        """Load a tokenizer directory with `transformers.AutoTokenizer` (module docstring).

        Before transformers reads it, tokenizer.json is read by the tokenizers library to name a damaged file
        and the EOS/pad/BOS token that is not in its vocabulary (transformers would add such a token as a new
        id the model has no embedding for)."""
        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise FileNotFoundError(f"{tok_path} not found (a tokenizer directory needs tokenizer.json)")
        try:
            in_file = _HFTokenizer.from_file(tok_path)
        except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot parse
            raise CheckpointError(f"{tok_path} is not a readable tokenizer ({exc})") from None
        from transformers import AutoTokenizer

        try:
            tokenizer = cls(AutoTokenizer.from_pretrained(path))
            template = tokenizer.chat_template  # several stored templates and no default one: a ValueError
        except (OSError, TypeError, ValueError) as exc:  # e.g. a tokenizer_config.json that is not JSON
            raise CheckpointError(f"{path}: transformers cannot load this tokenizer ({exc})") from None
        hf = tokenizer.hf
        for label, token in (("eos", hf.eos_token), ("pad", hf.pad_token), ("bos", hf.bos_token)):
            if token is not None and in_file.token_to_id(token) is None:
                raise CheckpointError(
                    f"{path}: the {label} token {token!r} is not in the tokenizer's vocabulary: set {label}_token "
                    "in its tokenizer_config.json to a token of tokenizer.json"
                )
        if not isinstance(template, str):
            raise CheckpointError(
                f"{os.path.join(path, 'tokenizer_config.json')}: chat_template must be a string or a list of "
                f"{{'name', 'template'}} entries with a 'default' one, got {type(template).__name__}"
            )
        return tokenizer

    def save(self, path: str) -> None:
        """Write a tokenizer directory with transformers' `save_pretrained`: tokenizer.json, tokenizer_config.json
        with the special tokens, and chat_template.jinja with the template prompts are rendered with (the built-in
        one included), so `transformers.AutoTokenizer` loads it as this tokenizer."""
        self.hf.save_pretrained(path)

    # -- ids ----------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Every token, added tokens included."""
        return len(self.hf)

    @property
    def eos_id(self) -> int:
        return self._known_id(self.hf.eos_token)

    @property
    def pad_id(self) -> int:
        return self._known_id(self.hf.pad_token)

    def _known_id(self, token: str) -> int:
        """The id of a token `from_dir` (or `train_bpe_tokenizer`) found in the vocabulary."""
        tid = self.token_to_id(token)
        assert tid is not None, f"{token!r} is not in the tokenizer's vocabulary"
        return tid

    @property
    def bos_id(self) -> int:
        """The BOS id a model config names: the BOS token's, else <|endoftext|>'s (as Qwen2.5's configs do:
        it has no BOS token and adds none when encoding), else the EOS id."""
        for token in (self.hf.bos_token, ENDOFTEXT):
            tid = None if token is None else self.token_to_id(token)
            if tid is not None:
                return tid
        return self.eos_id

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end a chat response: EOS plus <|im_end|> and <|endoftext|> where they exist."""
        ids = [self.eos_id]
        for token in (IM_END, ENDOFTEXT):
            tid = self.token_to_id(token)
            if tid is not None and tid not in ids:
                ids.append(tid)
        return ids

    def token_to_id(self, token: str) -> int | None:
        """The token's id, None when it is not in the vocabulary (the backend's lookup: transformers' own maps
        an unknown token to the unknown token's id)."""
        return self.hf.backend_tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) map to their ids.
        No BOS/EOS is added (Qwen2.5 uses none)."""
        if not isinstance(text, str):
            raise TypeError(f"encode needs a str, got {type(text).__name__}")
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return cast(str, self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # -- chat ---------------------------------------------------------------------------------------

    @property
    def default_system(self) -> str | None:
        """The default system message of the built-in template (used only where the tokenizer had none)."""
        return self._default_system

    @property
    def chat_template(self) -> str:
        """The jinja template `apply_chat_template` renders with: the checkpoint's (its default one where it
        stores several), else the built-in Qwen2.5 one."""
        return self.hf.get_chat_template()

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = True) -> str:
        """Prompt text for a list of {"role", "content"} messages: transformers' rendering of `chat_template`."""
        _check_messages(messages)
        text = self.hf.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return cast(str, text)

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
    and pad. The result wraps transformers' `PreTrainedTokenizerFast` over the trained tokenizer, with the
    built-in Qwen2.5 chat template.

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
    from transformers import PreTrainedTokenizerFast

    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=ENDOFTEXT))
