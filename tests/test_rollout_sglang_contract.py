"""Contract with sglang 0.5.21's own pure-Python pieces: our weight payloads and engine arguments, read by
SGLang's FlattenedTensorBucket, MultiprocessingSerializer and ServerArgs. Skipped where sglang does not
import (it needs a GPU build for everything else); on CPU it imports in a separate environment with
`pip install --no-deps sglang==0.5.21` plus the light packages its imports name, e.g. run this file with
that environment's python."""

import pytest
import torch

try:
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
except Exception as e:  # ImportError, or a GPU-only dependency failing at import
    pytest.skip(f"sglang's pure-Python pieces do not import here ({type(e).__name__}: {e})", allow_module_level=True)

from model.args import PRESETS
from model.hf import save_hf
from model.hf_adapter import to_hf_name
from model.qwen2 import build_model
from rollout.sglang_engine import SGLangEngine, check_sglang_version

ARGS = PRESETS["tiny"]


class _Launched(SGLangEngine):
    def _launch(self, **kwargs):
        self.launch_kwargs = kwargs
        return object()


def test_installed_release_is_the_pinned_one():
    check_sglang_version()


def test_payloads_are_what_sglangs_tp_ranks_read(monkeypatch):
    # SGLang's CUDA reduction patch (device UUIDs in IPC handles) handles CUDA tensors only; CPU tensors
    # here travel through torch's ordinary shared-memory reductions.
    import sglang.srt.utils.patch_torch as patch_torch

    monkeypatch.setattr(patch_torch, "monkey_patch_torch_reductions", lambda: None)
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
