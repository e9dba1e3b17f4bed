"""Contract with sglang 0.5.21's own pure-Python pieces: our weight payloads and engine arguments, read by
SGLang's FlattenedTensorBucket, MultiprocessingSerializer (its SafeUnpickler) and ServerArgs, and the rules of
tests/sglang_model.py and preflight/sglang_memory.py that SGLang's code can check directly. Skipped where sglang
does not import (it needs a GPU build for everything else); on CPU it imports in a separate environment with
`pip install --no-deps sglang==0.5.21` plus the light packages its imports name (orjson, psutil, pybase64,
requests, triton, starlette, msgspec, pyzmq, IPython, aiohttp), e.g. run this file with that environment's
python."""

import ast
import functools
import importlib.util
import os

import pytest
import torch

try:
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.common import SafeUnpickler, normalize_serialized_named_tensor_payloads
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
except Exception as e:  # ImportError, or a GPU-only dependency failing at import
    pytest.skip(f"sglang's pure-Python pieces do not import here ({type(e).__name__}: {e})", allow_module_level=True)

from model.args import PRESETS
from model.hf import save_hf
from model.hf_adapter import to_hf_name
from model.qwen2 import build_model
from rollout.engine_process import EngineProcess
from rollout.sglang_engine import SGLangEngine, check_sglang_version

ARGS = PRESETS["tiny"]


class _Launched(SGLangEngine):
    def _launch(self, **kwargs):
        self.launch_kwargs = kwargs
        return object()


def test_installed_release_is_the_pinned_one():
    check_sglang_version()


def _cuda_only(*args):
    raise AssertionError("SGLang's CUDA reduction patch applied to CPU tensors: they no longer pickle")


def test_payloads_are_what_sglangs_tp_ranks_read(monkeypatch):
    # SGLang's CUDA reduction patch (device UUIDs in IPC handles) handles CUDA tensors only and breaks the
    # pickling of CPU tensors (SGLang's CPU backend), which travel through torch's shared-memory reductions.
    import sglang.srt.utils.patch_torch as patch_torch

    monkeypatch.setattr(patch_torch, "monkey_patch_torch_reductions", _cuda_only)
    model = build_model(ARGS, seed=3)
    bucket = [(to_hf_name(n), p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()][:5]
    engine = SGLangEngine.__new__(SGLangEngine)
    payloads, keep_alive = engine._serialize_bucket(bucket, copies=2)
    assert len(payloads) == 2 and payloads[0] != payloads[1]  # one serialization per TP rank
    # What the tokenizer manager and TpModelWorker.deserialize_own_rank do with entry i:
    for raw in normalize_serialized_named_tensor_payloads(payloads):
        payload = MultiprocessingSerializer.deserialize(raw)
        rebuilt = FlattenedTensorBucket(
            flattened_tensor=payload["flattened_tensor"], metadata=payload["metadata"]
        ).reconstruct_tensors()
        assert [n for n, _ in rebuilt] == [n for n, _ in bucket]
        for (_, got), (_, want) in zip(rebuilt, bucket):
            assert got.dtype == want.dtype and torch.equal(got, want)
    del keep_alive


def test_engine_arguments_are_server_args(tmp_path):
    save_hf(build_model(ARGS, seed=0), str(tmp_path))
    engine = _Launched(str(tmp_path), tp_size=2, mem_fraction_static=0.7, dtype="bfloat16", context_length=512)
    server_args = ServerArgs(**engine.launch_kwargs)  # an unknown keyword would be a TypeError
    assert (server_args.tp_size, server_args.mem_fraction_static, server_args.context_length) == (2, 0.7, 512)
    assert server_args.enable_memory_saver and server_args.skip_tokenizer_init
    assert server_args.dtype == "bfloat16" and server_args.model_path == str(tmp_path)
    # SGLang's CPU backend: no memory saver (CUDA only), the KV pool capped, torch's attention for head size 16.
    engine = _Launched(str(tmp_path), dtype="bfloat16", context_length=512, device="cpu", max_batch_size=4)
    server_args = ServerArgs(**engine.launch_kwargs)
    assert (server_args.device, server_args.enable_memory_saver, server_args.max_total_tokens) == ("cpu", False, 2048)
    assert server_args.attention_backend == "torch_native"


def sglang_reads(entries: list) -> list[list[tuple[str, torch.Tensor]]]:
    """What SGLang's TP ranks do with the payloads of one update_weights_from_tensor call: normalize them
    (Engine._serialize_tensors_per_rank), MultiprocessingSerializer.deserialize each (SafeUnpickler:
    BaseTpWorker.deserialize_own_rank), read every metadata item by attribute into a FlattenedTensorMetadata
    and rebuild the tensors (weight_updater.py _update_weights_from_flattened_bucket)."""
    out = []
    for raw in normalize_serialized_named_tensor_payloads(entries):
        payload = MultiprocessingSerializer.deserialize(raw)
        metadata = [
            FlattenedTensorMetadata(
                name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel
            )
            for m in payload["metadata"]
        ]
        out.append(
            FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"], metadata=metadata).reconstruct_tensors()
        )
    return out


class Receiver:
    """An engine process's target that reads weight payloads with SGLang's own code, in that process."""

    def __init__(self, **server_args):
        import sglang.srt.utils.patch_torch as patch_torch

        patch_torch.monkey_patch_torch_reductions = lambda: None  # CPU tensors: torch's own reductions

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        return [[(name, tensor.clone()) for name, tensor in rank] for rank in sglang_reads(named_tensors)]

    def shutdown(self):
        pass


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_payload_we_send_is_read_by_sglangs_deserialiser_in_the_engine_process(monkeypatch, dtype):
    """Every engine dtype (rollout.dtype), as str payloads (output_str=True), through the engine process's pipe."""
    import sglang.srt.utils.patch_torch as patch_torch

    monkeypatch.setattr(patch_torch, "monkey_patch_torch_reductions", _cuda_only)
    model = build_model(ARGS, seed=3)
    bucket = [(to_hf_name(n), p.detach().to(dtype)) for n, p in model.named_parameters()]
    engine = SGLangEngine.__new__(SGLangEngine)
    payloads, keep_alive = engine._serialize_bucket(bucket, copies=2)
    assert all(isinstance(p, str) for p in payloads)
    process = EngineProcess(Receiver, {})
    try:
        ranks = process.call(
            "update_weights_from_tensor", named_tensors=payloads, load_format="flattened_bucket", deadline_s=60
        )
    finally:
        process.close()
    for rebuilt in ranks:
        assert [n for n, _ in rebuilt] == [n for n, _ in bucket]
        for (_, got), (_, want) in zip(rebuilt, bucket):
            assert got.dtype == want.dtype and torch.equal(got, want)
    del keep_alive


def test_the_strict_models_rules_are_sglangs():
    import sglang.srt.utils as sglang_utils
    from sglang.srt.model_executor.cuda_graph_config import Backend, default_cuda_graph_config
    from sglang_model import ALLOWED_GLOBALS

    from preflight.sglang_memory import prefill_cuda_graph_sizes

    # The model's unpickler allows a subset of SafeUnpickler's list: it refuses all SGLang refuses.
    assert ALLOWED_GLOBALS <= SafeUnpickler.ALLOWED_GLOBALS
    # Prefill graphs are on by default on CUDA (breakable), and decode graphs everywhere (full).
    sglang_utils.is_cuda, is_cuda = (lambda: True), sglang_utils.is_cuda
    try:
        config = default_cuda_graph_config()
    finally:
        sglang_utils.is_cuda = is_cuda
    assert (config.decode.backend, config.prefill.backend) == (Backend.FULL, Backend.BREAKABLE)
    generate = _sglang_function("srt/arg_groups/cuda_graph_hook.py", "generate_prefill_cuda_graph_batch_sizes")
    for max_tokens in (2048, 4096, 8192, 16384):
        assert prefill_cuda_graph_sizes(max_tokens) == generate(max_tokens), max_tokens


@functools.cache
def _sglang_function(path: str, name: str):
    """A pure function of the installed sglang, compiled alone from its source (its module imports GPU-only
    packages)."""
    root = importlib.util.find_spec("sglang").submodule_search_locations[0]
    source = open(os.path.join(root, path)).read()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
    return namespace[name]
