"""A strict model of sglang 0.5.21's offline `sglang.Engine`, for the tests of rollout/sglang_engine.py.

It answers the calls rollout/sglang_engine.py makes as the release does and refuses what the release
refuses. Every rule names the function of the sglang 0.5.21 wheel it comes from (paths inside the wheel):

* Start: the engine sizes its memory by rollout/sglang_memory.py (the release's KV-pool rule, cited
  there) from the memory free on its GPUs at start, and fails as SGLang does when nothing is left.
* Memory tags: release_memory_occupation with no tags releases all of GPU_MEMORY_ALL_TYPES
  (sglang/srt/constants.py) and asserts the scheduler is idle; resume_memory_occupation removes each tag
  from offload_tags (a set: resuming a tag that was not released raises KeyError) and maps the memory
  back (srt/managers/scheduler_components/weight_updater.py SchedulerWeightUpdaterManager.
  release_memory_occupation / resume_memory_occupation; srt/utils/torch_memory_saver_adapter.py
  _TorchMemorySaverAdapterReal.pause / resume). Mapping back more than the GPU has free fails. Resume
  has no idle check in 0.5.21 (only release asserts is_fully_idle), so the model has none either.
* An exception inside a scheduler request handler ends the engine: the scheduler logs it and sends
  SIGQUIT to its parent (srt/managers/scheduler.py run_scheduler_process); the model then refuses every
  later call.
* Weight-update sessions: begin_weight_update with a session open, end_weight_update without one, and
  update_weights_from_tensor outside one return (False, message); they do not raise
  (SchedulerWeightUpdaterManager.begin_weight_update / end_weight_update / update_weights_from_tensor).
* Payloads: load_format "flattened_bucket" takes pre-serialized payloads, one per TP rank
  (srt/entrypoints/engine.py Engine._serialize_tensors_per_rank); TP rank i deserializes only entry i
  (srt/managers/tp_worker.py BaseTpWorker.deserialize_own_rank): fewer entries than ranks is an
  IndexError in the scheduler, and an entry no rank opens keeps its CUDA IPC reference forever. Entries
  are base64 strings or bytes (srt/utils/common.py normalize_serialized_named_tensor_payload).
  Writing into released weights writes into unmapped memory (a CUDA error that ends the scheduler).
* Generation: input_ids must not be empty (srt/managers/io_struct.py GenerateReqInput.
  _determine_batch_size); every request of a batch has the same n (GenerateReqInput._handle_parallel_sampling);
  a prompt of context_len tokens or more, or prompt + max_new_tokens beyond context_len, raises for the
  whole batch (srt/managers/tokenizer_manager.py TokenizerManager._validate_one_request); a prompt of
  max_req_input_len = min(context_len - 1, kv tokens - 1) - 5 tokens or more is aborted
  (srt/managers/tp_worker.py TpModelWorker.get_worker_info, srt/managers/utils.py validate_input_length,
  called from srt/managers/scheduler.py Scheduler.handle_generate_request). With n > 1 the tokenizer
  manager first sends one prefix-caching request per prompt, one after another, and warns above 128
  prompts (srt/managers/tokenizer_manager.py TokenizerManager._handle_batch_request); outputs come
  prompt-major. Generating with the KV cache or weights released reads unmapped memory.
* Outputs (skip_tokenizer_init): {"output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "output_token_logprobs": [(logprob, token id, None)]}}
  (TokenizerManager._handle_batch_output, BatchTokenIDOutput branch).

CPU stand-ins: a "GPU" is a FakeGPU byte ledger; a CUDA IPC payload is a pickled, base64-encoded
{"flattened_tensor", "metadata"} with a serial number. torch keeps a sent CUDA block in its IPC limbo
(CudaIPCSentDataLimbo) until the receiver let go and torch.cuda.ipc_collect() runs; the model assumes the
worst case, every dropped bucket stays reserved on the sender's GPU until ipc_collect.
"""

from __future__ import annotations

import base64
import itertools
import os
import pickle

import torch

from model.hf import load_hf
from model.hf_adapter import DTYPES, from_hf_name
from rollout.sglang_memory import MEMORY_TAGS, EngineMemoryError, plan_engine_memory

MIB = 1 << 20


class FakeGPU:
    """One GPU's bytes: what the trainer holds (tensors and allocator cache), what sent CUDA IPC blocks
    keep in torch's limbo, and what the engine holds."""

    in_this_process: list[FakeGPU] = []

    def __init__(self, total: int, trainer: int = 0):
        self.total, self.trainer, self.limbo, self.engine = total, trainer, 0, 0
        FakeGPU.in_this_process.append(self)

    @property
    def free(self) -> int:
        return self.total - self.trainer - self.limbo - self.engine


def ipc_collect() -> None:
    """Stands for torch.cuda.ipc_collect(): frees the limbo of this process's GPUs."""
    for gpu in FakeGPU.in_this_process:
        gpu.limbo = 0


def install_cuda_ipc_model(monkeypatch) -> None:
    """Make torch.cuda.ipc_collect() (and the is_initialized() guard around it) act on the FakeGPUs."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "ipc_collect", ipc_collect)


class EngineDied(RuntimeError):
    """SGLang's scheduler ended (run_scheduler_process: an exception in a handler sends SIGQUIT)."""


class KeepAlive:
    """The sender's flattened bucket; dropping it leaves its bytes in the IPC limbo of its GPU."""

    def __init__(self, nbytes: int, gpu: FakeGPU | None):
        self.nbytes, self.gpu = nbytes, gpu

    def __del__(self):
        if self.gpu is not None:
            self.gpu.limbo += self.nbytes


_serials = itertools.count()


def flatten_bucket(bucket, gpu: FakeGPU | None = None):
    """CPU stand-in of FlattenedTensorBucket: one uint8 tensor and per-tensor metadata."""
    parts, metadata, start = [], [], 0
    for name, tensor in bucket:
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        metadata.append(
            {
                "name": name,
                "shape": tuple(tensor.shape),
                "dtype": tensor.dtype,
                "start_idx": start,
                "end_idx": start + raw.numel(),
                "numel": tensor.numel(),
                "device": str(tensor.device),
            }
        )
        parts.append(raw)
        start += raw.numel()
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return {"flattened_tensor": flat, "metadata": metadata}, KeepAlive(flat.numel(), gpu)


def serialize(payload) -> str:
    """Stand-in of MultiprocessingSerializer.serialize(output_str=True): one numbered handle per call."""
    return base64.b64encode(pickle.dumps(((os.getpid(), next(_serials)), payload))).decode()


def _deserialize(entry):
    if isinstance(entry, str):
        entry = base64.b64decode(entry, validate=True)
    elif not isinstance(entry, (bytes, bytearray, memoryview)):
        # srt/utils/common.py normalize_serialized_named_tensor_payload
        raise TypeError(
            "serialized_named_tensors entries must be base64 strings or bytes-like payloads, "
            f"got {type(entry).__name__}"
        )
    return pickle.loads(bytes(entry))


def _reconstruct(payload):
    flat = payload["flattened_tensor"]
    return [
        (m["name"], flat[m["start_idx"] : m["end_idx"]].view(m["dtype"]).view(m["shape"])) for m in payload["metadata"]
    ]


def _output(ids, logprobs, reason, prompt_len, rid):
    return {
        "output_ids": list(ids),
        "meta_info": {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": prompt_len,
            "completion_tokens": len(ids),
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, ids)],
        },
    }


class StrictSGLang:
    """sglang.Engine 0.5.21 as the module docstring describes it; loads pushed weights into a torch model.

    gpus: one FakeGPU per TP rank (default: tp_size GPUs of 80 GiB with nothing else on them).
    abort: (call number, request number) pairs whose request the scheduler aborts (calls count from 0).
    untagged_bytes, disable_cuda_graph: passed to plan_engine_memory.
    """

    def __init__(self, *, gpus=None, abort=(), untagged_bytes=MIB, disable_cuda_graph=False, **launch):
        assert launch.get("enable_memory_saver") and launch.get("skip_tokenizer_init"), launch
        self.launch = launch
        self.tp_size = launch["tp_size"]
        self.gpus = gpus if gpus is not None else [FakeGPU(80 << 30) for _ in range(self.tp_size)]
        if len(self.gpus) != self.tp_size:
            raise ValueError(f"{len(self.gpus)} GPUs for tp_size {self.tp_size}")
        self.model = load_hf(launch["model_path"], dtype=DTYPES[launch["dtype"]])
        self.context_len = launch["context_length"]
        try:
            self.plan = plan_engine_memory(
                self.model.args,
                tp_size=self.tp_size,
                dtype_bytes=DTYPES[launch["dtype"]].itemsize,
                gpu_total_bytes=self.gpus[0].total,
                gpu_free_bytes_at_start=min(g.free for g in self.gpus),
                mem_fraction_static=launch["mem_fraction_static"],
                context_length=self.context_len,
                untagged_bytes=untagged_bytes,
                disable_cuda_graph=disable_cuda_graph,
            )
        except EngineMemoryError as e:
            raise ValueError(str(e)) from None  # KVCacheConfigurator._profile_available_bytes raises ValueError
        self.offload_tags: set[str] = set()
        self.session = None
        self.running = 0  # requests the scheduler is working on (is_fully_idle is False while > 0)
        self.dead: str | None = None
        self.abort = set(abort)
        self.calls: list = []
        self.generate_calls = 0
        self.serial_prefix_requests = 0  # n > 1: one prefix-caching request per prompt, one after another
        self.warnings: list[str] = []
        self.max_new_tokens: list[list[int]] = []
        self.opened: set = set()
        # Injected failures: {"begin" | "update": message} makes that call return (False, message) once, as
        # the release does when a runner's update fails.
        self.fail_next: dict[str, str] = {}
        self._hold()

    # -- bookkeeping ---------------------------------------------------------------------------

    def _hold(self) -> None:
        held = self.plan.held(self.offload_tags)
        for gpu in self.gpus:
            gpu.engine = held

    def _alive(self, what: str) -> None:
        self.calls.append(what)
        if self.dead is not None:
            raise EngineDied(f"SGLang's scheduler is gone ({self.dead}); {what} cannot be served")

    def _die(self, error: Exception):
        """run_scheduler_process: the handler's exception ends the scheduler (SIGQUIT to the parent)."""
        self.dead = f"{type(error).__name__}: {error}"
        raise error

    # -- memory --------------------------------------------------------------------------------

    def release_memory_occupation(self, tags=None):
        self._alive(("release", tuple(tags or ())))
        if self.running:
            self._die(AssertionError("release_memory_occupation should be called only when server is idle."))
        tags = list(tags) if tags else list(MEMORY_TAGS)
        self.offload_tags.update(tags)
        if "kv_cache" in tags:
            self.flush_cache(record=False)
        self._hold()

    def resume_memory_occupation(self, tags=None):
        self._alive(("resume", tuple(tags or ())))
        tags = list(tags) if tags else list(MEMORY_TAGS)
        for tag in tags:
            if tag not in self.offload_tags:
                self._die(KeyError(tag))  # offload_tags.remove(tag)
            self.offload_tags.remove(tag)
        need = self.plan.held(set(MEMORY_TAGS) - set(tags)) - self.plan.other
        for rank, gpu in enumerate(self.gpus):
            if gpu.free < need:
                self._die(
                    RuntimeError(
                        f"CUDA out of memory: TP rank {rank} maps {need} bytes back ({tags}) with {gpu.free} free "
                        f"(trainer {gpu.trainer}, IPC limbo {gpu.limbo})"
                    )
                )
        self._hold()

    def flush_cache(self, record=True):
        if record:
            self._alive("flush")
        return type("FlushCacheReqOutput", (), {"success": self.running == 0})()

    # -- weight updates ------------------------------------------------------------------------

    def begin_weight_update(self, selector="all"):
        self._alive("begin")
        if self.session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        if "begin" in self.fail_next:
            return False, self.fail_next.pop("begin")
        self.session = {"selector": selector, "loaded": False}
        return True, "Success"

    def end_weight_update(self):
        self._alive("end")
        if self.session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = None
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self._alive("update")
        assert load_format == "flattened_bucket", load_format
        if self.session is None:
            return False, ("update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")
        if len(named_tensors) < self.tp_size:
            self._die(
                IndexError(
                    f"TP rank {len(named_tensors)} has no payload: {len(named_tensors)} for "
                    f"{self.tp_size} ranks (deserialize_own_rank)"
                )
            )
        if len(named_tensors) > self.tp_size:
            raise AssertionError(
                f"{len(named_tensors)} payloads for {self.tp_size} TP ranks: the extra ones are "
                "never opened, so their CUDA IPC references are never released"
            )
        decoded = [_deserialize(entry) for entry in named_tensors]
        serials = [serial for serial, _ in decoded]
        if len(set(serials)) != len(serials) or self.opened & set(serials):
            self._die(RuntimeError("a CUDA IPC payload was opened twice: each TP rank needs its own serialization"))
        self.opened.update(serials)
        if "weights" in self.offload_tags:
            self._die(RuntimeError("CUDA error: an illegal memory access (the weights are released)"))
        if "update" in self.fail_next:
            return False, self.fail_next.pop("update")
        tensors = [_reconstruct(payload) for _, payload in decoded]
        names = [[n for n, _ in t] for t in tensors]
        assert all(n == names[0] for n in names), "TP ranks received different buckets"
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for hf_name, tensor in tensors[0]:
                params[from_hf_name(hf_name)].copy_(tensor)
        self.session["loaded"] = True
        if flush_cache:
            self.flush_cache(record=False)
        return True, "Success"

    # -- generation ----------------------------------------------------------------------------

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False, **kwargs):
        self._alive("generate")
        assert not kwargs, kwargs
        if not input_ids:
            raise ValueError("input_ids cannot be empty.")
        if isinstance(input_ids[0], int):
            input_ids, sampling_params, single = [input_ids], [sampling_params], True
        else:
            single = False
            if isinstance(sampling_params, dict):
                sampling_params = [sampling_params] * len(input_ids)
        n = sampling_params[0].get("n", 1)
        if any(sp.get("n", 1) != n for sp in sampling_params):
            raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")
        for prompt, sp in zip(input_ids, sampling_params):
            if len(prompt) >= self.context_len:
                raise ValueError(
                    f"The input ({len(prompt)} tokens) is longer than the model's context length "
                    f"({self.context_len} tokens)."
                )
            if len(prompt) + sp["max_new_tokens"] > self.context_len:
                raise ValueError(
                    f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens."
                )
        if self.offload_tags & {"kv_cache", "weights"}:
            self._die(RuntimeError("CUDA error: an illegal memory access (generate with released memory)"))
        if n > 1:
            self.serial_prefix_requests += len(input_ids)
            if len(input_ids) > 128:
                self.warnings.append(
                    "Sending a single large batch with parallel sampling (n > 1) has not been well optimized."
                )
        self.max_new_tokens.append([sp["max_new_tokens"] for sp in sampling_params])
        max_input = min(self.context_len - 1, self.plan.kv_tokens - 1) - 5
        call, self.generate_calls = self.generate_calls, self.generate_calls + 1
        outputs, request, seen = [], 0, {}
        for prompt, sp in zip(input_ids, sampling_params):
            for _ in range(n):
                key = tuple(prompt)
                copy = seen.get(key, 0)
                seen[key] = copy + 1
                rid = f"{call}-{request}"
                if (call, request) in self.abort or len(prompt) >= max_input:
                    reason = {
                        "type": "abort",
                        "message": f"request {rid} aborted",
                        "status_code": 400,
                        "err_type": None,
                    }
                    outputs.append(_output([], [], reason, len(prompt), rid))
                else:
                    ids = [len(prompt) % 256, copy % 256][: sp["max_new_tokens"]]
                    outputs.append(
                        _output(ids, [-1.0, -2.0][: len(ids)], {"type": "length", "length": len(ids)}, len(prompt), rid)
                    )
                request += 1
        return outputs[0] if single and n == 1 else outputs

    def shutdown(self):
        self.calls.append("shutdown")
        for gpu in self.gpus:
            gpu.engine = 0
