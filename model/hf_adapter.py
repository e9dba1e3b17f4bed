"""The Hugging Face adapter of our Qwen2: what a HF `Qwen2ForCausalLM` checkpoint calls each tensor, what
shape it has, which dtypes it may store, how its config.json reads and how its weight files are named.

Everything that crosses the HF boundary goes through here: loading and saving (model/hf.py), the export
from shards (checkpoint/hf_export.py), the weight sync to an engine (rollout/weight_sync.py) and both
engines' receiving side. Our parameter names are HF's without the `model.` prefix of the decoder body
(`layers.{i}.mlp.up_proj.weight` is `model.layers.{i}.mlp.up_proj.weight`; `lm_head.weight` keeps its name);
`_OUR_NAMES` below is the only place those names are written down. Tied models (0.5B-3B) have no
`lm_head.weight`: the output projection is the embedding matrix. Names are those of the plain module;
wrappers that add path components (torch.compile's `_orig_mod.`) are removed by whoever adds them
(parallel/plain_names.py), so an unknown name here is an error.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from errors import CheckpointError, write_atomically
from model.args import ModelArgs
from model.qwen2 import Qwen2

HF_ARCHITECTURE = "Qwen2ForCausalLM"
HF_MODEL_TYPE = "qwen2"
CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_NAME = "generation_config.json"


# ---------------------------------------------------------------------------------------------------
# Dtypes: the names config.json's `torch_dtype`, our TOML files and SGLang's `dtype` argument use
# ---------------------------------------------------------------------------------------------------

DTYPES: Mapping[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def to_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A dtype of `DTYPES`, given as itself or by name; anything else is a ValueError that lists the names."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in _DTYPE_NAMES:
        return dtype
    raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")


def dtype_name(dtype: torch.dtype | str) -> str:
    """The name of a dtype of `DTYPES` ("bfloat16" for torch.bfloat16)."""
    return _DTYPE_NAMES[to_dtype(dtype)]


# ---------------------------------------------------------------------------------------------------
# Names and shapes
# ---------------------------------------------------------------------------------------------------

# Our parameter names; `{i}` stands for a layer index. HF's are the same with the decoder body's `model.` prefix,
# but for `lm_head.weight`.
_OUR_NAMES = (
    "embed_tokens.weight",
    "layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.self_attn.q_proj.bias",
    "layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.self_attn.k_proj.bias",
    "layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.self_attn.v_proj.bias",
    "layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.mlp.up_proj.weight",
    "layers.{i}.mlp.down_proj.weight",
    "layers.{i}.input_layernorm.weight",
    "layers.{i}.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
)
_OUR_NAME = re.compile("|".join(re.escape(name).replace(re.escape("{i}"), r"\d+") for name in _OUR_NAMES))


def is_our_name(name: str) -> bool:
    """Whether `name` is a parameter name of our Qwen2 (of any size)."""
    return _OUR_NAME.fullmatch(name) is not None


def to_hf_name(name: str) -> str:
    """Our parameter name -> HF Qwen2ForCausalLM's; KeyError for any other name."""
    if not is_our_name(name):
        raise KeyError(f"no Qwen2 -> HF mapping for parameter name {name!r}")
    return name if name == "lm_head.weight" else f"model.{name}"


def from_hf_name(hf_name: str) -> str:
    """HF Qwen2ForCausalLM's parameter name -> ours; KeyError for any other name."""
    name = hf_name if hf_name == "lm_head.weight" else hf_name.removeprefix("model.")
    if not is_our_name(name) or to_hf_name(name) != hf_name:
        raise KeyError(f"no HF -> Qwen2 mapping for parameter name {hf_name!r}")
    return name


@functools.lru_cache(maxsize=8)
def _shapes(args: ModelArgs) -> tuple[tuple[str, torch.Size], ...]:
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = Qwen2(args)
    return tuple((to_hf_name(name), param.shape) for name, param in model.named_parameters())


# What `named_tensors` reads: our module, a state dict with our names, or (our name, tensor) pairs.
TensorSource = nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def hf_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """{HF name: shape} of every tensor a checkpoint of `args` stores, in module order (embedding,
    layers 0..N-1, norm, head). Built once per `args` from a meta-device model, so it is the module's own."""
    return dict(_shapes(args))


def named_tensors(source: TensorSource) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) pairs from our module (its parameters, detached: not copied), a state dict, or an
    iterable of pairs (how a sharded trainer streams one gathered tensor at a time)."""
    if isinstance(source, nn.Module):
        return ((name, param.detach()) for name, param in source.named_parameters())
    return iter(source.items() if isinstance(source, Mapping) else source)


def iter_hf_tensors(source: TensorSource) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for each (our name, tensor) of `source` (see `named_tensors`), in its order.

    From a module the order is fixed by its structure (embedding, layers 0..N-1, norm, head), so a sender
    and a receiver of the stream agree on it. Tensors are not copied.
    """
    return ((to_hf_name(name), tensor) for name, tensor in named_tensors(source))


# ---------------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------------


def _rope_theta(config: Mapping, source: str) -> float:
    """RoPE base from a config written by transformers 4.x (`rope_theta`) or 5.x (`rope_parameters`)."""
    scaling = config.get("rope_scaling")
    params = config.get("rope_parameters") or {}
    for part in (scaling or {}, params):
        if not isinstance(part, Mapping):
            raise CheckpointError(f"{source} has a RoPE setting {part!r} that is not a JSON object")
        kind = part.get("rope_type", part.get("type", "default"))
        if kind != "default":
            raise CheckpointError(f"{source} asks for RoPE scaling type {kind!r}; only plain RoPE is supported")
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(config.get("rope_theta", 10000.0))


# The sizes a Qwen2 config.json must state, each a positive integer.
_REQUIRED_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def args_from_hf_config(config: Mapping, source: str = "config.json") -> ModelArgs:
    """ModelArgs from a HF Qwen2 `config.json` dict. Other architectures, unsupported options and values of
    the wrong type are refused with a CheckpointError naming `source` (the file the dict was read from)."""
    model_type = config.get("model_type")
    if model_type != HF_MODEL_TYPE:
        raise CheckpointError(f"{source} has model_type {model_type!r}; expected {HF_MODEL_TYPE!r}")
    architectures = config.get("architectures")
    if architectures is not None and list(architectures) != [HF_ARCHITECTURE]:
        raise CheckpointError(f"{source} has architectures {list(architectures)}; expected [{HF_ARCHITECTURE!r}]")
    missing = [k for k in _REQUIRED_SIZES if k not in config]
    if missing:
        raise CheckpointError(f"{source} lacks required keys: {', '.join(missing)}")
    for key in (*_REQUIRED_SIZES, "num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = config.get(key)
        optional = key not in _REQUIRED_SIZES and value is None
        if not optional and (type(value) is not int or value <= 0):  # bool is not a size
            raise CheckpointError(f"{source} has {key} = {value!r}; it must be a positive integer")
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source} has hidden_act {config['hidden_act']!r}; Qwen2 uses 'silu'")
    if config.get("use_sliding_window", False):
        raise CheckpointError(f"{source} enables use_sliding_window; only full attention is supported")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * heads != config["hidden_size"]:
        raise CheckpointError(f"{source} head_dim {head_dim} x {heads} heads != hidden_size {config['hidden_size']}")
    try:
        return ModelArgs(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,  # HF: absent means multi-head attention
            intermediate_size=config["intermediate_size"],
            rope_theta=_rope_theta(config, source),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),  # Qwen2Config's default
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            init_std=float(config.get("initializer_range", 0.02)),
        )
    except (TypeError, ValueError) as exc:  # float() of a non-number; ModelArgs' own shape rules
        raise CheckpointError(f"{source}: {exc}") from None


def hf_config_from_args(args: ModelArgs, *, dtype: torch.dtype = torch.float32) -> dict:
    """A complete Qwen2 `config.json` (the keys of the official Qwen2.5 files, plus transformers 5's
    `rope_parameters` so both 4.x and 5.x read the RoPE base). `dtype` is the stored tensors' dtype."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported checkpoint dtype {dtype}; expected one of {list(_DTYPE_NAMES)}")
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_position_embeddings,
        "initializer_range": args.init_std,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "tie_word_embeddings": args.tie_word_embeddings,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.num_layers,
        "attention_dropout": 0.0,
        "use_cache": True,
        # Token ids live with the tokenizer: `complete_hf_export` sets them; None fits any vocabulary.
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def read_json(path: str) -> dict:
    """The JSON object in the checkpoint file `path`. A file that is missing, unreadable, not UTF-8, not JSON
    or not an object is a CheckpointError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def write_json(path: str, value: dict) -> None:
    write_atomically(path, json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def read_hf_config(path: str) -> ModelArgs:
    """ModelArgs of the checkpoint directory `path`, from its config.json alone (no tensor is read)."""
    config_path = os.path.join(path, CONFIG_NAME)
    return args_from_hf_config(read_json(config_path), source=config_path)


def write_hf_config(path: str, args: ModelArgs, dtype: torch.dtype) -> None:
    """Write `path`/config.json for a checkpoint of `args` whose tensors are stored in `dtype`."""
    write_json(os.path.join(path, CONFIG_NAME), hf_config_from_args(args, dtype=dtype))


# ---------------------------------------------------------------------------------------------------
# Weight file names
# ---------------------------------------------------------------------------------------------------


def shard_file_name(i: int, n: int) -> str:
    """Name of weight file i of n (1-based), as transformers' save_pretrained names shards."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


_MODEL_FILE = re.compile(r"(model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json)\Z")


def is_model_file(file_name: str) -> bool:
    """True for the weight files and index of a checkpoint (what an export replaces), not for its other files."""
    return _MODEL_FILE.match(file_name) is not None
