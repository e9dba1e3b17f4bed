"""Tokenizer: round trips, Qwen2.5 chat formatting against transformers, digit-split BPE training."""

import json
import os
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from model.tokenizer import QWEN25_DEFAULT_SYSTEM, Tokenizer, train_bpe_tokenizer

# Qwen2.5's chat template restricted to plain text messages (no tools), written independently of
# model/tokenizer.py: the first system message becomes the header (or the default one is inserted),
# then every user/assistant message, and a system message that is not first, is rendered in place.
QWEN25_TEXT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is 17 + 25?"}],
    [{"role": "system", "content": "Reason step by step."}, {"role": "user", "content": "2 * 3 = ?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! 你好"},
     {"role": "user", "content": "Answer: 42\n\\boxed{42}"}],
    [{"role": "user", "content": "a"}, {"role": "system", "content": "late system"}, {"role": "user", "content": "b"}],
]


def _arithmetic_texts(n=400, seed=0):
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        a, b = rng.randint(0, 9999), rng.randint(0, 9999)
        texts.append(f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\nAnswer: {a + b}<|im_end|>")
    return texts


@pytest.fixture(scope="module")
def trained():
    return train_bpe_tokenizer(_arithmetic_texts(), vocab_size=320)


@pytest.fixture(scope="module")
def saved_dir(trained, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    trained.save(path)
    return path


def test_trained_bpe_splits_every_digit(trained):
    text = "What is 12345 + 678? Answer: 13023"
    ids = trained.encode(text)
    pieces = [trained.decode([i]) for i in ids]
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p)]
    assert "".join(digit_pieces) == "12345678" + "13023"
    assert all(len(p) == 1 for p in digit_pieces), digit_pieces
    # Training did learn merges for the frequent words, so the digit rule is what keeps numbers apart.
    assert any(len(p) > 1 for p in pieces)
    assert trained.vocab_size <= 320


def test_special_tokens_and_ids(trained):
    assert [trained.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert trained.eos_id == trained.pad_id == 0
    assert trained.stop_ids == [0, 2]
    assert trained.encode("x<|im_end|>y")[1] == 2  # a special token written in text is one id


@pytest.mark.parametrize("text", ["What is 1 + 1?", "  leading spaces\n\ttabs", "unicode: héllo ∑ 你好 🙂",
                                  "<|im_start|>user\n3+4<|im_end|>\n", ""])
def test_round_trip(trained, text):
    assert trained.decode(trained.encode(text)) == text


def test_saved_tokenizer_loads_in_both_libraries(trained, saved_dir):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_dir(saved_dir)
    hf = AutoTokenizer.from_pretrained(saved_dir)
    text = "What is 305 + 17? <|im_end|> ok"
    assert ours.encode(text) == trained.encode(text) == hf.encode(text)
    assert hf.decode(hf.encode(text)) == ours.decode(ours.encode(text)) == text
    assert (hf.eos_token_id, hf.pad_token_id) == (ours.eos_id, ours.pad_id)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(trained, saved_dir, messages, add_generation_prompt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(saved_dir)
    want = hf.apply_chat_template(messages, chat_template=QWEN25_TEXT_TEMPLATE, tokenize=False,
                                  add_generation_prompt=add_generation_prompt)
    assert trained.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == want
    # The template written by save() renders the same text inside transformers.
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt) == want
    want_ids = hf.apply_chat_template(messages, chat_template=QWEN25_TEXT_TEMPLATE, tokenize=True,
                                      add_generation_prompt=add_generation_prompt, return_dict=False)
    assert trained.encode_chat(messages, add_generation_prompt=add_generation_prompt) == list(want_ids)


def test_chat_template_literal_and_default_system():
    tok = train_bpe_tokenizer(["abc"], vocab_size=300)
    text = tok.apply_chat_template([{"role": "user", "content": "Q"}])
    assert text == (f"<|im_start|>system\n{QWEN25_DEFAULT_SYSTEM}<|im_end|>\n"
                    "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n")
    tok.default_system = None
    assert tok.apply_chat_template([{"role": "user", "content": "Q"}], add_generation_prompt=False) == \
        "<|im_start|>user\nQ<|im_end|>\n"


def test_from_dir_reads_tokenizer_config(tmp_path):
    # A Qwen-style directory: special tokens stored as {"content": ...} objects, EOS <|im_end|>.
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>"}, "pad_token": "<|endoftext|>"}))
    loaded = Tokenizer.from_dir(str(tmp_path))
    assert (loaded.eos_id, loaded.pad_id) == (2, 0)
    os.remove(tmp_path / "tokenizer_config.json")
    assert Tokenizer.from_dir(str(tmp_path)).eos_id == 0  # no config: <|endoftext|>


def test_errors_name_the_problem(tmp_path, trained):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(str(tmp_path))
    with pytest.raises(ValueError, match="message 1 has role 'tool'"):
        trained.apply_chat_template([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    with pytest.raises(ValueError, match="message 0 must be a dict with 'role' and 'content'"):
        trained.apply_chat_template([{"content": "a"}])
    with pytest.raises(TypeError, match="messages must be a list"):
        trained.apply_chat_template("hello")
    with pytest.raises(ValueError, match="vocab_size 100 is below 259"):
        train_bpe_tokenizer(["a"], vocab_size=100)
    with pytest.raises(ValueError, match="eos token '<nope>' is not in the tokenizer's vocabulary"):
        Tokenizer(trained._tok, eos_token="<nope>")


def test_unsplit_bpe_collapses_a_repeated_template_and_still_round_trips():
    from model.tokenizer import render_chat, train_bpe_tokenizer
    from rl.data import synthetic_arithmetic_rows

    rows = synthetic_arithmetic_rows(300, difficulty=2, seed=0)
    texts = [render_chat(r["prompt"]) + r["extra_info"]["solution"] for r in rows]
    split = train_bpe_tokenizer(texts, 512)
    merged = train_bpe_tokenizer(texts, 512, split_words=False)
    prompt = render_chat(rows[0]["prompt"])
    assert len(merged.encode(prompt)) * 3 < len(split.encode(prompt))
    assert merged.decode(merged.encode(prompt)) == prompt
    assert all(len(t) == 1 for t in merged._tok.encode("12345").tokens)  # digits stay single tokens
