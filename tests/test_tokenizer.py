"""Tokenizer: round trips, Qwen2.5 chat formatting against transformers, digit-split BPE training."""

import json
import os
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from errors import CheckpointError
from model.tokenizer import ENDOFTEXT, QWEN25_DEFAULT_SYSTEM, Tokenizer, train_bpe_tokenizer

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
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! 你好"},
        {"role": "user", "content": "Answer: 42\n\\boxed{42}"},
    ],
    [{"role": "user", "content": "a"}, {"role": "system", "content": "late system"}, {"role": "user", "content": "b"}],
]


def _arithmetic_texts(n=400, seed=0):
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        a, b = rng.randint(0, 9999), rng.randint(0, 9999)
        texts.append(
            f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\nAnswer: {a + b}<|im_end|>"
        )
    return texts


def _with_default_system(trained, default_system):
    """`trained`'s vocabulary in a transformers tokenizer without a chat template, wrapped with `default_system`."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=trained.hf.backend_tokenizer, eos_token=ENDOFTEXT)
    return Tokenizer(hf, default_system=default_system)


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


@pytest.mark.parametrize(
    "text",
    ["What is 1 + 1?", "  leading spaces\n\ttabs", "unicode: héllo ∑ 你好 🙂", "<|im_start|>user\n3+4<|im_end|>\n", ""],
)
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
    want = hf.apply_chat_template(
        messages, chat_template=QWEN25_TEXT_TEMPLATE, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert trained.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == want
    # The template written by save() renders the same text inside transformers.
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt) == want
    want_ids = hf.apply_chat_template(
        messages,
        chat_template=QWEN25_TEXT_TEMPLATE,
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        return_dict=False,
    )
    assert trained.encode_chat(messages, add_generation_prompt=add_generation_prompt) == list(want_ids)


def test_chat_template_literal_and_default_system():
    tok = train_bpe_tokenizer(["abc"], vocab_size=300)
    text = tok.apply_chat_template([{"role": "user", "content": "Q"}])
    assert text == (
        f"<|im_start|>system\n{QWEN25_DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    )
    tok = _with_default_system(tok, None)
    assert tok.default_system is None
    assert (
        tok.apply_chat_template([{"role": "user", "content": "Q"}], add_generation_prompt=False)
        == "<|im_start|>user\nQ<|im_end|>\n"
    )


def test_from_dir_reads_tokenizer_config(tmp_path):
    # A directory as transformers 4 wrote it: special tokens stored as AddedToken objects, EOS <|im_end|>.
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"__type": "AddedToken", "content": "<|im_end|>"}, "pad_token": "<|endoftext|>"})
    )
    loaded = Tokenizer.from_dir(str(tmp_path))
    assert (loaded.eos_id, loaded.pad_id) == (2, 0)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    with pytest.raises(CheckpointError, match="transformers cannot load this tokenizer .*eos_token"):
        Tokenizer.from_dir(str(tmp_path))
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


@pytest.mark.parametrize("label", ["eos", "pad", "bos"])
def test_a_special_token_outside_the_vocabulary_is_named(saved_dir, tmp_path, label):
    # transformers would add it as a new token, one the model has no embedding row for.
    for name in os.listdir(saved_dir):
        (tmp_path / name).write_bytes((Path(saved_dir) / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config[f"{label}_token"] = "<nope>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"the {label} token '<nope>' is not in the tokenizer's vocabulary"):
        Tokenizer.from_dir(str(tmp_path))


def test_a_damaged_tokenizer_file_is_named(saved_dir, tmp_path):
    for name in os.listdir(saved_dir):
        (tmp_path / name).write_bytes((Path(saved_dir) / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": ')
    with pytest.raises(CheckpointError, match=f"{tmp_path}: transformers cannot load this tokenizer"):
        Tokenizer.from_dir(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text('{"version": ')
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'tokenizer.json'} is not a readable tokenizer"):
        Tokenizer.from_dir(str(tmp_path))


def test_phrases_collapse_a_repeated_template_and_still_round_trip():
    from model.tokenizer import render_chat, train_bpe_tokenizer
    from tasks.arithmetic import synthetic_arithmetic_rows
    from tasks.catalog import DAPO_PROMPT_TEMPLATE

    rows = synthetic_arithmetic_rows(300, difficulty=2, seed=0)
    texts = [render_chat(r["prompt"]) + r["extra_info"]["solution"] for r in rows]
    plain = train_bpe_tokenizer(texts, 512)
    phrases = [QWEN25_DEFAULT_SYSTEM, *DAPO_PROMPT_TEMPLATE.split("{problem}")]
    merged = train_bpe_tokenizer(texts, 512, phrases=phrases)
    prompt = render_chat(rows[0]["prompt"])
    assert len(merged.encode(prompt)) * 3 < len(plain.encode(prompt))
    assert merged.decode(merged.encode(prompt)) == prompt
    assert merged.decode(merged.encode(prompt), skip_special_tokens=True) == prompt.replace("<|im_start|>", "").replace(
        "<|im_end|>", ""
    )  # phrases are text, not special tokens
    assert [merged.token_to_id(p) for p in phrases] == list(range(merged.vocab_size - 3, merged.vocab_size))
    assert merged.vocab_size <= 512
    assert merged.hf.tokenize("12345") == list("12345")  # digits stay single tokens


# ----------------------------------------------------------------------------------------------------
# What transformers rebuilds from a checkpoint directory (config.json says model_type qwen2)
# ----------------------------------------------------------------------------------------------------

TRICKY_TEXTS = [
    "What is 305 + 17?\nAnswer: 322",
    "I'm sure it's 12345, isn't it?",
    "  two  spaces\n\n\tand tabs\r\n",
    "unicode: héllo ∑ 你好 🙂",
    "decomposed e\u0301 and composed \u00e9",
    "x<|im_end|>y<|endoftext|>",
    "Solve the following math problem step by step. inside a sentence",
    "",
]


def _as_checkpoint_dir(path, vocab_size):
    """Give a tokenizer directory the config.json of a Qwen2 checkpoint, as an export has."""
    from model.args import ModelArgs
    from model.hf_adapter import hf_config_from_args

    args = ModelArgs(
        vocab_size=vocab_size,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        tie_word_embeddings=True,
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_from_args(args), f)
    return str(path)


def _assert_same_as_transformers(ours, path, conversations, texts=TRICKY_TEXTS):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path)
    for text in texts:
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text), text
        assert hf.decode(ours.encode(text)) == ours.decode(ours.encode(text))
    for messages in conversations:
        want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ours.encode_chat(messages) == list(want), messages
    assert (hf.eos_token_id, hf.pad_token_id) == (ours.eos_id, ours.pad_id)


def test_demo_tokenizer_is_what_transformers_rebuilds(tmp_path):
    from config import DEFAULT_CONFIG, load_config
    from tasks.arithmetic import synthetic_arithmetic_rows
    from trainer.build import build_tokenizer

    cfg = load_config(DEFAULT_CONFIG, [f"job.run_dir={tmp_path}", "data.synthetic_num_train=2000"])
    ours = build_tokenizer(cfg.model, cfg.data, str(tmp_path / "run"), is_main=True, barrier=lambda: None)
    export = tmp_path / "hf"
    ours.save(str(export))
    rows = synthetic_arithmetic_rows(20, difficulty=2, split="eval", answer_line_share=0.5)
    conversations = [r["prompt"] for r in rows] + CONVERSATIONS
    texts = TRICKY_TEXTS + [r["extra_info"]["solution"] for r in rows]
    _assert_same_as_transformers(ours, _as_checkpoint_dir(export, 512), conversations, texts)
    _assert_same_as_transformers(Tokenizer.from_dir(str(export)), str(export), conversations, texts)
    assert len(ours.encode_chat(rows[0]["prompt"])) <= 30  # the template's fixed text is a few tokens


def _qwen_style_dir(path, template, trim_offsets=False):
    """A byte-level BPE laid out as Qwen2.5's tokenizer files are: Qwen2's pipeline in tokenizer.json,
    tokenizer_class Qwen2Tokenizer, EOS <|im_end|>, pad <|endoftext|>, no BOS, the chat template."""
    tok = train_bpe_tokenizer(_arithmetic_texts(300) + TRICKY_TEXTS * 5, vocab_size=400).hf.backend_tokenizer
    if not trim_offsets:  # as Qwen2.5's own file: offsets do not change ids
        spec = json.loads(tok.to_str())
        spec["pre_tokenizer"]["pretokenizers"][1]["trim_offsets"] = False
        tok = HFTokenizer.from_str(json.dumps(spec))
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    added = {
        str(i): {
            "content": t.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in tok.get_added_tokens_decoder().items()
    }
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return _as_checkpoint_dir(path, 400)


def test_qwen_style_tokenizer_matches_transformers(tmp_path):
    from tests import chat_templates

    path = _qwen_style_dir(tmp_path / "qwen", chat_templates.QWEN25)
    ours = Tokenizer.from_dir(path)
    _assert_same_as_transformers(ours, path, CONVERSATIONS)
    assert ours.stop_ids == [2, 0] and ours.bos_id == 0


def test_a_checkpoint_whose_pipeline_transformers_replaces_is_encoded_as_transformers_encodes(tmp_path):
    from transformers import AutoTokenizer

    gpt2_style = HFTokenizer(models.BPE())
    gpt2_style.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    gpt2_style.decoder = decoders.ByteLevel()
    gpt2_style.train_from_iterator(
        _arithmetic_texts(300),
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    gpt2_style.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer.from_dir(_as_checkpoint_dir(tmp_path, 400))
    # transformers rebuilds a Qwen2 checkpoint's tokenizer with Qwen2's pipeline, which splits the digits that
    # this file's GPT-2 pipeline groups: the ids are transformers', not the file's.
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    texts = _arithmetic_texts(20)
    assert all(hf.encode(t, add_special_tokens=False) == ours.encode(t) for t in texts)
    assert any(gpt2_style.encode(t).ids != ours.encode(t) for t in texts)


TEMPLATE_CASES = {
    "qwen25": (["qwen25"], CONVERSATIONS),
    "no_default_system": (["no_default_system"], CONVERSATIONS),
    "system_required": (
        ["system_required"],
        [c for c in CONVERSATIONS if c[0]["role"] == "system"]
        + [
            [
                {"role": "system", "content": "You add numbers."},
                {"role": "user", "content": "  1 + 1?  "},
                {"role": "assistant", "content": "2"},
                {"role": "user", "content": "2 + 2?"},
            ]
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(TEMPLATE_CASES))
@pytest.mark.parametrize("as_file", [False, True])
def test_a_checkpoints_chat_template_renders_as_in_transformers(tmp_path, name, as_file):
    from transformers import AutoTokenizer

    from tests import chat_templates

    template = {
        "qwen25": chat_templates.QWEN25,
        "no_default_system": chat_templates.NO_DEFAULT_SYSTEM,
        "system_required": chat_templates.SYSTEM_REQUIRED,
    }[name]
    path = _qwen_style_dir(tmp_path, None if as_file else template)
    if as_file:  # transformers' newer layout: chat_template.jinja next to tokenizer_config.json
        (tmp_path / "chat_template.jinja").write_text(template)
    ours = Tokenizer.from_dir(path)
    hf = AutoTokenizer.from_pretrained(path)
    for messages in TEMPLATE_CASES[name][1]:
        for add in (True, False):
            want = hf.apply_chat_template(messages, add_generation_prompt=add, tokenize=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=add) == want
            want_ids = hf.apply_chat_template(messages, add_generation_prompt=add, tokenize=True, return_dict=False)
            assert ours.encode_chat(messages, add_generation_prompt=add) == list(want_ids)
    if name == "no_default_system":  # no system turn is invented
        assert (
            ours.apply_chat_template([{"role": "user", "content": "Q"}])
            == "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
        )
    if name == "system_required":
        import jinja2

        with pytest.raises(jinja2.exceptions.TemplateError, match="must be a system message"):
            ours.apply_chat_template([{"role": "user", "content": "Q"}])
    assert ours.chat_template == template


def test_builtin_rendering_is_saved_as_a_template_and_carried_when_a_checkpoint_has_none(tmp_path):
    from model.tokenizer import qwen25_template

    path = _qwen_style_dir(tmp_path / "src", None)
    ours = Tokenizer.from_dir(path)
    assert ours.chat_template == qwen25_template(QWEN25_DEFAULT_SYSTEM)  # built in
    out = tmp_path / "out"
    ours.save(str(out))
    assert (out / "chat_template.jinja").read_text() == ours.chat_template
    _as_checkpoint_dir(out, 400)
    # The export, loaded by transformers alone, encodes and renders as the source did.
    _assert_same_as_transformers(ours, str(out), CONVERSATIONS)
    again = Tokenizer.from_dir(str(out))
    assert [again.apply_chat_template(m) for m in CONVERSATIONS] == [ours.apply_chat_template(m) for m in CONVERSATIONS]


@pytest.mark.parametrize(
    "default_system", [QWEN25_DEFAULT_SYSTEM, None, 'it\'s "quoted", a \\ backslash', "héllo — 你好 🙂\n\ttabbed"]
)
def test_builtin_rendering_written_as_a_template_renders_byte_identically(trained, tmp_path, default_system):
    from transformers import AutoTokenizer

    from model.tokenizer import render_chat

    _with_default_system(trained, default_system).save(str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    for messages in CONVERSATIONS:
        for add in (True, False):
            want = render_chat(messages, default_system, add)
            assert hf.apply_chat_template(messages, add_generation_prompt=add, tokenize=False) == want


def test_several_stored_templates_use_the_default_one(tmp_path):
    from tests import chat_templates

    path = _qwen_style_dir(
        tmp_path,
        [
            {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
            {"name": "default", "template": chat_templates.NO_DEFAULT_SYSTEM},
        ],
    )
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Q"}]
    want = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    assert Tokenizer.from_dir(path).apply_chat_template(messages) == want
    assert (
        AutoTokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        == want
    )
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = 3
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="tokenizer_config.json: chat_template must be a string"):
        Tokenizer.from_dir(path)
