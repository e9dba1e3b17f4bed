"""Hugging Face Qwen2 checkpoints on disk: load, save (config.json + safetensors) and complete an export.

Names, shapes, dtypes, config.json and file names come from the adapter, model/hf_adapter.py.

`complete_hf_export` makes such a directory a checkpoint that generates as training did: the tokenizer
files, config.json's BOS/EOS ids, and a generation_config.json that stops at the ids the policy ends its
turns with.

Loading builds the model on the meta device, allocates it once and copies each tensor read from the
safetensors files into its parameter. Saving streams tensors into shards of at
most `max_shard_bytes`, so a sharded trainer can hand over one gathered tensor at a time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from errors import WriteError, broken_link, writing
from model.args import ModelArgs
from model.hf_adapter import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    TensorSource,
    from_hf_name,
    hf_shapes,
    is_model_file,
    is_our_name,
    named_tensors,
    read_hf_config,
    read_json,
    shard_file_name,
    to_hf_name,
    write_hf_config,
    write_json,
)
from model.qwen2 import Qwen2

if TYPE_CHECKING:
    from model.tokenizer import Tokenizer

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def open_safetensors(file: str, device: str = "cpu") -> Iterator:
    """safetensors' `safe_open`, with a damaged file (a header that does not parse or does not cover the
    file: truncated, appended to, not safetensors) reported as a CheckpointError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt", device=device) as f:
            yield f
    except SafetensorError as exc:
        raise CheckpointError(
            f"{file} is not a readable safetensors file ({exc}): it is damaged or was not copied whole; "
            "copy or export the checkpoint again"
        ) from None
    except OSError as exc:  # safetensors calls a file it may not read a missing one
        why = "Permission denied" if os.path.isfile(file) and not os.access(file, os.R_OK) else exc
        raise CheckpointError(f"cannot read {file}: {why}") from None


def _checkpoint_files(path: str) -> dict[str, list[str]]:
    """{safetensors file: [HF tensor names]} from an index, or from the single `model.safetensors`."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = read_json(index_path).get("weight_map")
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
        raise CheckpointError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    with open_safetensors(single) as f:
        return {single: list(f.keys())}


def _names(names: Collection[str], shown: int = 8) -> str:
    """A sorted list of tensor names for a message: the first `shown`, then how many more."""
    ordered = sorted(names)
    if len(ordered) <= shown:
        return str(ordered)
    return str(ordered[:shown])[:-1] + f", ... and {len(ordered) - shown} more]"


def _mismatch_report(
    where: str,
    missing: Collection[str],
    unexpected: Collection[str],
    misshaped: Sequence[tuple[str, torch.Size, torch.Size]],
) -> str:
    """One line: what does not match, each kind with its count (long lists shortened)."""
    parts = []
    if missing:
        parts.append(f"missing tensors ({len(missing)}): {_names(missing)}")
    if unexpected:
        parts.append(f"unexpected tensors ({len(unexpected)}): {_names(unexpected)}")
    if misshaped:
        parts.append(
            f"wrong shapes ({len(misshaped)}): "
            + ", ".join(f"{n} is {tuple(got)} but the model needs {tuple(want)}" for n, got, want in sorted(misshaped))
        )
    return f"{where} does not match the model: " + "; ".join(parts)


@dataclass(frozen=True)
class CheckpointLayout:
    """Where each tensor of a checked HF checkpoint lives: {HF name: safetensors file} for every tensor the
    model needs, and the file of a tied checkpoint's stored `lm_head.weight` (None when it stores none)."""

    files: dict[str, str]
    tied_head_file: str | None


def checkpoint_layout(path: str, args: ModelArgs) -> CheckpointLayout:
    """Check the checkpoint directory `path` against a model of `args`, reading only the files' headers.

    All missing, unexpected and mis-shaped tensors are reported in one `CheckpointError`. A tied checkpoint
    may also store `lm_head.weight` (some HF versions write it): its shape must be the embedding's; whoever
    loads it checks that it equals the embedding and drops it. Old checkpoints' `rotary_emb.inv_freq`
    buffers are derived values and are skipped.
    """
    want = hf_shapes(args)
    shapes, owner = {}, {}
    for file, names in _checkpoint_files(path).items():
        with open_safetensors(file) as f:
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
    return CheckpointLayout({n: owner[n] for n in want}, owner["lm_head.weight"] if tied_head else None)


def nonfinite_weights_error(file: str, name: str) -> CheckpointError:
    return CheckpointError(
        f"{file} holds NaN or inf in {name}: a policy with non-finite weights can be neither trained nor "
        "evaluated; use an intact checkpoint (this one is damaged, or was saved after its training diverged)"
    )


def check_finite_weights(path: str) -> None:
    """Refuse (CheckpointError naming the file and the tensor) an HF checkpoint whose weights hold NaN or inf;
    reads one tensor at a time."""
    for file, names in _checkpoint_files(path).items():
        with open_safetensors(file) as f:
            for name in names:
                if not bool(torch.isfinite(f.get_tensor(name)).all()):
                    raise nonfinite_weights_error(file, name)


CHECKSUMS = "SHA256SUMS"
# Files of a checkpoint folder that nothing loading it reads: its documentation. Hidden names (.gitattributes, .git/,
# the .cache/ that `hf download --local-dir` writes) are not read either.
UNREAD_FILES = ("README.md", "LICENSE", "LICENSE.txt")


def _loadable_files(path: str) -> list[str]:
    """Every file under `path` (names relative to it, sorted) but SHA256SUMS, hidden ones and UNREAD_FILES. Not a
    list of what loaders read: that list changes with every release (transformers' tokenizer alone reads
    tokenizer.json, tokenizer_config.json, special_tokens_map.json, added_tokens.json, vocab.json, merges.txt,
    chat_template.jinja / .json, additional_chat_templates/ and config.json; SGLang every *.safetensors, or *.bin
    and *.pt where there is none, and generation_config.json), so whatever it has not named yet is here too. A link
    to a folder is refused."""
    found: list[str] = []

    def unreadable(exc: OSError) -> None:
        raise CheckpointError(f"cannot read the folder {exc.filename}: {exc.strerror}") from None

    for folder, subfolders, files in os.walk(path, onerror=unreadable):
        linked = [name for name in subfolders if os.path.islink(os.path.join(folder, name))]
        if linked:  # its files lie outside what the list can name
            raise CheckpointError(f"{os.path.join(folder, linked[0])} is a symbolic link to a folder: copy it in")
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        names = [name for name in files if not name.startswith(".") and name not in (CHECKSUMS, *UNREAD_FILES)]
        found += [os.path.relpath(os.path.join(folder, name), path) for name in names]
    return sorted(found)


def check_checksums(path: str) -> None:
    """Refuse (CheckpointError naming the file) a checkpoint or tokenizer folder whose files differ from its
    SHA256SUMS, when it has one: lines of "<sha256 hex digest>  <file name>", as `sha256sum` writes them (and
    `sha256sum -c SHA256SUMS` checks them by hand). A base policy shipped with the repository (bases/) pins its files
    this way, so a changed, truncated or never-fetched file (a Git LFS pointer) is named before anything loads.

    The folder is checked whole: a file the list does not name is refused too (`_loadable_files`: every file but
    the list, hidden ones and UNREAD_FILES), as an added weight index or chat template would change the model
    unchecked. A SHA256SUMS that is empty, not a file (a folder, a dangling link), unreadable or not UTF-8 is
    refused rather than read as "unchecked"; so is a listed file that cannot be read."""
    listing = os.path.join(path, CHECKSUMS)
    if not os.path.lexists(listing):
        return
    files = _loadable_files(path)
    rewrite = f"write the list again: `cd {path} && sha256sum {' '.join(files)} > {CHECKSUMS}`"
    try:
        with open(listing, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{listing} is not UTF-8 text (byte {exc.start}): {rewrite}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {listing}: {broken_link(listing) or exc.strerror}; {rewrite}") from None
    if not lines:
        raise CheckpointError(f"{listing} lists no file: {rewrite}")
    listed: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        found = re.fullmatch(r"([0-9a-fA-F]{64}) [ *](.+)", line)
        if found is None or found.group(2).startswith("/") or {"", ".", ".."} & set(found.group(2).split("/")):
            raise CheckpointError(
                f"{listing}, line {number}, is not '<sha256>  <file name>' of a file in its folder: {line[:80]!r}; "
                f"{rewrite}"
            )
        listed[found.group(2)] = found.group(1).lower()
    unlisted = [name for name in files if name not in listed]
    if unlisted:
        raise CheckpointError(
            f"{os.path.join(path, unlisted[0])} is not listed in {listing}, so it would be loaded unchecked: remove "
            f"it, or (if it belongs to the checkpoint) {rewrite}"
        )
    for name, expected in listed.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is listed in {listing} but missing: restore the checkpoint's files")
        try:
            with open(file, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as exc:
            raise CheckpointError(f"cannot read {file}: {exc.strerror}") from None
        if digest != expected:
            raise CheckpointError(
                f"{file} does not match its SHA-256 in {listing} ({digest[:12]}... instead of {expected[:12]}...): the "
                f"file was changed or only partly fetched; restore it (or, for a checkpoint you remade on purpose, "
                f"{rewrite})"
            )


Region = tuple[slice, ...]  # the part of a full tensor that one parameter (or one rank's shard of it) holds


def _read(file: str, name: str, region: Region) -> torch.Tensor:
    """The region of one stored tensor, as a view of the mapped file (the file stays mapped while it lives)."""
    with open_safetensors(file) as f:
        return f.get_slice(name)[region]


def _check_tied_head(path: str, layout: CheckpointLayout, rows: int) -> None:
    """The stored head equals the embedding: compared half a tensor at a time."""
    embed_file, head_file = layout.files["model.embed_tokens.weight"], layout.tied_head_file
    assert head_file is not None  # called for a tied checkpoint that stores a head
    step = max(1, -(-rows // 2))
    for start in range(0, rows, step):
        region = (slice(start, min(start + step, rows)),)
        same = torch.equal(
            _read(head_file, "lm_head.weight", region),
            _read(embed_file, "model.embed_tokens.weight", region),
        )
        if not same:
            raise CheckpointError(
                f"checkpoint {path} is tied (tie_word_embeddings=true) but stores an "
                "lm_head.weight that differs from model.embed_tokens.weight"
            )


@torch.no_grad()
def fill_from_hf(model: Qwen2, path: str, parts: Iterable[tuple[str, torch.Tensor, Region]]) -> None:
    """Fill allocated tensors of `model` from the HF checkpoint directory `path`: for each (our name, tensor,
    region) of `parts`, the tensor becomes that region of the stored tensor, cast from the stored dtype by the
    copy (checkpoint/hf_load.py gives each rank's shards and their regions).

    The checkpoint is checked against `model.args` first (`checkpoint_layout`). A tied checkpoint's stored
    `lm_head.weight` is accepted only if it equals the embedding, and then dropped.
    """
    layout = checkpoint_layout(path, model.args)
    if layout.tied_head_file:
        _check_tied_head(path, layout, model.args.vocab_size)
    for name, local, region in parts:
        if local.numel() == 0:
            continue  # an uneven shard that holds no rows
        hf_name = to_hf_name(name)
        part = _read(layout.files[hf_name], hf_name, region)
        if part.shape != local.shape:
            raise AssertionError(
                f"{name}: region {region} gives {tuple(part.shape)}, the shard is {tuple(local.shape)}"
            )
        if local.device.type != "cpu":
            part = part.to(local.device)  # in the stored dtype: the cast then runs on the device, not in host memory
        local.copy_(part)
        del part  # the file's mapping goes with the last view of it


def load_hf(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Qwen2:
    """Our Qwen2 from a HF checkpoint directory: config.json + model.safetensors, or shards + index.

    The module is built on the meta device and allocated once on `device` in `dtype`, uninitialised; then
    `fill_from_hf` reads each tensor whole into it. A sharded model reads only its own rows instead
    (checkpoint/hf_load.py).
    """
    with torch.device("meta"):
        model = Qwen2(read_hf_config(path)).to(dtype)
    model.to_empty(device=device)
    fill_from_hf(model, path, ((n, p, tuple(slice(0, k) for k in p.shape)) for n, p in model.named_parameters()))
    return model


# ---------------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------------


def _plain_cpu(name: str, tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if type(tensor) is not torch.Tensor and not isinstance(tensor, nn.Parameter):
        raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}; gather it to a full plain tensor before saving")
    tensor = tensor.to("cpu").contiguous()
    # safetensors refuses tensors that share storage (e.g. views into one flat buffer): copy those.
    if tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def split_into_shards(
    tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """The (name, tensor) pairs, in order, collected into shards of at most `max_shard_bytes` (a larger tensor
    gets a shard of its own); each shard is yielded when the next tensor would overflow it, the last at the end."""
    shard: dict[str, torch.Tensor] = {}
    used = 0
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()  # numel of a DTensor is the full tensor's
        if shard and used + size > max_shard_bytes:
            yield shard
            shard, used = {}, 0
        shard[name] = tensor
        used += size
    if shard:
        yield shard


def save_hf(
    model_or_state_dict: TensorSource,
    path: str,
    args: ModelArgs | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write config.json + safetensors that `transformers.Qwen2ForCausalLM.from_pretrained` loads.

    `model_or_state_dict` is our Qwen2 module, a state dict with our names, or an iterator of
    (our name, full tensor) pairs (how a sharded trainer streams gathered tensors; only one shard's
    tensors are held at a time). `args` is required unless a module is given. Tensors are stored in
    their own dtype, on CPU. Above `max_shard_bytes` the tensors are split into
    `model-0000k-of-0000n.safetensors` files with a `model.safetensors.index.json`; otherwise one
    `model.safetensors`. Names and shapes are checked against `args` as they arrive and again at the
    end; on any mismatch nothing is left behind. Older model files in `path` are replaced.
    """
    if args is None:
        if not isinstance(model_or_state_dict, Qwen2):
            raise ValueError("save_hf needs `args` when given a state dict or an iterator of tensors")
        args = model_or_state_dict.args
    want = hf_shapes(args)

    os.makedirs(path, exist_ok=True)
    written: list[tuple[str, list[str]]] = []  # (temporary file, HF names in it), in order, for `_publish`
    dtype: torch.dtype | None = None  # the first tensor's: config.json's torch_dtype
    total_bytes = 0
    try:
        for shard in split_into_shards(_checked_tensors(model_or_state_dict, want, path), max_shard_bytes):
            tmp = os.path.join(path, f".tmp-shard-{len(written):05d}.safetensors")
            _save_shard(shard, tmp)
            written.append((tmp, list(shard)))
            dtype = dtype or next(iter(shard.values())).dtype
            total_bytes += sum(tensor.numel() * tensor.element_size() for tensor in shard.values())
    except BaseException:
        for tmp, _ in written:  # a failed save leaves nothing behind
            if os.path.exists(tmp):
                os.remove(tmp)
        raise

    assert dtype is not None  # every tensor of `want` arrived (checked above), so the dtype is known
    _publish(path, written, total_bytes)
    write_hf_config(path, args, dtype)


def _checked_tensors(
    source: TensorSource, want: dict[str, torch.Size], path: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, plain CPU tensor) of each tensor of `source` the model needs (`want`: HF name -> shape), as it
    arrives; at the end, before save_hf writes the last shard, a CheckpointError names every mismatch."""
    given: dict[str, torch.Size] = {}  # {HF name: shape} of each tensor the model needs, as it arrived
    unexpected, repeated = [], []
    for name, tensor in named_tensors(source):
        hf_name = to_hf_name(name) if is_our_name(name) else None
        if hf_name not in want:
            unexpected.append(name)
        elif hf_name in given:
            repeated.append(name)
        else:
            given[hf_name] = tensor.shape
            if tensor.shape == want[hf_name]:
                yield hf_name, _plain_cpu(name, tensor)
    missing = [from_hf_name(n) for n in want.keys() - given.keys()]
    misshaped = [(from_hf_name(n), shape, want[n]) for n, shape in given.items() if shape != want[n]]
    if missing or unexpected or misshaped or repeated:
        report = _mismatch_report(f"tensors given to save_hf for {path}", missing, unexpected, misshaped)
        raise CheckpointError(report + (f"\n  given more than once: {sorted(repeated)}" if repeated else ""))


def _save_shard(shard: dict[str, torch.Tensor], tmp: str) -> None:
    """One safetensors file; a failure to write it is the OSError it is (safetensors names an OS error in its
    message only: "... (os error 28)")."""
    from safetensors.torch import save_file

    try:
        save_file(shard, tmp, metadata={"format": "pt"})
    except Exception as exc:
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), tmp) from exc


def _publish(path: str, written: list[tuple[str, list[str]]], total_bytes: int) -> None:
    """Give the temporary weight files (file, HF names in it) their final names, replacing an older
    checkpoint's, and write the index when there is more than one."""
    n = len(written)
    final = [SINGLE_FILE] if n == 1 else [shard_file_name(i + 1, n) for i in range(n)]
    remove_model_files(path, keep=final)
    umask = os.umask(0o022)
    os.umask(umask)
    for (tmp, _), name in zip(written, final):
        os.chmod(tmp, 0o666 & ~umask)  # safetensors writes 0600: readable as every other file of the export
        os.replace(tmp, os.path.join(path, name))
    if n > 1:
        index = {
            "metadata": {"total_size": total_bytes},
            "weight_map": {t: name for (_, names), name in zip(written, final) for t in names},
        }
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)


def remove_model_files(path: str, keep: Collection[str] = ()) -> None:
    """Delete the weight files and index of an older checkpoint in `path` (all but `keep`); other files stay."""
    for name in os.listdir(path):
        if is_model_file(name) and name not in keep:
            os.remove(os.path.join(path, name))


# ---------------------------------------------------------------------------------------------------
# Tokenizer and generation settings of an export
# ---------------------------------------------------------------------------------------------------


def _id_list(value: Any) -> list[int]:  # a JSON value: an id, a list of ids or null
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


@contextlib.contextmanager
def exporting(path: str) -> Iterator[None]:
    """Writes of an export into `path`: one that fails for a reason a person can fix (errors.py `writing`: a full
    disk, a read-only folder) removes the folder, so no half export is left (a rerun exports again)."""
    try:
        with writing(path):
            yield
    except WriteError:
        shutil.rmtree(path, ignore_errors=True)
        raise


def complete_hf_export(path: str, tokenizer: Tokenizer, model_source: str | None = None) -> None:
    """Add to the checkpoint in `path` (config.json + weights) what makes it generate as training did.

    - the tokenizer's files (`tokenizer.save`: transformers' save_pretrained, with the chat template it renders);
    - config.json: bos_token_id = tokenizer.bos_id, eos_token_id = tokenizer.eos_id (Qwen2.5's convention);
    - generation_config.json: eos_token_id = tokenizer.stop_ids, the ids the policy ends a turn with (a
      list, as Qwen2.5's releases write it), with bos_token_id and pad_token_id. No sampling settings: a
      plain `generate` decodes greedily. When `model_source` (the checkpoint training started from) has a
      generation_config.json it is carried instead: unchanged when its eos ids already include every stop
      id, otherwise with the missing stop ids appended to them.
    """
    with exporting(path):
        tokenizer.save(path)
        config_path = os.path.join(path, CONFIG_NAME)
        config = read_json(config_path)
        config["bos_token_id"], config["eos_token_id"] = tokenizer.bos_id, tokenizer.eos_id
        write_json(config_path, config)

        out = os.path.join(path, GENERATION_CONFIG_NAME)
        source = os.path.join(model_source, GENERATION_CONFIG_NAME) if model_source else None
        if source and os.path.isfile(source):
            carried = read_json(source)
            eos = _id_list(carried.get("eos_token_id"))
            missing = [i for i in tokenizer.stop_ids if i not in eos]
            if not missing:
                if os.path.abspath(source) != os.path.abspath(out):
                    shutil.copyfile(source, out)
                return
            carried["eos_token_id"] = eos + missing
            write_json(out, carried)
            return
        write_json(
            out,
            {
                "bos_token_id": tokenizer.bos_id,
                "eos_token_id": list(tokenizer.stop_ids),
                "pad_token_id": tokenizer.pad_id,
            },
        )
