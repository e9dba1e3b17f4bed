"""HF checkpoint import/export: round trips through transformers, sharding, streaming, every error path."""

import copy
import json
import os

import pytest
import torch
from numerics import assert_close_to_float64
from safetensors.torch import load_file, save_file

from model.args import PRESETS, ModelArgs
from model.hf import complete_hf_export, load_hf, save_hf
from model.hf_adapter import (
    DTYPES,
    CheckpointError,
    args_from_hf_config,
    dtype_name,
    from_hf_name,
    hf_config_from_args,
    hf_shapes,
    iter_hf_tensors,
    to_dtype,
    to_hf_name,
)
from model.qwen2 import Qwen2, build_model
from tests.qwen2_checkpoint import hf_state_dict

ARGS = {
    "untied": ModelArgs(
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        tie_word_embeddings=False,
        max_position_embeddings=128,
    ),
    "tied": ModelArgs(
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        intermediate_size=48,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
    ),
}
TOKENS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def _hf_model(args, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{k: v for k, v in hf_config_from_args(args).items() if k != "architectures"})
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # biases and norms random too, so a swapped tensor shows
            p.normal_(0.0, 0.1)
    return model


def _hf_from_pretrained(path):
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _state_equal(a: dict, b: dict):
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _hf_tensors(model):
    """HF state dict without the tied head alias (HF's state_dict lists the shared tensor twice)."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


# ----------------------------------------------------------------------------------------------------
# Names and configs
# ----------------------------------------------------------------------------------------------------


def test_name_table_examples_and_inverse():
    assert to_hf_name("layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert to_hf_name("layers.13.mlp.down_proj.weight") == "model.layers.13.mlp.down_proj.weight"
    assert to_hf_name("embed_tokens.weight") == "model.embed_tokens.weight"
    assert to_hf_name("norm.weight") == "model.norm.weight"
    assert to_hf_name("lm_head.weight") == "lm_head.weight"
    assert from_hf_name("model.layers.7.post_attention_layernorm.weight") == "layers.7.post_attention_layernorm.weight"
    model = Qwen2(ARGS["untied"])
    for name, _ in model.named_parameters():
        assert from_hf_name(to_hf_name(name)) == name


def test_unknown_names_raise_with_the_name():
    with pytest.raises(KeyError, match="layers.0.self_attn.qkv_proj.weight"):
        to_hf_name("layers.0.self_attn.qkv_proj.weight")
    with pytest.raises(KeyError, match="model.layers.0.self_attn.rotary_emb.inv_freq"):
        from_hf_name("model.layers.0.self_attn.rotary_emb.inv_freq")
    with pytest.raises(KeyError, match="'embed_tokens.weight'"):
        from_hf_name("embed_tokens.weight")  # HF names carry the model. prefix
    # Wrapper path components are parallel/'s to remove (parallel/plain_names.py): here they are unknown names.
    with pytest.raises(KeyError, match="layers.3._orig_mod.mlp.up_proj.weight"):
        to_hf_name("layers.3._orig_mod.mlp.up_proj.weight")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_round_trip(name):
    assert args_from_hf_config(hf_config_from_args(PRESETS[name])) == PRESETS[name]


def test_official_config_json_is_read():
    # Qwen2.5-32B's published config.json (transformers 4.x layout: top-level rope_theta).
    official = {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 27648,
        "max_position_embeddings": 131072,
        "max_window_layers": 64,
        "model_type": "qwen2",
        "num_attention_heads": 40,
        "num_hidden_layers": 64,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 152064,
    }
    assert args_from_hf_config(official) == PRESETS["qwen2.5-32b"]


def test_transformers_reads_our_config():
    from transformers import Qwen2Config

    args = PRESETS["qwen2.5-14b"]
    config = Qwen2Config.from_dict(hf_config_from_args(args))
    assert (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.rms_norm_eps,
        config.tie_word_embeddings,
        config.vocab_size,
    ) == (5120, 48, 8, 1e-5, False, 152064)
    assert config.rope_parameters["rope_theta"] == 1e6


_DELETE = object()


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("model_type", "llama", "model_type 'llama'; expected 'qwen2'"),
        ("architectures", ["LlamaForCausalLM"], "architectures \\['LlamaForCausalLM'\\]"),
        ("hidden_act", "gelu", "hidden_act 'gelu'"),
        ("use_sliding_window", True, "use_sliding_window"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "RoPE scaling type 'yarn'"),
        ("hidden_size", _DELETE, "lacks required keys: hidden_size"),
    ],
)
def test_unsupported_configs_are_refused_by_name(key, value, message):
    config = hf_config_from_args(ARGS["untied"])
    if value is _DELETE:
        del config[key]
    else:
        config[key] = value
    with pytest.raises(CheckpointError, match=message):
        args_from_hf_config(config)


# ----------------------------------------------------------------------------------------------------
# Round trips
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_hf_to_ours_to_hf_round_trip(kind, tmp_path):
    args = ARGS[kind]
    hf = _hf_model(args)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(str(tmp_path / "hf"))
    assert ours.args == args and (ours.lm_head is None) == args.tie_word_embeddings
    hf_state = _hf_tensors(hf)
    _state_equal({to_hf_name(n): p.detach() for n, p in ours.named_parameters()}, hf_state)
    with torch.no_grad():  # within fp32 rounding, measured against transformers in float64 (tests/numerics.py)
        want, want64 = hf(TOKENS).logits, copy.deepcopy(hf).double()(TOKENS).logits
        assert_close_to_float64(ours(TOKENS), want, want64, "logits")

    save_hf(ours, str(tmp_path / "ours"))
    assert sorted(os.listdir(tmp_path / "ours")) == ["config.json", "model.safetensors"]
    back = _hf_from_pretrained(str(tmp_path / "ours"))
    _state_equal(_hf_tensors(back), hf_state)
    assert back.config.tie_word_embeddings == args.tie_word_embeddings
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr() or not args.tie_word_embeddings
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, want)


def test_sharded_checkpoints_both_ways(tmp_path):
    args = ARGS["untied"]
    hf = _hf_model(args, seed=1)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]) > 1
    ours = load_hf(str(tmp_path / "hf"))
    _state_equal({to_hf_name(n): p.detach() for n, p in ours.named_parameters()}, _hf_tensors(hf))

    save_hf(ours, str(tmp_path / "ours"), max_shard_bytes=30_000)
    files = sorted(f for f in os.listdir(tmp_path / "ours") if f.endswith(".safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(_hf_tensors(hf))
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in ours.parameters())
    for f in files:  # every shard respects the limit unless it holds a single larger tensor
        shard = load_file(str(tmp_path / "ours" / f))
        assert len(shard) == 1 or sum(t.numel() * t.element_size() for t in shard.values()) <= 30_000
    _state_equal(_hf_tensors(_hf_from_pretrained(str(tmp_path / "ours"))), _hf_tensors(hf))
    _state_equal(load_hf(str(tmp_path / "ours")).state_dict(), ours.state_dict())

    # Saving again unsharded replaces the old shards and index.
    save_hf(ours, str(tmp_path / "ours"))
    assert sorted(os.listdir(tmp_path / "ours")) == ["config.json", "model.safetensors"]


def test_streamed_save_from_iterator(tmp_path):
    args = ARGS["tied"]
    model = build_model(args, seed=3)
    consumed = []

    def stream():  # a sharded trainer yields one gathered tensor at a time
        for name, p in model.named_parameters():
            consumed.append(name)
            yield name, p.detach().clone()

    save_hf(stream(), str(tmp_path / "ckpt"), args=args, max_shard_bytes=20_000)
    assert len(consumed) == len(list(model.parameters()))
    _state_equal(load_hf(str(tmp_path / "ckpt")).state_dict(), model.state_dict())


def test_dtype_is_kept_on_save_and_chosen_on_load(tmp_path):
    model = build_model(ARGS["untied"], seed=4).to(torch.bfloat16)
    save_hf(model, str(tmp_path / "bf16"))
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(tmp_path / "bf16" / "model.safetensors")).values())
    loaded = load_hf(str(tmp_path / "bf16"), dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p.float(), q), name


def test_load_never_materializes_random_weights(tmp_path, monkeypatch):
    save_hf(build_model(ARGS["untied"], seed=5), str(tmp_path))

    def refuse(*a, **k):
        raise AssertionError("load_hf must fill the allocated tensors from the file, not initialise them first")

    monkeypatch.setattr(Qwen2, "init_weights", refuse)
    model = load_hf(str(tmp_path))
    assert all(p.device.type == "cpu" and p.requires_grad for p in model.parameters())


def test_iter_hf_tensors_order_and_names():
    model = build_model(ARGS["untied"], seed=6)
    names = [n for n, _ in iter_hf_tensors(model)]
    assert names == [to_hf_name(n) for n, _ in model.named_parameters()]
    assert names[0] == "model.embed_tokens.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert names.index("model.layers.0.self_attn.q_proj.weight") < names.index("model.layers.1.self_attn.q_proj.weight")
    assert names == [n for n, _ in iter_hf_tensors(build_model(ARGS["untied"], seed=7))]  # stable
    first = next(iter_hf_tensors(model))[1]
    assert first.data_ptr() == model.embed_tokens.weight.data_ptr() and not first.requires_grad  # no copy


# ----------------------------------------------------------------------------------------------------
# Error paths
# ----------------------------------------------------------------------------------------------------


def _saved(tmp_path, kind="untied"):
    path = tmp_path / kind
    save_hf(build_model(ARGS[kind], seed=8), str(path))
    return path, load_file(str(path / "model.safetensors"))


def test_missing_unexpected_and_misshaped_are_listed_together(tmp_path):
    path, tensors = _saved(tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    del tensors["model.norm.weight"]
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(48, 32)
    tensors["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(7)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_hf(str(path))
    text = str(err.value)
    assert "missing tensors (2): ['model.layers.1.mlp.up_proj.weight', 'model.norm.weight']" in text
    assert "unexpected tensors (1): ['model.layers.2.mlp.up_proj.weight']" in text
    assert "model.layers.0.self_attn.k_proj.bias is (7,) but the model needs (16,)" in text


def test_tied_checkpoint_with_a_stored_head(tmp_path):
    path, tensors = _saved(tmp_path, "tied")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    model = load_hf(str(path))  # equal copy: accepted and dropped
    assert model.lm_head is None and torch.equal(model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    tensors["lm_head.weight"][0, 0] += 1.0
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lm_head.weight that differs from model.embed_tokens.weight"):
        load_hf(str(path))


def test_wrong_architecture_and_missing_files(tmp_path):
    path, _ = _saved(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model_type 'llama'"):
        load_hf(str(path))
    with pytest.raises(CheckpointError, match="nowhere/config.json not found"):
        load_hf(str(tmp_path / "nowhere"))
    os.remove(path / "model.safetensors")
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_hf(str(path))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "gone.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="gone.safetensors"):
        load_hf(str(path))


def test_save_refuses_mismatched_tensors_and_leaves_nothing(tmp_path):
    args = ARGS["untied"]
    state = dict(build_model(args, seed=9).state_dict())
    del state["norm.weight"]
    state["layers.5.mlp.up_proj.weight"] = torch.zeros(48, 32)
    state["layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError) as err:
        save_hf(state, str(tmp_path / "bad"), args=args, max_shard_bytes=10_000)
    text = str(err.value)
    assert "missing tensors (1): ['norm.weight']" in text
    assert "unexpected tensors (1): ['layers.5.mlp.up_proj.weight']" in text
    assert "layers.0.mlp.up_proj.weight is (3, 3) but the model needs (48, 32)" in text
    assert os.listdir(tmp_path / "bad") == []  # shards written before the error were removed
    with pytest.raises(ValueError, match="needs `args`"):
        save_hf(state, str(tmp_path / "bad"))
    tied_state = dict(build_model(ARGS["tied"], seed=9).state_dict(), **{"lm_head.weight": torch.zeros(128, 32)})
    with pytest.raises(CheckpointError, match="unexpected tensors \\(1\\): \\['lm_head.weight'\\]"):
        save_hf(tied_state, str(tmp_path / "bad"), args=ARGS["tied"])


# ----------------------------------------------------------------------------------------------------
# Token ids and generation settings of an export
# ----------------------------------------------------------------------------------------------------


def _chat_tokenizer():
    from model.tokenizer import train_bpe_tokenizer

    texts = ["<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\nAnswer: 3<|im_end|>"] * 20
    return train_bpe_tokenizer(texts, vocab_size=300)  # <|endoftext|> 0 (EOS), <|im_start|> 1, <|im_end|> 2


def _exported(tmp_path, tokenizer, source=None):
    from model.hf import complete_hf_export

    args = ModelArgs(
        vocab_size=300,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        tie_word_embeddings=True,
        max_position_embeddings=128,
    )
    path = str(tmp_path / "hf")
    save_hf(build_model(args, seed=0), path)
    complete_hf_export(path, tokenizer, model_source=source)
    return path


def test_export_names_the_token_ids_and_stops_at_the_turn_end(tmp_path):
    from transformers import AutoConfig, GenerationConfig

    tokenizer = _chat_tokenizer()
    path = _exported(tmp_path, tokenizer)
    config = AutoConfig.from_pretrained(path)
    assert (config.bos_token_id, config.eos_token_id) == (0, 0)
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f) == {"bos_token_id": 0, "eos_token_id": [0, 2], "pad_token_id": 0}
    generation = GenerationConfig.from_pretrained(path)
    assert generation.eos_token_id == tokenizer.stop_ids == [0, 2]
    # Nothing that would turn greedy decoding into sampling or change its scores.
    assert not generation.do_sample and generation.repetition_penalty in (None, 1.0)
    assert os.path.isfile(os.path.join(path, "tokenizer.json")) and os.path.isfile(
        os.path.join(path, "tokenizer_config.json")
    )


@pytest.mark.parametrize("shard_bytes", [None, 200_000])  # one model.safetensors, or shards and an index
def test_every_file_of_an_export_has_the_mode_new_files_get(tmp_path, shard_bytes):
    """safetensors writes its files 0600 (through a private temporary file); an export's weights must be readable
    by whoever can read its config.json: the mode this process gives new files (0666 less the umask)."""
    umask = os.umask(0o027)  # a umask that lets the group read: 0640 for new files
    try:
        path = str(tmp_path / "export")
        save_hf(build_model(PRESETS["tiny"], seed=0), path, **({"max_shard_bytes": shard_bytes} if shard_bytes else {}))
        complete_hf_export(path, _chat_tokenizer())
    finally:
        os.umask(umask)
    modes = {name: os.stat(os.path.join(path, name)).st_mode & 0o777 for name in os.listdir(path)}
    assert any(name.endswith(".safetensors") for name in modes) and set(modes.values()) == {0o640}, modes


def test_a_source_generation_config_is_carried(tmp_path):
    tokenizer = _chat_tokenizer()
    source = tmp_path / "source"
    source.mkdir()
    # Already stops at every stop id: copied byte for byte.
    text = '{\n "eos_token_id": [2, 0],\n "temperature": 0.7, "do_sample": true\n}'
    (source / "generation_config.json").write_text(text)
    path = _exported(tmp_path / "a", tokenizer, source=str(source))
    assert open(os.path.join(path, "generation_config.json")).read() == text
    # Stops only at <|endoftext|> (a base model's): the other stop id is added, the rest kept.
    (source / "generation_config.json").write_text('{"bos_token_id": 0, "eos_token_id": 0, "max_new_tokens": 2048}')
    path = _exported(tmp_path / "b", tokenizer, source=str(source))
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f) == {"bos_token_id": 0, "eos_token_id": [0, 2], "max_new_tokens": 2048}


def test_iter_hf_tensors_from_pairs_and_state_dicts():
    model = build_model(ARGS["tied"], seed=6)
    from_module = [(n, t.data_ptr()) for n, t in iter_hf_tensors(model)]
    assert [(n, t.data_ptr()) for n, t in iter_hf_tensors(model.named_parameters())] == from_module
    assert [n for n, _ in iter_hf_tensors(dict(model.named_parameters()))] == [n for n, _ in from_module]
    with pytest.raises(TypeError, match="'int' object is not iterable"):
        next(iter_hf_tensors(3))


@pytest.mark.parametrize("kind", sorted(ARGS))
def test_hf_shapes_are_the_modules_in_module_order(kind):
    model = Qwen2(ARGS[kind])
    assert list(hf_shapes(ARGS[kind]).items()) == [(to_hf_name(n), p.shape) for n, p in model.named_parameters()]
    assert ("lm_head.weight" in hf_shapes(ARGS[kind])) == (kind == "untied")
    shapes = hf_shapes(ARGS[kind])
    shapes.clear()  # a caller's copy: the cached table is not touched
    assert len(hf_shapes(ARGS[kind])) == len(list(model.parameters()))


def test_dtype_table_names_and_refusals():
    assert {name: to_dtype(name) for name in DTYPES} == dict(DTYPES)
    assert [dtype_name(d) for d in DTYPES.values()] == list(DTYPES)
    assert to_dtype(torch.bfloat16) is torch.bfloat16 and dtype_name("float16") == "float16"
    assert hf_config_from_args(ARGS["tied"], dtype=torch.bfloat16)["torch_dtype"] == "bfloat16"
    for bad in ("fp8", torch.int8, None):
        with pytest.raises(ValueError, match=r"dtype must be one of \['float32', 'bfloat16', 'float16'\]"):
            to_dtype(bad)


@pytest.mark.parametrize("kind", sorted(ARGS))
def test_hf_state_dict_is_transformers_layout(kind):
    ours, hf = build_model(ARGS[kind], seed=8), _hf_model(ARGS[kind])
    state = hf_state_dict(ours)
    assert sorted(state) == sorted(hf.state_dict())  # the tied head alias included
    hf.load_state_dict(state, strict=True)
    with torch.no_grad():  # within fp32 rounding, measured against transformers in float64 (tests/numerics.py)
        want64 = copy.deepcopy(hf).double()(TOKENS).logits
        assert_close_to_float64(ours(TOKENS), hf(TOKENS).logits, want64, "logits")
    assert state["lm_head.weight"].data_ptr() == ours.output_weight().data_ptr()  # no copies
