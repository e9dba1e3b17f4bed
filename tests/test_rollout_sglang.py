"""rollout/sglang_engine.py without a GPU: output translation, sampling params, version pin, and the
engine's protocol driven against tests/sglang_model.py, a strict model of sglang 0.5.21 (memory tags,
idle rule, weight-update sessions, one payload per TP rank and how it is read, the KV pool sized from free
memory), single process and on gloo ranks. Here the model is hosted in the test's process (InThisProcess)
and its crashes are recorded instead of ending that process; tests/test_rollout_sglang_process.py runs it
in its own process, as the trainer runs SGLang. The real engine is exercised by tests/test_rollout_sglang_engine.py
and bench/sglang_smoke.py."""

import base64
import importlib.util
import pickle
import signal
import time

import pytest
import torch
from dist_utils import GlooRanks, run_ranks
from engines import generate
from sglang_model import (
    MIB,
    FakeGPU,
    InThisProcess,
    StrictSGLang,
    chain,
    deserialize,
    flatten_bucket,
    install_cuda_ipc_model,
    serialize,
)

from data.prompts import PromptExample
from evaluation.evaluate import score_completions
from model.args import PRESETS, num_params
from model.hf import save_hf
from model.hf_adapter import to_hf_name
from model.qwen2 import build_model
from rollout.engine import Completion, SamplingParams
from rollout.sglang_engine import SGLANG_VERSION, SGLangEngine, check_sglang_version, context_length_for
from rollout.sglang_groups import GroupRunner, completions_from_sglang, sglang_sampling_params
from rollout.weight_sync import iter_weight_buckets, sync_weights
from run.guard import GuardedEngine

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
        completions_from_sglang(
            [_out([7], [float("nan")], {"type": "stop", "matched": "NaN happened"}, output_ids=[2])], 1, 1
        )
    no_logprobs = {"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}}
    with pytest.raises(ValueError, match="return_logprob"):
        completions_from_sglang([no_logprobs], 1, 1)


def test_sampling_params_translation():
    params = SamplingParams(max_new_tokens=7, temperature=0.6, top_p=0.9, top_k=20, n=4, stop_token_ids=[2, 3])
    # n is not SGLang's: each prompt is sent n times with n = 1 (see test_n_samples_are_sent_as_repeated_prompts).
    assert sglang_sampling_params(params) == {
        "max_new_tokens": 7,
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "no_stop_trim": True,
        "stop_token_ids": [2, 3],
    }
    assert "stop_token_ids" not in sglang_sampling_params(SamplingParams(max_new_tokens=1))


def test_version_pin():
    check_sglang_version(SGLANG_VERSION)
    with pytest.raises(RuntimeError, match=r"sglang 0\.5\.20 is installed.*sglang==0\.5\.21"):
        check_sglang_version("0.5.20")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_missing_sglang_is_a_clear_error(tmp_path):
    save_hf(build_model(ARGS, seed=0), str(tmp_path))
    with pytest.raises(ImportError, match="requirements-gpu.txt"):
        SGLangEngine(str(tmp_path))


# ---------------------------------------------------------------------------------------------------
# The engine's protocol against the strict model of sglang 0.5.21 (tests/sglang_model.py)
# ---------------------------------------------------------------------------------------------------


class Crashed(Exception):
    """What the strict model's scheduler raised; in SGLang it ends the engine's process (see `crashes`)."""


@pytest.fixture(autouse=True)
def crashes(monkeypatch):
    """The model hosted in this process records a crash as Crashed instead of ending the process, and the
    signal handlers it installs (SIGQUIT at start, SIGTERM at the first request) are put back afterwards."""

    def crash(self, error):
        raise Crashed(f"{type(error).__name__}: {error}")

    monkeypatch.setattr(StrictSGLang, "_die", crash)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGQUIT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def engine_class(trainer_gpu=None, **model_options):
    """SGLangEngine whose sglang.Engine is the strict model (in this process) and whose CUDA IPC payloads
    are CPU stand-ins."""

    class Engine(SGLangEngine):
        def _launch(self, **kwargs):
            assert kwargs["skip_tokenizer_init"] and kwargs["enable_memory_saver"] == (kwargs.get("device") != "cpu")
            return InThisProcess(GroupRunner(StrictSGLang(**model_options, **kwargs)))

        def _flatten_bucket(self, bucket):
            return flatten_bucket(bucket, trainer_gpu)

        def _serialize(self, payload):
            return serialize(payload)

    return Engine


def _named(model):
    return [(to_hf_name(n), p.detach()) for n, p in model.named_parameters()]


def _assert_holds(sglang, model):
    for (n, p), (_, q) in zip(sglang.model.named_parameters(), model.named_parameters()):
        assert torch.equal(p, q), n


@pytest.fixture
def checkpoint(tmp_path):
    save_hf(build_model(ARGS, seed=0), str(tmp_path))
    return str(tmp_path)


def test_memory_and_weight_update_protocol(checkpoint):
    engine = engine_class()(checkpoint, tp_size=2, dtype=torch.float32)
    sglang = engine._engine
    engine.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.submit([[1, 2]], SamplingParams(max_new_tokens=2))
    trainer = build_model(ARGS, seed=5)
    engine.update_weights(_named(trainer)[:4])
    with pytest.raises(RuntimeError, match=r"weights were not pushed again"):
        engine.resume_memory()  # only 4 of the weights arrived: the engine would serve garbage
    sync_weights(trainer, engine, bucket_bytes=50_000)
    engine.resume_memory()
    # The CUDA graphs are kept (the rehearsal's ledger: releasing them frees ~1 GB that training does not need).
    assert sglang.calls[:5] == [
        "flush",
        ("release", ("kv_cache", "weights")),
        ("resume", ("weights",)),
        "begin",
        "update",
    ]
    assert sglang.calls[-3:] == ["end", "flush", ("resume", ("kv_cache",))]
    assert "begin" not in sglang.calls[4:]  # one session for all buckets
    _assert_holds(sglang, trainer)
    # Updates without a release (weights stay resident) are closed by the next submit.
    engine.update_weights(_named(trainer)[:2])
    out = generate(engine, [[1, 2, 3], [4]], SamplingParams(max_new_tokens=2, n=2))
    assert sglang.calls[-5:] == ["update", "end", "flush", "async_generate", "async_generate"]  # a batch a prompt
    assert [(c.prompt_index, c.sample_index, c.token_ids) for c in out] == [
        (0, 0, chain(3, 2)[0]),
        (0, 1, chain(3, 2)[0]),
        (1, 0, chain(4, 2)[0]),
        (1, 1, chain(4, 2)[0]),
    ]
    engine.shutdown()
    assert sglang.calls[-1] == "shutdown"


def test_long_prompts_get_capped_budgets_instead_of_failing_the_batch(checkpoint):
    engine = engine_class()(checkpoint, dtype=torch.float32, context_length=16)
    prompts = [[1] * 3, [2] * 9]  # 9 = 16 - PROMPT_MARGIN: the longest prompt SGLang accepts here
    out = generate(engine, prompts, SamplingParams(max_new_tokens=10, n=2))
    cap = 16 - 2 - 9  # capped: ends with finish reason "length"
    assert engine._engine.max_new_tokens == [[10, 10], [cap, cap]]
    assert [(c.prompt_index, len(c.token_ids), c.finish_reason) for c in out[1::2]] == [
        (0, 10, "length"),
        (1, cap, "length"),
    ]
    with pytest.raises(ValueError, match=r"prompt 1 has 10 tokens, longer than the engine's context allows \(9"):
        engine.submit([[1], [2] * 10], SamplingParams(max_new_tokens=1))
    # The context train.py asks for gives the longest prompt its whole budget.
    engine = engine_class()(checkpoint, dtype=torch.float32, context_length=context_length_for(9, 10))
    generate(engine, [[2] * 9], SamplingParams(max_new_tokens=10))
    assert engine._engine.max_new_tokens == [[10]]
    assert context_length_for(9, 1) == 9 + 7  # short budgets still leave SGLang's prompt margin


def test_bad_bucket_is_refused_before_sending(checkpoint):
    engine = engine_class()(checkpoint, dtype="float32")  # dtype names from config files work too
    assert engine.dtype is torch.float32
    with pytest.raises(ValueError, match="dtype must be one of"):
        engine_class()(checkpoint, dtype="int8")
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
        engine.submit([[]], SamplingParams(max_new_tokens=2))


# -- the strict model's own rules ------------------------------------------------------------------


def _strict(checkpoint, **options):
    launch = dict(
        model_path=checkpoint,
        tp_size=1,
        base_gpu_id=0,
        mem_fraction_static=0.5,
        enable_memory_saver=True,
        skip_tokenizer_init=True,
        dtype="float32",
        random_seed=0,
        context_length=64,
    )
    launch.update(options)
    return StrictSGLang(**launch)


def test_strict_model_memory_tags_and_idle_rule(checkpoint):
    sglang = _strict(checkpoint)
    with pytest.raises(Crashed, match="KeyError"):
        sglang.resume_memory_occupation(["kv_cache"])  # offload_tags.remove of a tag never released
    sglang = _strict(checkpoint)
    sglang.running = 1
    with pytest.raises(Crashed, match="AssertionError: .*only when server is idle"):
        sglang.release_memory_occupation()
    sglang = _strict(checkpoint)
    sglang.release_memory_occupation(["kv_cache"])

    def batch(model, prompts):
        request = model.async_generate(
            input_ids=prompts,
            sampling_params=[{"max_new_tokens": 1, "no_stop_trim": True}] * len(prompts),
            return_logprob=True,
        )
        return model.loop.run_until_complete(request)

    with pytest.raises(Crashed, match="illegal memory access"):
        batch(sglang, [[1]])
    with pytest.raises(ValueError, match="input_ids cannot be empty"):
        batch(_strict(checkpoint), [])
    # The finished requests stay in the last batch for retire_s: flush_cache answers False, a release crashes.
    sglang = _strict(checkpoint, retire_s=0.5)
    batch(sglang, [[1], [2]])
    assert sglang.flush_cache().success is False
    with pytest.raises(Crashed, match="only when server is idle"):
        sglang.release_memory_occupation()
    time.sleep(0.5)
    assert sglang.flush_cache().success is True
    sglang.release_memory_occupation()


def test_strict_model_weight_sessions_and_payloads(checkpoint):
    sglang = _strict(checkpoint, tp_size=2)
    payload, keep = flatten_bucket([("model.norm.weight", torch.zeros(ARGS.hidden_size))])
    two = [serialize(payload), serialize(payload)]
    assert sglang.update_weights_from_tensor(two, load_format="flattened_bucket") == (
        False,
        "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
    )
    assert sglang.end_weight_update()[0] is False
    assert sglang.begin_weight_update() == (True, "Success")
    assert sglang.begin_weight_update()[0] is False
    with pytest.raises(AssertionError, match="never opened"):
        sglang.update_weights_from_tensor(two + [serialize(payload)], load_format="flattened_bucket")
    assert sglang.update_weights_from_tensor(two, load_format="flattened_bucket") == (True, "Success")
    assert torch.equal(sglang.model.norm.weight, torch.zeros(ARGS.hidden_size))
    with pytest.raises(Crashed, match="TP rank 1 has no payload"):
        sglang.update_weights_from_tensor([serialize(payload)], load_format="flattened_bucket")
    sglang = _strict(checkpoint, tp_size=2)
    sglang.begin_weight_update()
    one = serialize(payload)
    with pytest.raises(Crashed, match="opened twice"):
        sglang.update_weights_from_tensor([one, one], load_format="flattened_bucket")


def _pickled(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


class Unlisted:
    """A class of no module SGLang's unpickler allows."""


def test_strict_model_reads_payloads_as_sglang_does(checkpoint):
    """SafeUnpickler allows listed globals only, and the weight updater reads each metadata item by attribute
    (srt/utils/common.py SafeUnpickler, weight_updater.py _update_weights_from_flattened_bucket): the model
    before them unpickled anything and read dict metadata, so it accepted both payloads below."""
    weight = torch.arange(ARGS.hidden_size, dtype=torch.float32)
    payload, keep = flatten_bucket([("model.norm.weight", weight)])
    serial, opened = deserialize(serialize(payload))
    assert [m.name for m in opened["metadata"]] == ["model.norm.weight"]
    as_dicts = dict(payload, metadata=[vars(m) for m in payload["metadata"]])
    unlisted = dict(payload, extra=Unlisted())
    with pytest.raises(RuntimeError, match=r"Blocked unsafe global \(test_rollout_sglang.Unlisted\)"):
        deserialize(_pickled(((0, 0), unlisted)))
    sglang = _strict(checkpoint)
    sglang.begin_weight_update()
    with pytest.raises(Crashed, match="AttributeError: 'dict' object has no attribute 'name'"):
        sglang.update_weights_from_tensor([_pickled(((0, 1), as_dicts))], load_format="flattened_bucket")
    with pytest.raises(Crashed, match="Blocked unsafe global"):
        sglang.update_weights_from_tensor([_pickled(((0, 2), unlisted))], load_format="flattened_bucket")
    # Bytes are taken raw or as base64; anything else is refused (normalize_serialized_named_tensor_payload).
    assert deserialize(serialize(payload).encode())[0] != serial
    with pytest.raises(TypeError, match="base64 strings or bytes-like"):
        deserialize(123)
    assert sglang.update_weights_from_tensor([serialize(payload)], load_format="flattened_bucket")[0]
    assert torch.equal(sglang.model.norm.weight, weight)


def test_a_prompt_sglang_aborts_with_status_400_fails_its_batch(checkpoint):
    """A prompt of max_req_input_len tokens or more is aborted with status 400 (validate_input_length), and a
    non-streaming 400 abort raises ValueError out of its batch (_handle_abort_finish_reason); another abort comes
    back as an output of type "abort", which the engine refuses too."""
    sglang = _strict(checkpoint, context_length=64)
    limit = min(64 - 1, sglang.plan.kv_tokens - 1) - 5

    def batch(prompts):
        request = sglang.async_generate(
            input_ids=prompts,
            sampling_params=[{"max_new_tokens": 1, "no_stop_trim": True}] * len(prompts),
            return_logprob=True,
        )
        return sglang.loop.run_until_complete(request)

    assert batch([[1] * (limit - 1)])[0]["meta_info"]["finish_reason"]["type"] == "length"
    with pytest.raises(ValueError, match=f"Input length \\({limit} tokens\\) exceeds the maximum allowed length"):
        batch([[1], [1] * limit])
    engine = engine_class()(checkpoint, dtype=torch.float32, context_length=64)
    engine.context_length = 10**6  # our own prompt check off: SGLang's is the one that refuses
    engine.submit([[1] * limit], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="exceeds the maximum allowed length"):
        while True:
            engine.poll()
    engine = engine_class(abort={(0, 1)})(checkpoint, dtype=torch.float32)
    engine.submit([[1]], SamplingParams(max_new_tokens=1, n=2))
    with pytest.raises(RuntimeError, match="SGLang aborted a request of rank 0, group 0"):
        while True:
            engine.poll()


def test_strict_model_memory_accounting(checkpoint):
    gpu = FakeGPU(1024 * MIB)  # room for SGLang's CUDA-graph reserve on a GPU this small: 352 MiB
    sglang = _strict(checkpoint, gpus=[gpu], untagged_bytes=MIB)
    plan = sglang.plan
    weights = num_params(ARGS) * 4
    # The KV pool from the free-memory rule: (1023 MiB - weights) - 1023 MiB * 0.5, 2 * 2 * 16 * 2 * 4 bytes a token.
    assert plan.weights == weights
    assert plan.kv_tokens == int(1023 * MIB - weights - 1023 * MIB * 0.5) // 512
    assert gpu.engine == plan.held() and gpu.free == 1024 * MIB - plan.held()
    sglang.release_memory_occupation()
    # Released tags give their memory back; the untagged share and the CUDA graphs (not captured under the
    # memory saver by default) stay.
    assert plan.cuda_graph > 0 and gpu.engine == MIB + plan.cuda_graph
    sglang.resume_memory_occupation(["weights"])
    gpu.trainer = gpu.free - plan.kv_cache + 1  # training left one byte too much behind
    with pytest.raises(Crashed, match="CUDA out of memory"):
        sglang.resume_memory_occupation(["kv_cache", "cuda_graph"])
    # What the trainer still holds when the engine starts comes out of the KV pool.
    crowded = _strict(checkpoint, gpus=[FakeGPU(1024 * MIB, trainer=256 * MIB)], untagged_bytes=MIB)
    assert abs((plan.kv_tokens - crowded.plan.kv_tokens) * 512 - 0.5 * 256 * MIB) <= 512
    with pytest.raises(ValueError, match="leave no memory for the KV cache"):
        _strict(checkpoint, gpus=[FakeGPU(1024 * MIB, trainer=1023 * MIB)], untagged_bytes=MIB // 2)


# -- defects of the SGLang path ---------------------------------------------------------------------


def test_ipc_handles_are_collected_after_each_bucket(checkpoint, monkeypatch):
    """Each bucket sent as CUDA IPC handles stays in torch's IPC limbo until torch.cuda.ipc_collect();
    without it the whole sync is still reserved when the engine maps its KV cache back."""
    install_cuda_ipc_model(monkeypatch)
    gpu = FakeGPU(1024 * MIB)
    engine = engine_class(trainer_gpu=gpu, gpus=[gpu], untagged_bytes=MIB)(
        checkpoint, dtype=torch.float32, mem_fraction_static=0.5
    )
    plan = engine._engine.plan
    engine.release_memory()
    limbo = []
    trainer = build_model(ARGS, seed=5)
    for bucket in iter_weight_buckets(trainer, bucket_bytes=50_000, dtype=torch.float32):
        engine.update_weights(bucket)
        limbo.append(gpu.limbo)
    assert len(limbo) > 3 and max(limbo) == 0
    gpu.trainer = gpu.total - gpu.engine - plan.kv_cache - plan.weights // 2
    engine.resume_memory()  # fits only if at most half the weights' bytes are still in limbo
    _assert_holds(engine._engine, trainer)


def test_engine_refuses_cpu_tensors_when_it_runs_on_a_gpu(checkpoint):
    """SGLang opens CUDA IPC handles: a CPU tensor (an offloaded shard gathered where it lives) is refused."""
    engine = engine_class()(checkpoint, dtype=torch.float32, device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"'model.norm.weight' is on cpu.*move each shard to the GPU"):
        engine.update_weights([("model.norm.weight", torch.ones(ARGS.hidden_size))])
    assert engine._engine.calls == []


def test_n_samples_are_sent_as_repeated_prompts(checkpoint):
    """0.5.21 serves n > 1 by first prefilling each prompt alone, one after another (and warns above 128
    prompts); the engine sends n requests of n = 1 (the model refuses any other), a batch a prompt."""
    engine = engine_class()(checkpoint, dtype=torch.float32)
    prompts = [[1 + i % 200] * (1 + i % 5) for i in range(150)]
    out = generate(engine, prompts, SamplingParams(max_new_tokens=2, n=3))
    assert engine._engine.max_new_tokens == [[2] * 3] * 150
    # Grouped per prompt, in order.
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(150) for s in range(3)]
    assert all(c.token_ids == chain(prompts[c.prompt_index][-1], 2)[0] for c in out)


def test_a_failure_midway_leaves_the_leaders_true_state(checkpoint):
    """The leader resumed the weights and opened a session, then the update failed: the engine's state
    must say so, or the next call resumes a tag that is no longer released (the scheduler dies)."""
    engine = engine_class()(checkpoint, dtype=torch.float32)
    sglang = engine._engine
    engine.release_memory()
    sglang.fail_next["update"] = "injected load failure"
    trainer = build_model(ARGS, seed=5)
    with pytest.raises(RuntimeError, match="injected load failure"):
        engine.update_weights(_named(trainer)[:1])
    sync_weights(trainer, engine, bucket_bytes=50_000)
    engine.resume_memory()
    _assert_holds(sglang, trainer)
    assert sglang.calls.count("begin") == 1


def test_a_release_waits_until_the_scheduler_is_idle(checkpoint, monkeypatch):
    """The requests a generation finished stay in the scheduler's last batch until its next loop; SGLang's
    release asserts idleness there (the strict model's "Idle" rule): a release right after a generation kills
    the engine unless it first waits until flush_cache answers success, and that wait is bounded."""
    engine = engine_class(retire_s=1.0)(checkpoint, dtype=torch.float32)
    generate(engine, [[1, 2]], SamplingParams(max_new_tokens=2, n=2))
    engine.release_memory()
    flushes = engine._engine.calls[engine._engine.calls.index("flush") : -1]
    assert len(flushes) > 1 and set(flushes) == {"flush"}  # refused while the batch was there, then idle
    assert engine._engine.calls[-1] == ("release", ("kv_cache", "weights"))

    monkeypatch.setattr(SGLangEngine, "_wait_until_idle", lambda self: None)
    engine = engine_class(retire_s=1.0)(checkpoint, dtype=torch.float32)
    generate(engine, [[1, 2]], SamplingParams(max_new_tokens=2, n=2))
    with pytest.raises(Crashed, match="only when server is idle"):
        engine.release_memory()
    monkeypatch.undo()

    engine = engine_class(retire_s=60.0)(checkpoint, dtype=torch.float32, call_timeout_s=0.3)
    generate(engine, [[1, 2]], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match=r"still busy 0 s after every request came back"):
        engine.release_memory()
    assert "release" not in [c[0] for c in engine._engine.calls if isinstance(c, tuple)]


def test_on_a_cpu_sglang_starts_without_the_memory_saver_and_a_capped_kv_pool(checkpoint, tmp_path):
    """SGLang's CPU backend: the memory saver is CUDA only (release / resume free nothing there), the KV pool
    holds max_batch_size contexts instead of a share of host memory, and the tiny preset's head size (16)
    takes torch's attention (SGLang's AMX kernels need a multiple of 32)."""
    gpu = FakeGPU(1024 * MIB)
    engine = engine_class(gpus=[gpu])(checkpoint, dtype="bfloat16", device="cpu", max_batch_size=3, context_length=40)
    launch = engine._engine.launch
    assert not launch["enable_memory_saver"] and launch["device"] == "cpu"
    assert launch["max_total_tokens"] == 3 * 40 and launch["attention_backend"] == "torch_native"
    held = gpu.engine
    engine.release_memory()
    assert gpu.engine == held  # nothing freed
    sync_weights(build_model(ARGS, seed=5), engine, bucket_bytes=50_000)
    engine.resume_memory()
    assert generate(engine, [[1, 2]], SamplingParams(max_new_tokens=2))[0].token_ids == chain(2, 2)[0]
    save_hf(build_model(PRESETS["demo"], seed=0), str(tmp_path / "demo"))  # head size 32: SGLang's own attention
    assert "attention_backend" not in engine_class()(str(tmp_path / "demo"), device="cpu")._engine.launch


def test_a_refused_cache_flush_fails_the_resume(checkpoint):
    """SGLang reports a flush it refused in its result (success False); the engine would then serve prefixes
    cached with the old weights."""
    engine = engine_class()(checkpoint, dtype=torch.float32)
    engine.release_memory()
    sync_weights(build_model(ARGS, seed=5), engine, bucket_bytes=50_000)
    engine._engine.fail_next["flush"] = "Another flush_cache is already in progress."
    with pytest.raises(RuntimeError, match="flush_cache refused: Another flush_cache is already in progress"):
        engine.resume_memory()


def _group_worker(rank, world, checkpoint):
    import torch.distributed as dist

    engine = engine_class()(checkpoint, tp_size=world, dtype=torch.float32, group=dist.group.WORLD)
    assert (engine._engine is not None) == (rank == 0)  # only the leader starts SGLang
    prompts = [[[1, 2, 3]], [[4], [5, 6]]][rank]
    out = generate(engine, prompts, SamplingParams(max_new_tokens=2, n=2), GlooRanks(rank, world))
    # Each rank gets its own prompts back, indexed from 0.
    assert [(c.prompt_index, c.sample_index, c.token_ids) for c in out] == [
        (i, s, chain(p[-1], 2)[0]) for i, p in enumerate(prompts) for s in range(2)
    ]
    engine.release_memory()
    trainer = build_model(ARGS, seed=5)
    if rank == 0:
        engine._engine.fail_next["update"] = "injected load failure"
    with pytest.raises(RuntimeError, match="injected load failure"):
        engine.update_weights(_named(trainer)[:1])
    # Every rank now knows what the leader did: weights resumed, session open.
    assert (engine._released, engine._session_open) == ({"kv_cache"}, True)
    sync_weights(trainer, engine, bucket_bytes=50_000)
    engine.resume_memory()
    if rank == 0:
        _assert_holds(engine._engine, trainer)
    # A bad prompt on one rank fails the call on every rank instead of hanging the others.
    bad = [[1]] if rank == 0 else [[]]
    with pytest.raises(RuntimeError, match="rank 1: ValueError: prompt 0 is empty"):
        engine.submit(bad, SamplingParams(max_new_tokens=2))
    return len(out)


@pytest.mark.multiprocess
def test_group_of_two_ranks_shares_one_engine(checkpoint):
    assert run_ranks(_group_worker, 2, checkpoint) == [2, 4]


class _Digits:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i % 10) for i in ids)


def _collective_timeout_worker(rank, world, checkpoint):
    import datetime

    import torch.distributed as dist

    # The leader's poll outlasts the engine group's timeout: the other rank times out in the result scatter.
    group = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=2))
    engine = engine_class(delay={"async_generate": 4})(checkpoint, tp_size=world, dtype=torch.float32, group=group)
    try:
        engine.submit([[1 + rank, 2]], SamplingParams(2))
        engine.poll()
    except Exception as exc:
        return type(exc).__name__
    return None


@pytest.mark.multiprocess
def test_a_collectives_timeout_in_a_poll_is_a_dist_error(checkpoint):
    """A gloo timeout (a plain RuntimeError) in the engine group's collective is raised as a DistError, which the
    guard (run/guard.py) never names as the engine's own failure."""
    assert run_ranks(_collective_timeout_worker, 2, checkpoint, timeout=60)[1] == "DistError"


def _eval_worker(rank, world, checkpoint):
    import torch.distributed as dist

    engine = engine_class()(checkpoint, tp_size=world, dtype=torch.float32, group=dist.group.WORLD)
    problems = [PromptExample([1, 2, 3], "3", "t", [])]
    mine = problems[rank::world]  # rank 1 has no problem
    guarded = GuardedEngine(engine, GlooRanks(rank, world))  # as the held-out evaluation generates its share
    completions = guarded.generate([e.prompt_ids for e in mine], SamplingParams(max_new_tokens=2, n=2, seed=3))
    return len(score_completions(mine, completions, _Digits(), 2))


@pytest.mark.multiprocess
def test_evaluation_with_more_ranks_than_problems(checkpoint):
    """A rank without problems still takes part in its engine group's generate call."""
    assert run_ranks(_eval_worker, 2, checkpoint, timeout=60) == [1, 0]
