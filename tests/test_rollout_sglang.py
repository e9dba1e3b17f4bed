"""rollout/sglang_engine.py without a GPU: output translation, sampling params, version pin, and the
engine's protocol state machine driven against a recording backend that enforces SGLang 0.5.21's rules
(update_weights_from_tensor only inside begin/end_weight_update, released weights must be resumed
before loading). The real engine is exercised by the `sglang`-marked test and bench/sglang_smoke.py."""

import importlib.util
import os

import pytest
import torch

from model.args import PRESETS
from model.hf import save_hf, to_hf_name
from model.qwen2 import build_model
from rollout.engine import Completion, SamplingParams
from rollout.sglang_engine import (
    SGLANG_VERSION,
    SGLangEngine,
    check_sglang_version,
    completions_from_sglang,
    context_length_for,
    sglang_sampling_params,
    split_by_counts,
)
from rollout.weight_sync import sync_weights

from dist_utils import run_ranks

ARGS = PRESETS["tiny"]


def _out(ids, logprobs, reason, output_ids=None):
    """An output dict as SGLang 0.5.21's Engine.generate returns it with skip_tokenizer_init=True."""
    return {
        "output_ids": list(ids if output_ids is None else output_ids),
        "meta_info": {
            "id": "r",
            "finish_reason": reason,
            "prompt_tokens": 3,
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, ids)],
            "output_token_logprobs_length": len(ids),
        },
    }


def test_completions_from_sglang_outputs():
    outputs = [
        _out([5, 6, 2], [-0.1, -0.2, -0.3], {"type": "stop", "matched": 2}),
        _out([7, 8], [-1.0, -2.0], {"type": "length", "length": 2}),
        # A stop token trimmed from output_ids (no_stop_trim unset) is restored from the log-prob entries.
        _out([9, 2], [-0.5, -0.25], {"type": "stop", "matched": 2}, output_ids=[9]),
        _out([], [], {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}),
    ]
    got = completions_from_sglang(outputs, num_prompts=2, n=2)
    assert got == [
        Completion(0, 0, [5, 6, 2], [-0.1, -0.2, -0.3], "stop"),
        Completion(0, 1, [7, 8], [-1.0, -2.0], "length"),
        Completion(1, 0, [9, 2], [-0.5, -0.25], "stop"),
        Completion(1, 1, [], [], "abort"),
    ]


def test_completions_from_sglang_refuses_inconsistent_outputs():
    with pytest.raises(ValueError, match="returned 1 outputs for 1 prompts x 2 samples"):
        completions_from_sglang([_out([1], [-1.0], {"type": "length"})], 1, 2)
    with pytest.raises(ValueError, match="disagree"):
        completions_from_sglang([_out([1, 2], [-1.0, -1.0], {"type": "length"}, output_ids=[1])], 1, 1)
    with pytest.raises(ValueError, match="finish_reason"):
        completions_from_sglang([_out([1], [-1.0], None)], 1, 1)
    with pytest.raises(ValueError, match="SGLang output 0: the model produced NaN logits"):
        completions_from_sglang([_out([7], [float("nan")], {"type": "stop", "matched": "NaN happened"},
                                      output_ids=[2])], 1, 1)
    no_logprobs = {"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}}
    with pytest.raises(ValueError, match="return_logprob"):
        completions_from_sglang([no_logprobs], 1, 1)


def test_sampling_params_translation():
    params = SamplingParams(max_new_tokens=7, temperature=0.6, top_p=0.9, top_k=20, n=4, stop_token_ids=[2, 3])
    assert sglang_sampling_params(params) == {"max_new_tokens": 7, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                              "n": 4, "no_stop_trim": True, "stop_token_ids": [2, 3]}
    assert "stop_token_ids" not in sglang_sampling_params(SamplingParams(max_new_tokens=1))


def test_version_pin():
    check_sglang_version(SGLANG_VERSION)
    with pytest.raises(RuntimeError, match=r"sglang 0\.5\.20 is installed.*sglang==0\.5\.21"):
        check_sglang_version("0.5.20")


def test_split_by_counts():
    assert split_by_counts([1, 2, 3, 4, 5], [2, 0, 3]) == [[1, 2], [], [3, 4, 5]]
    with pytest.raises(ValueError):
        split_by_counts([1, 2], [1])


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_missing_sglang_is_a_clear_error(tmp_path):
    save_hf(build_model(ARGS, seed=0), str(tmp_path))
    with pytest.raises(ImportError, match="requirements-gpu.txt"):
        SGLangEngine(str(tmp_path))


# ---------------------------------------------------------------------------------------------------
# Protocol state machine against a recording backend
# ---------------------------------------------------------------------------------------------------


class _RecordingBackend:
    """Answers like sglang.Engine 0.5.21 and records the calls; loads weights into a torch model."""

    def __init__(self, model, tp_size, context_length):
        self.model, self.tp_size, self.context_length = model, tp_size, context_length
        self.calls, self.session, self.released = [], False, set()
        self.max_new_tokens = []

    def begin_weight_update(self):
        self.calls.append("begin")
        if self.session:
            return False, "a weight-update session is already open"
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append("end")
        if not self.session:
            return False, "no weight-update session is open"
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append("update")
        assert load_format == "flattened_bucket" and flush_cache is False and len(named_tensors) == self.tp_size
        # One serialization per TP rank: each CUDA IPC reference is released by exactly one rank.
        assert all(isinstance(p, _Serialized) for p in named_tensors)
        assert len({p.number for p in named_tensors}) == self.tp_size
        if not self.session:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        if "weights" in self.released:
            return False, "weights are released"
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for hf_name, tensor in named_tensors[0].payload:
                params[hf_name[len("model."):] if hf_name.startswith("model.") else hf_name].copy_(tensor)
        return True, "Success"

    def flush_cache(self):
        self.calls.append("flush")

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tuple(tags or ())))
        self.released = set(tags or ("kv_cache", "weights", "cuda_graph"))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tuple(tags)))
        self.released -= set(tags)

    def generate(self, input_ids, sampling_params, return_logprob):
        self.calls.append("generate")
        assert return_logprob and not self.released
        assert isinstance(sampling_params, list) and len(sampling_params) == len(input_ids)
        n = sampling_params[0]["n"]
        assert all(sp["n"] == n for sp in sampling_params)  # SGLang requires one n for the batch
        for prompt, sp in zip(input_ids, sampling_params):  # what SGLang 0.5.21 refuses for the whole batch
            if len(prompt) >= self.context_length - 6 or len(prompt) + sp["max_new_tokens"] > self.context_length:
                raise ValueError(f"prompt of {len(prompt)} tokens + {sp['max_new_tokens']} new exceeds the context")
        self.max_new_tokens.append([sp["max_new_tokens"] for sp in sampling_params])
        return [_out([len(p), s], [-1.0, -2.0], {"type": "length"}) for p in input_ids for s in range(n)]

    def shutdown(self):
        self.calls.append("shutdown")


class _Serialized:
    """Stands for one serialized payload; numbered so the recorder can tell serializations apart."""

    count = 0

    def __init__(self, payload):
        _Serialized.count += 1
        self.payload, self.number = payload, (os.getpid(), _Serialized.count)  # ranks are processes


class _EngineOnRecorder(SGLangEngine):
    def _launch(self, **kwargs):
        assert kwargs["enable_memory_saver"] and kwargs["skip_tokenizer_init"] and kwargs["dtype"] == "float32"
        return _RecordingBackend(build_model(ARGS, seed=1), kwargs["tp_size"], kwargs["context_length"])

    def _flatten_bucket(self, bucket):
        return list(bucket), None  # the recorder reads tensors directly; no CUDA IPC on CPU

    def _serialize(self, payload):
        return _Serialized(payload)


@pytest.fixture
def checkpoint(tmp_path):
    save_hf(build_model(ARGS, seed=0), str(tmp_path))
    return str(tmp_path)


def test_memory_and_weight_update_protocol(checkpoint):
    engine = _EngineOnRecorder(checkpoint, tp_size=2, dtype=torch.float32)
    backend = engine._engine
    engine.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    trainer = build_model(ARGS, seed=5)
    named = [(to_hf_name(n), p.detach()) for n, p in trainer.named_parameters()]
    engine.update_weights(named[:4])
    with pytest.raises(RuntimeError, match=r"weights were not pushed again"):
        engine.resume_memory()  # only 4 of the weights arrived: the engine would serve garbage
    sync_weights(trainer, engine, bucket_bytes=50_000)
    engine.resume_memory()
    # The CUDA graphs are kept (trainer/rehearsal.py ledger: they cost ~1 GB of training-phase headroom).
    assert backend.calls[:4] == [("release", ("kv_cache", "weights")), ("resume", ("weights",)), "begin", "update"]
    assert backend.calls[-3:] == ["end", "flush", ("resume", ("kv_cache",))]
    assert "begin" not in backend.calls[4:]  # one session for all buckets
    for (n, p), (_, q) in zip(backend.model.named_parameters(), trainer.named_parameters()):
        assert torch.equal(p, q), n
    # Updates without a release (weights stay resident) are closed by the next generate.
    engine.update_weights(named[:2])
    out = engine.generate([[1, 2, 3], [4]], SamplingParams(max_new_tokens=2, n=2))
    assert backend.calls[-4:] == ["update", "end", "flush", "generate"]
    assert [(c.prompt_index, c.sample_index, c.token_ids) for c in out] == [
        (0, 0, [3, 0]), (0, 1, [3, 1]), (1, 0, [1, 0]), (1, 1, [1, 1])]
    engine.shutdown()
    assert backend.calls[-1] == "shutdown"


def test_long_prompts_get_capped_budgets_instead_of_failing_the_batch(checkpoint):
    engine = _EngineOnRecorder(checkpoint, dtype=torch.float32, context_length=16)
    prompts = [[1] * 3, [2] * 9]  # 9 = 16 - PROMPT_MARGIN: the longest prompt SGLang accepts here
    out = engine.generate(prompts, SamplingParams(max_new_tokens=10, n=2))
    assert engine._engine.max_new_tokens == [[10, 16 - 2 - 9]]  # capped: ends with finish reason "length"
    assert [c.prompt_index for c in out] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"prompt 1 has 10 tokens, longer than the engine's context allows \(9"):
        engine.generate([[1], [2] * 10], SamplingParams(max_new_tokens=1))
    # The context train.py asks for gives the longest prompt its whole budget.
    engine = _EngineOnRecorder(checkpoint, dtype=torch.float32, context_length=context_length_for(9, 10))
    engine.generate([[2] * 9], SamplingParams(max_new_tokens=10))
    assert engine._engine.max_new_tokens == [[10]]
    assert context_length_for(9, 1) == 9 + 7  # short budgets still leave SGLang's prompt margin


def test_bad_bucket_is_refused_before_sending(checkpoint):
    engine = _EngineOnRecorder(checkpoint, dtype="float32")  # dtype names from config files work too
    assert engine.dtype is torch.float32
    with pytest.raises(ValueError, match="dtype must be one of"):
        _EngineOnRecorder(checkpoint, dtype="int8")
    good = ("model.norm.weight", torch.ones(ARGS.hidden_size))
    for message, bucket in {
        "unknown weight": [good, ("model.layers.7.mlp.up_proj.weight", torch.zeros(1))],
        "has shape": [good, ("model.layers.0.input_layernorm.weight", torch.ones(ARGS.hidden_size + 1))],
        "has dtype": [("model.norm.weight", torch.ones(ARGS.hidden_size, dtype=torch.bfloat16))],
        "appears twice": [good, good],
    }.items():
        with pytest.raises((KeyError, ValueError), match=message):
            engine.update_weights(bucket)
    assert engine._engine.calls == []
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([[]], SamplingParams(max_new_tokens=2))


def _group_worker(rank, world, checkpoint):
    import torch.distributed as dist

    engine = _EngineOnRecorder(checkpoint, tp_size=world, dtype=torch.float32, group=dist.group.WORLD)
    assert (engine._engine is not None) == (rank == 0)  # only the leader starts SGLang
    prompts = [[[1, 2, 3]], [[4], [5, 6]]][rank]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=2, n=2))
    # The recorder answers [len(prompt), sample]: each rank gets its own prompts back, indexed from 0.
    assert [(c.prompt_index, c.sample_index, c.token_ids) for c in out] == [
        (i, s, [len(p), s]) for i, p in enumerate(prompts) for s in range(2)]
    engine.release_memory()
    trainer = build_model(ARGS, seed=5)
    sync_weights(trainer, engine, bucket_bytes=50_000)
    engine.resume_memory()
    if rank == 0:
        for (n, p), (_, q) in zip(engine._engine.model.named_parameters(), trainer.named_parameters()):
            assert torch.equal(p, q), n
    # A bad prompt on one rank fails the call on every rank instead of hanging the others.
    bad = [[1]] if rank == 0 else [[]]
    with pytest.raises(RuntimeError, match="rank 1: ValueError: prompt 0 is empty"):
        engine.generate(bad, SamplingParams(max_new_tokens=2))
    return len(out)


@pytest.mark.multiprocess
def test_group_of_two_ranks_shares_one_engine(checkpoint):
    assert run_ranks(_group_worker, 2, checkpoint) == [2, 4]


# ---------------------------------------------------------------------------------------------------
# The real thing (GPU machines with requirements-gpu.txt)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.sglang
@pytest.mark.gpu
def test_sglang_engine_generates_and_updates_weights(tmp_path):
    from bench.sglang_smoke import run_smoke

    result = run_smoke(str(tmp_path))
    assert result["logprob_max_abs_diff_before"] < 0.05
    assert result["logprob_max_abs_diff_after"] < 0.05
    assert result["greedy_changed_after_update"]
