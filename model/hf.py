"""Hugging Face Qwen2 checkpoint import and export (config.json + safetensors).

Our parameter names are HF `Qwen2ForCausalLM`'s without the `model.` prefix of the decoder body:

    ours                                    HF
    embed_tokens.weight                     model.embed_tokens.weight
    layers.{i}.self_attn.q_proj.weight      model.layers.{i}.self_attn.q_proj.weight   (same for k, v, o, bias)
    layers.{i}.mlp.gate_proj.weight         model.layers.{i}.mlp.gate_proj.weight      (same for up, down)
    layers.{i}.input_layernorm.weight       model.layers.{i}.input_layernorm.weight    (and post_attention_)
    norm.weight                             model.norm.weight
    lm_head.weight                          lm_head.weight                             (untied models only)

`_KEY_TABLE` below is the only place that mapping is written down. Tied models (0.5B-3B) have no
`lm_head.weight`: the output projection is the embedding matrix.

`complete_hf_export` makes such a directory a checkpoint that generates as training did: the tokenizer
files, config.json's BOS/EOS ids, and a generation_config.json that stops at the ids the policy ends its
turns with.

Loading builds the model on the meta device and assigns each tensor read from the safetensors files
as the parameter itself, so the weights are allocated once. Saving streams tensors into shards of at
most `max_shard_bytes`, so a sharded trainer can hand over one gathered tensor at a time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from model.args import ModelArgs
from model.qwen2 import Qwen2

__all__ = [
    "CheckpointError",
    "to_hf_name",
    "from_hf_name",
    "args_from_hf_config",
    "hf_config_from_args",
    "load_hf",
    "save_hf",
    "iter_hf_tensors",
    "complete_hf_export",
]

HF_ARCHITECTURE = "Qwen2ForCausalLM"
HF_MODEL_TYPE = "qwen2"
CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_NAME = "generation_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


class CheckpointError(ValueError):
    """A checkpoint directory or tensor set that does not match the model it is meant for."""


# (our name, HF name); `{i}` stands for a layer index.
_KEY_TABLE: tuple[tuple[str, str], ...] = (
    ("embed_tokens.weight", "model.embed_tokens.weight"),
    ("layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.q_proj.bias"),
    ("layers.{i}.self_attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.self_attn.k_proj.bias", "model.layers.{i}.self_attn.k_proj.bias"),
    ("layers.{i}.self_attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.self_attn.v_proj.bias", "model.layers.{i}.self_attn.v_proj.bias"),
    ("layers.{i}.self_attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.mlp.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.post_attention_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)") + r"\Z")


_OURS_TO_HF = [(_pattern(ours), hf) for ours, hf in _KEY_TABLE]
_HF_TO_OURS = [(_pattern(hf), ours) for ours, hf in _KEY_TABLE]

# Module wrappers that parallel/ may insert (activation checkpointing, per-block torch.compile, FSDP1)
# add these path components to parameter names; they are not part of the checkpoint layout.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _translate(name: str, table, direction: str) -> str:
    for pattern, template in table:
        match = pattern.match(name)
        if match:
            return template.replace("{i}", match.group("i")) if "i" in pattern.groupindex else template
    raise KeyError(f"no {direction} mapping for parameter name {name!r}")


def to_hf_name(name: str) -> str:
    """Our parameter name -> HF Qwen2ForCausalLM's (wrapper path components are dropped first)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return _translate(name, _OURS_TO_HF, "Qwen2 -> HF")


def from_hf_name(hf_name: str) -> str:
    """HF Qwen2ForCausalLM's parameter name -> ours."""
    return _translate(hf_name, _HF_TO_OURS, "HF -> Qwen2")


# ---------------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------------


def _rope_theta(config: Mapping) -> float:
    """RoPE base from a config written by transformers 4.x (`rope_theta`) or 5.x (`rope_parameters`)."""
    scaling = config.get("rope_scaling")
    params = config.get("rope_parameters") or {}
    for source in (scaling or {}, params):
        kind = source.get("rope_type", source.get("type", "default"))
        if kind != "default":
            raise CheckpointError(f"config.json asks for RoPE scaling type {kind!r}; only plain RoPE is supported")
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(config.get("rope_theta", 10000.0))


def args_from_hf_config(config: Mapping) -> ModelArgs:
    """ModelArgs from a HF Qwen2 `config.json` dict. Other architectures and unsupported options are refused."""
    model_type = config.get("model_type")
    if model_type != HF_MODEL_TYPE:
        raise CheckpointError(f"config.json has model_type {model_type!r}; expected {HF_MODEL_TYPE!r}")
    architectures = config.get("architectures")
    if architectures is not None and list(architectures) != [HF_ARCHITECTURE]:
        raise CheckpointError(f"config.json has architectures {list(architectures)}; expected [{HF_ARCHITECTURE!r}]")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if k not in config]
    if missing:
        raise CheckpointError(f"config.json lacks required keys: {', '.join(missing)}")
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json has hidden_act {config['hidden_act']!r}; Qwen2 uses 'silu'")
    if config.get("use_sliding_window", False):
        raise CheckpointError("config.json enables use_sliding_window; only full attention is supported")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * heads != config["hidden_size"]:
        raise CheckpointError(f"config.json head_dim {head_dim} x {heads} heads != hidden_size {config['hidden_size']}")
    return ModelArgs(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,  # HF: absent means multi-head attention
        intermediate_size=config["intermediate_size"],
        rope_theta=_rope_theta(config),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),  # Qwen2Config's default
        max_position_embeddings=config.get("max_position_embeddings", 32768),
        init_std=float(config.get("initializer_range", 0.02)),
    )


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found")
    with open(path) as f:
        return json.load(f)


def _checkpoint_files(path: str) -> dict[str, list[str]]:
    """{safetensors file: [HF tensor names]} from an index, or from the single `model.safetensors`."""
    from safetensors import safe_open

    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path} has no 'weight_map'")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(os.path.join(path, file), []).append(name)
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise CheckpointError(f"{index_path} names shard files that do not exist: {absent}")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.isfile(single):
        raise FileNotFoundError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(single, framework="pt") as f:
        return {single: list(f.keys())}


def _mismatch_report(where: str, missing, unexpected, misshaped) -> str:
    parts = [f"{where} does not match the model:"]
    if missing:
        parts.append(f"  missing tensors ({len(missing)}): {sorted(missing)}")
    if unexpected:
        parts.append(f"  unexpected tensors ({len(unexpected)}): {sorted(unexpected)}")
    if misshaped:
        parts.append(f"  wrong shapes ({len(misshaped)}): " + ", ".join(
            f"{n} is {tuple(got)} but the model needs {tuple(want)}" for n, got, want in sorted(misshaped)))
    return "\n".join(parts)


def load_hf(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Qwen2:
    """Our Qwen2 from a HF checkpoint directory: config.json + model.safetensors, or shards + index.

    Every tensor is checked against the model first; all missing, unexpected and mis-shaped tensors
    are reported in one `CheckpointError`. A tied checkpoint may also store `lm_head.weight` (some HF
    versions write it): it is accepted only if it equals the embedding, and then dropped.
    Old checkpoints' `rotary_emb.inv_freq` buffers are derived values and are skipped.
    """
    from safetensors import safe_open

    args = args_from_hf_config(_read_json(os.path.join(path, CONFIG_NAME)))
    with torch.device("meta"):
        model = Qwen2(args)
    want = {to_hf_name(n): p.shape for n, p in model.named_parameters()}
    files = _checkpoint_files(path)

    shapes, owner = {}, {}
    for file, names in files.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                shapes[name] = torch.Size(f.get_slice(name).get_shape())
                owner[name] = file
    tied_head = args.tie_word_embeddings and "lm_head.weight" in shapes
    found = {n: s for n, s in shapes.items() if not (tied_head and n == "lm_head.weight")}
    missing = want.keys() - found.keys()
    unexpected = found.keys() - want.keys()
    misshaped = [(n, found[n], want[n]) for n in want.keys() & found.keys() if found[n] != want[n]]
    if tied_head and shapes["lm_head.weight"] != want["model.embed_tokens.weight"]:
        misshaped.append(("lm_head.weight", shapes["lm_head.weight"], want["model.embed_tokens.weight"]))
    if missing or unexpected or misshaped:
        raise CheckpointError(_mismatch_report(f"checkpoint {path}", missing, unexpected, misshaped))

    device = torch.device(device)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in files[file]:
                if name in want:
                    state[from_hf_name(name)] = f.get_tensor(name).to(dtype)
    if tied_head:
        with safe_open(owner["lm_head.weight"], framework="pt", device=str(device)) as f:
            head = f.get_tensor("lm_head.weight").to(dtype)
        if not torch.equal(head, state["embed_tokens.weight"]):
            raise CheckpointError(f"checkpoint {path} is tied (tie_word_embeddings=true) but stores an "
                                  "lm_head.weight that differs from model.embed_tokens.weight")
        del head
    # assign=True makes the loaded tensors the parameters themselves: no second copy is allocated.
    model.load_state_dict(state, strict=True, assign=True)
    return model


# ---------------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------------


def iter_hf_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, detached parameter) in module registration order: embedding, layers 0..N-1, norm, head.

    The order is fixed by the model's structure, so a sender and a receiver of the stream agree on it.
    Tensors are not copied.
    """
    for name, param in model.named_parameters():
        yield to_hf_name(name), param.detach()


def _tensor_stream(source) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(source, nn.Module):
        for name, param in source.named_parameters():
            yield name, param.detach()
    elif isinstance(source, Mapping):
        yield from source.items()
    elif isinstance(source, Iterable):
        yield from source
    else:
        raise TypeError(f"save_hf needs a module, a state dict or an iterator of (name, tensor), got {type(source).__name__}")


def _plain_cpu(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    tensor = tensor.detach()
    if type(tensor) is not torch.Tensor and not isinstance(tensor, nn.Parameter):
        raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}; gather it to a full plain tensor before saving")
    tensor = tensor.to("cpu").contiguous()
    # safetensors refuses tensors that share storage (e.g. views into one flat buffer): copy those.
    if tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def _shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


_OWN_FILES = re.compile(r"(model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json)\Z")


def save_hf(model_or_state_dict, path: str, args: ModelArgs | None = None,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write config.json + safetensors that `transformers.Qwen2ForCausalLM.from_pretrained` loads.

    `model_or_state_dict` is our Qwen2 module, a state dict with our names, or an iterator of
    (our name, full tensor) pairs (how a sharded trainer streams gathered tensors; only one shard's
    tensors are held at a time). `args` is required unless a module is given. Tensors are stored in
    their own dtype, on CPU. Above `max_shard_bytes` the tensors are split into
    `model-0000k-of-0000n.safetensors` files with a `model.safetensors.index.json`; otherwise one
    `model.safetensors`. Names and shapes are checked against `args` as they arrive and again at the
    end; on any mismatch nothing is left behind. Older model files in `path` are replaced.
    """
    from safetensors.torch import save_file

    if args is None:
        if not isinstance(model_or_state_dict, Qwen2):
            raise ValueError("save_hf needs `args` when given a state dict or an iterator of tensors")
        args = model_or_state_dict.args
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    with torch.device("meta"):
        want = {to_hf_name(n): p.shape for n, p in Qwen2(args).named_parameters()}

    os.makedirs(path, exist_ok=True)
    written: list[tuple[str, list[str]]] = []  # (temporary file, HF names in it)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, total_bytes, dtype = 0, 0, None
    seen: set[str] = set()
    unexpected, misshaped, duplicated = [], [], []

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            tmp = os.path.join(path, f".tmp-shard-{len(written):05d}.safetensors")
            save_file(shard, tmp, metadata={"format": "pt"})
            written.append((tmp, list(shard)))
        shard, shard_bytes = {}, 0

    try:
        for name, tensor in _tensor_stream(model_or_state_dict):
            try:
                hf_name = to_hf_name(name)
            except KeyError:
                unexpected.append(name)
                continue
            if hf_name not in want:
                unexpected.append(name)
                continue
            if hf_name in seen:
                duplicated.append(name)
                continue
            seen.add(hf_name)
            if tuple(tensor.shape) != tuple(want[hf_name]):
                misshaped.append((name, tensor.shape, want[hf_name]))
                continue
            tensor = _plain_cpu(name, tensor)
            dtype = dtype or tensor.dtype
            size = tensor.numel() * tensor.element_size()
            if shard and shard_bytes + size > max_shard_bytes:
                flush()
            shard[hf_name] = tensor
            shard_bytes += size
            total_bytes += size
        missing = [from_hf_name(n) for n in want.keys() - seen]
        if missing or unexpected or misshaped or duplicated:
            report = _mismatch_report(f"tensors given to save_hf for {path}", missing, unexpected, misshaped)
            if duplicated:
                report += f"\n  given more than once: {sorted(duplicated)}"
            raise CheckpointError(report)
        flush()
    except BaseException:
        for tmp, _ in written:
            if os.path.exists(tmp):
                os.remove(tmp)
        raise

    n = len(written)
    final = [SINGLE_FILE] if n == 1 else [_shard_name(i + 1, n) for i in range(n)]
    for stale in os.listdir(path):
        if _OWN_FILES.match(stale) and stale not in final:
            os.remove(os.path.join(path, stale))
    for (tmp, _), name in zip(written, final):
        os.replace(tmp, os.path.join(path, name))
    if n > 1:
        index = {"metadata": {"total_size": total_bytes},
                 "weight_map": {t: name for (_, names), name in zip(written, final) for t in names}}
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(hf_config_from_args(args, dtype=dtype), f, indent=2)


# ---------------------------------------------------------------------------------------------------
# Tokenizer and generation settings of an export
# ---------------------------------------------------------------------------------------------------


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def complete_hf_export(path: str, tokenizer, model_source: str | None = None) -> None:
    """Add to the checkpoint in `path` (config.json + weights) what makes it generate as training did.

    - the tokenizer's files (`tokenizer.save`: a loaded tokenizer's files unchanged, with its chat template);
    - config.json: bos_token_id = tokenizer.bos_id, eos_token_id = tokenizer.eos_id (Qwen2.5's convention);
    - generation_config.json: eos_token_id = tokenizer.stop_ids, the ids the policy ends a turn with (a
      list, as Qwen2.5's releases write it), with bos_token_id and pad_token_id. No sampling settings: a
      plain `generate` decodes greedily. When `model_source` (the checkpoint training started from) has a
      generation_config.json it is carried instead: unchanged when its eos ids already include every stop
      id, otherwise with the missing stop ids appended to them.
    """
    tokenizer.save(path)
    config_path = os.path.join(path, CONFIG_NAME)
    config = _read_json(config_path)
    config["bos_token_id"], config["eos_token_id"] = tokenizer.bos_id, tokenizer.eos_id
    _write_json(config_path, config)

    out = os.path.join(path, GENERATION_CONFIG_NAME)
    source = os.path.join(model_source, GENERATION_CONFIG_NAME) if model_source else None
    if source and os.path.isfile(source):
        carried = _read_json(source)
        eos = _id_list(carried.get("eos_token_id"))
        missing = [i for i in tokenizer.stop_ids if i not in eos]
        if not missing:
            if os.path.abspath(source) != os.path.abspath(out):
                shutil.copyfile(source, out)
            return
        carried["eos_token_id"] = eos + missing
        _write_json(out, carried)
        return
    _write_json(out, {"bos_token_id": tokenizer.bos_id, "eos_token_id": list(tokenizer.stop_ids),
                      "pad_token_id": tokenizer.pad_id})
