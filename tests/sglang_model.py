"""A strict model of sglang 0.5.21's offline `sglang.Engine`, for the tests of rollout/sglang_engine.py.

It answers the calls rollout/sglang_engine.py makes as the release does and refuses what the release
refuses. Every rule names the function of the sglang 0.5.21 wheel it comes from (paths inside the wheel):

* Start: the engine sizes its memory by preflight/sglang_memory.py (the release's KV-pool rule, cited
  there) from the memory free on its GPUs at start, and fails as SGLang does when nothing is left.
* Crashes: an exception inside a scheduler request handler ends the engine's process: the scheduler
  logs it and sends SIGQUIT to its parent, the process that owns the Engine (srt/managers/scheduler.py
  run_scheduler_process), whose handler kills that process's tree, itself included, with SIGKILL
  (srt/entrypoints/engine.py launch_phase_sigquit_handler, srt/managers/tokenizer_manager.py
  SignalHandler.running_phase_sigquit_handler, srt/utils/common.py kill_process_tree). The model's
  "scheduler" runs in the process that holds the model, so it sends SIGQUIT to that process, whose handler
  (installed at start, as Engine's launch does) kills it: no caller can catch a crash. Run it in its own
  process (rollout/engine_process.py), as the trainer runs SGLang; in the test process a crash ends pytest.
* SIGTERM: the first request installs a handler that lets the engine drain and then leave with
  sys.exit(0) out of the next call (TokenizerManager.auto_create_handle_loop, sigterm_watchdog); the
  model raises SystemExit(0) from the first call after a SIGTERM.
* Memory tags: release_memory_occupation with no tags releases all of GPU_MEMORY_ALL_TYPES
  (sglang/srt/constants.py) and asserts the scheduler is idle (see "Idle" below); resume_memory_occupation
  removes each tag from offload_tags (a set: resuming a tag that was not released raises KeyError) and maps the memory
  back (srt/managers/scheduler_components/weight_updater.py SchedulerWeightUpdaterManager.
  release_memory_occupation / resume_memory_occupation; srt/utils/torch_memory_saver_adapter.py
  _TorchMemorySaverAdapterReal.pause / resume). Mapping back more than the GPU has free fails. Resume
  has no idle check in 0.5.21 (only release asserts is_fully_idle), so the model has none either. Without
  enable_memory_saver (SGLang's CPU backend: the saver is CUDA only) the adapter is a no-op
  (srt/utils/torch_memory_saver_adapter.py _TorchMemorySaverAdapterNoop): the calls run, and free nothing.
* Idle: is_fully_idle needs the running batch and the last batch empty (srt/managers/scheduler.py
  Scheduler.is_fully_idle). The scheduler's loop runs a batch, sends the outputs of the requests it finished,
  and only then sets last_batch to it; the next loop takes requests in first (Scheduler.event_loop_normal). So a
  release that arrives right after the last output reached the caller finds that batch there: the assertion's
  crash. The model keeps a step's finished requests in its last batch for `retire_s` seconds, the scheduler's
  next loop (SGLang's runs in its own process, whatever the caller does).
* Weight-update sessions: begin_weight_update with a session open, end_weight_update without one, and
  update_weights_from_tensor outside one return (False, message); they do not raise
  (SchedulerWeightUpdaterManager.begin_weight_update / end_weight_update / update_weights_from_tensor).
* Payloads: load_format "flattened_bucket" takes pre-serialized payloads, one per TP rank
  (srt/entrypoints/engine.py Engine._serialize_tensors_per_rank); entries are base64 strings or
  bytes-like (srt/utils/common.py normalize_serialized_named_tensor_payload). TP rank i deserializes only
  entry i (srt/managers/tp_worker.py BaseTpWorker.deserialize_own_rank): fewer entries than ranks is an
  IndexError in the scheduler, and an entry no rank opens keeps its CUDA IPC reference forever. It is read
  by MultiprocessingSerializer.deserialize, i.e. SafeUnpickler (srt/utils/common.py): a global outside
  its ALLOWED_GLOBALS is "Blocked unsafe global" (the model allows a subset of that list: what the
  payloads use), and torch.storage._load_from_bytes is a weights-only torch.load. The metadata is read
  by attribute, each of name, shape, dtype, start_idx, end_idx, numel (srt/model_executor/
  model_runner_components/weight_updater.py _update_weights_from_flattened_bucket; a dict has none).
  Every failure there is a scheduler exception: a crash. Writing into released weights writes into
  unmapped memory (a CUDA error, a crash too).
* Generation (Engine.async_generate, a coroutine on Engine.loop: srt/entrypoints/engine.py Engine.__init__,
  _ensure_event_loop): input_ids must not be empty (srt/managers/io_struct.py GenerateReqInput.
  _determine_batch_size); a prompt of context_len tokens or more, or prompt + max_new_tokens beyond context_len,
  raises for the whole batch (srt/managers/tokenizer_manager.py TokenizerManager._validate_one_request); a prompt
  of max_req_input_len = min(context_len - 1, kv tokens - 1) - 5 tokens or more is aborted with status 400
  (srt/managers/tp_worker.py TpModelWorker.get_worker_info, srt/managers/utils.py validate_input_length,
  srt/managers/scheduler.py Scheduler.handle_generate_request, srt/managers/schedule_batch.py
  Req.set_finish_with_abort), and a non-streaming request aborted with status 400 makes its batch raise
  ValueError (TokenizerManager._handle_abort_finish_reason, _collect_batch_responses); other aborts come back as
  outputs with finish_reason type "abort" (the model's `abort` option). Not streaming, a batch returns its
  outputs once all its requests have finished (TokenizerManager._handle_batch_request, _collect_batch_responses),
  in request order. Its requests hold the scheduler: releasing memory before they are back is the idle
  assertion's crash; generating with the KV cache or weights released reads unmapped memory (a crash). The
  model's scheduler steps only while the loop runs (SGLang's runs in its own process); its tokens follow a fixed
  rule (StrictSGLang.step).
* Progress of requests that do not stream: the scheduler sends a request's tokens every
  SGLANG_FORCE_STREAM_INTERVAL = 50 (srt/environ.py; srt/managers/scheduler_components/output_streamer.py,
  accept: len(output_ids) % 50 == 0) and when it finishes; TokenizerManager._handle_batch_output extends the
  request's ReqState.output_ids in tokenizer_manager.rid_to_state (created when the request is sent,
  TokenizerManager._send_one_request's caller) and deletes the state when the request finishes.
* Outputs (skip_tokenizer_init): {"output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "output_token_logprobs": [(logprob, token id, None)]}}
  (TokenizerManager._handle_batch_output, BatchTokenIDOutput branch).
* flush_cache returns a FlushCacheReqOutput(success, message) (srt/entrypoints/engine.py Engine.flush_cache,
  srt/managers/io_struct.py): success False when requests are pending (srt/managers/scheduler.py
  Scheduler.flush_cache) or another flush is under way (srt/managers/scheduler_components/flush_wrapper.py
  SchedulerFlushWrapper.handle); it does not raise.
* A hang: nothing in 0.5.21 bounds how long an Engine call may take (its watchdog covers forward batches
  only); the model's hanging call never returns, and ignores SIGTERM as the engine process does.

CPU stand-ins: a "GPU" is a FakeGPU byte ledger in shared memory (the trainer's process and the engine's
see the same one); a CUDA IPC payload is a pickled, base64-encoded ((pid, serial number),
{"flattened_tensor", "metadata"}) whose metadata are SimpleNamespaces with FlattenedTensorMetadata's
fields (SafeUnpickler allows types.SimpleNamespace, and the reader reads attributes only). Building a
bucket concatenates it (srt/weight_sync/tensor_bucket.py FlattenedTensorBucket.__init__, torch.cat):
while the sender holds it, the bucket exists twice on the sender's GPU. torch keeps a sent CUDA block in
its IPC limbo (CudaIPCSentDataLimbo) until the receiver let go and torch.cuda.ipc_collect() runs; the
model assumes the worst case, every dropped bucket stays reserved on the sender's GPU until ipc_collect.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import io
import itertools
import multiprocessing
import os
import pickle
import signal
import sys
import time
import types

import torch

from model.hf import load_hf
from model.hf_adapter import DTYPES, from_hf_name
from preflight.sglang_memory import EngineMemoryError, plan_engine_memory
from rollout.sglang_engine import MEMORY_TAGS

MIB = 1 << 20
FORCE_STREAM_INTERVAL = 50  # srt/environ.py SGLANG_FORCE_STREAM_INTERVAL's default


class FakeGPU:
    """One GPU's bytes: what the trainer holds (tensors and allocator cache), what sent CUDA IPC blocks
    keep in torch's limbo, and what the engine holds. Kept in shared memory, so the engine's process (to
    which a FakeGPU passes as an argument of the engine process's target) and the trainer's see one GPU."""

    in_this_process: list[FakeGPU] = []
    _FIELDS = ("total", "trainer", "limbo", "engine")

    def __init__(self, total: int, trainer: int = 0):
        self._cells = multiprocessing.get_context("spawn").RawArray("q", len(self._FIELDS))
        self.total, self.trainer = total, trainer
        FakeGPU.in_this_process.append(self)

    def __getattr__(self, name):
        if name in FakeGPU._FIELDS:
            return self._cells[FakeGPU._FIELDS.index(name)]
        raise AttributeError(name)

    def __setattr__(self, name, value):
        if name in FakeGPU._FIELDS:
            self._cells[FakeGPU._FIELDS.index(name)] = int(value)
        else:
            object.__setattr__(self, name, value)

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


class KeepAlive:
    """The sender's flattened bucket: held on its GPU; dropping it leaves its bytes in the GPU's IPC limbo."""

    def __init__(self, nbytes: int, gpu: FakeGPU | None):
        self.nbytes, self.gpu = nbytes, gpu

    def __del__(self):
        if self.gpu is not None:
            self.gpu.trainer -= self.nbytes
            self.gpu.limbo += self.nbytes


_serials = itertools.count()


def flatten_bucket(bucket, gpu: FakeGPU | None = None):
    """CPU stand-in of FlattenedTensorBucket(named_tensors=bucket): one uint8 tensor, the concatenation of
    the bucket, and per-tensor metadata with FlattenedTensorMetadata's fields. The concatenation is a
    second copy of the bucket on the sender's GPU while the bucket's tensors are still held: a GPU without
    room for it fails as CUDA does."""
    parts, metadata, start = [], [], 0
    for name, tensor in bucket:
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        metadata.append(
            types.SimpleNamespace(
                name=name,
                shape=tensor.shape,
                dtype=tensor.dtype,
                start_idx=start,
                end_idx=start + raw.numel(),
                numel=raw.numel(),
            )
        )
        parts.append(raw)
        start += raw.numel()
    if gpu is not None:
        if gpu.free < start:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory: FlattenedTensorBucket concatenates {start} bytes with {gpu.free} free"
            )
        gpu.trainer += start
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return {"flattened_tensor": flat, "metadata": metadata}, KeepAlive(flat.numel(), gpu)


def serialize(payload) -> str:
    """Stand-in of MultiprocessingSerializer.serialize(output_str=True): one numbered handle per call."""
    return base64.b64encode(pickle.dumps(((os.getpid(), next(_serials)), payload))).decode()


# The globals of srt/utils/common.py SafeUnpickler.ALLOWED_GLOBALS that the stand-in payloads use: a subset,
# so the model refuses all the release refuses (tests/test_rollout_sglang_contract.py checks it is one).
ALLOWED_GLOBALS = {
    ("builtins", "bytes"),
    ("builtins", "dict"),
    ("builtins", "int"),
    ("builtins", "list"),
    ("builtins", "str"),
    ("builtins", "tuple"),
    ("collections", "OrderedDict"),
    ("types", "SimpleNamespace"),
    ("torch", "Size"),
    ("torch", "bfloat16"),
    ("torch", "float16"),
    ("torch", "float32"),
    ("torch", "uint8"),
    ("torch._utils", "_rebuild_tensor_v2"),
}


class SafeUnpickler(pickle.Unpickler):
    """srt/utils/common.py SafeUnpickler.find_class: allowlisted globals only; torch.storage._load_from_bytes
    becomes a weights-only torch.load (_safe_load_torch_storage)."""

    def find_class(self, module, name):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda data: torch.load(io.BytesIO(data), weights_only=True)
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def deserialize(entry):
    """normalize_serialized_named_tensor_payload, then MultiprocessingSerializer.deserialize."""
    if isinstance(entry, str):
        entry = base64.b64decode(entry, validate=True)
    elif isinstance(entry, (bytes, bytearray, memoryview)):
        entry = bytes(entry)
        if not (len(entry) >= 2 and entry[0] == 0x80 and entry[1] <= pickle.HIGHEST_PROTOCOL):
            entry = base64.b64decode(entry, validate=True)
    else:
        raise TypeError(
            "serialized_named_tensors entries must be base64 strings or bytes-like payloads, "
            f"got {type(entry).__name__}"
        )
    return SafeUnpickler(io.BytesIO(entry)).load()


def reconstruct(payload):
    """_update_weights_from_flattened_bucket: each metadata item is read by attribute, then
    FlattenedTensorBucket.reconstruct_tensors slices, views and reshapes the flat tensor."""
    flat = payload["flattened_tensor"]
    out = []
    for meta in payload["metadata"]:
        name, shape, dtype = meta.name, meta.shape, meta.dtype
        start, end, _ = meta.start_idx, meta.end_idx, meta.numel
        out.append((name, flat[start:end].view(dtype).reshape(shape)))
    return out


def chain(last, count):
    """The model's tokens and log-probs after a last input token (StrictSGLang.step)."""
    tokens = []
    for _ in range(count):
        last = (7 * last + 3) % 256
        tokens.append(last)
    return tokens, [-((t % 5) + 1) / 10 for t in tokens]


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


class InThisProcess:
    """Hosts a StrictSGLang in the calling process behind EngineProcess's `call` / `close`, for tests of the
    protocol in which nothing crashes: a crash ends the hosting process, as SGLang's ends the process that
    owns its Engine. Attributes read through to the model."""

    def __init__(self, engine: StrictSGLang):
        self.engine = engine

    def call(self, method: str, *args, deadline_s=None, **kwargs):
        return getattr(self.engine, method)(*args, **kwargs)

    def close(self) -> None:
        self.engine.shutdown()

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _kill_own_tree(signum=None, frame=None) -> None:
    """launch_phase_sigquit_handler: kill_process_tree(os.getpid()): the children, then this process."""
    for child in children():  # a zombie has nothing left to kill
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def children(pid: int | None = None) -> set[int]:
    """Live (not zombie) child processes of `pid` (default: this one), from /proc."""
    pid = os.getpid() if pid is None else pid
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry))
    return found


class StrictSGLang:
    """sglang.Engine 0.5.21 as the module docstring describes it; loads pushed weights into a torch model.

    gpus: one FakeGPU per TP rank (default: tp_size GPUs of 80 GiB with nothing else on them).
    abort: (batch number, request number) pairs whose request the scheduler aborts (batches count from 0).
    untagged_bytes, disable_cuda_graph: passed to plan_engine_memory.
    retire_s: how long the requests a step finished stay in the last batch (the "Idle" rule).
    Test controls, by call kind ("async_generate", "release", "resume", "begin", "end", "update", "flush"):
    crash: {kind: k}: the scheduler hits an exception in the k-th call of that kind (from 1) and the
        process ends as SGLang's does; hang: {kind: k}: the k-th call of that kind never returns; delay:
        {kind: seconds} spent inside each such call; announce: a file that gets "<kind> <time.time()>" as a line
        when a call starts, and "hang <time.time()>" when a hang begins (tests wait for a phase with it).
    The scheduler (see "Generation" in the module docstring): max_running: requests it runs at once (SGLang's
        max_running_requests; None: all); tick_s: seconds per scheduler step while the event loop runs;
        stall_after: steps after which it makes no more progress (as if the next step never ended).
    """

    def __init__(
        self,
        *,
        gpus=None,
        abort=(),
        untagged_bytes=MIB,
        disable_cuda_graph=False,
        crash=None,
        hang=None,
        delay=None,
        announce=None,
        max_running=None,
        tick_s=0.001,
        stall_after=None,
        retire_s=0.01,
        **launch,
    ):
        assert launch.get("skip_tokenizer_init"), launch
        # Engine's launch installs its SIGQUIT handler in the process that owns the engine (main thread only).
        signal.signal(signal.SIGQUIT, _kill_own_tree)
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
        self.retire_s, self.last_batch_until = retire_s, 0.0  # finished requests stay in the last batch until then
        self.abort = set(abort)
        self.crash, self.hang, self.delay, self.announce = (
            dict(crash or {}),
            dict(hang or {}),
            dict(delay or {}),
            announce,
        )
        self.calls: list = []
        self.counts: collections.Counter = collections.Counter()
        self.generate_calls = 0
        self.max_new_tokens: list[list[int]] = []
        self.opened: set = set()
        self.sigterm_handler_installed = False
        self.gracefully_exit = False
        # Injected failures: {"begin" | "update": message} makes that call return (False, message) once, as
        # the release does when a runner's update fails; {"flush": message} a refused flush.
        self.fail_next: dict[str, str] = {}
        self._hold()
        self._background_init(max_running, tick_s, stall_after)

    def read(self, name: str):
        """An attribute's value (tests read the model's state through the engine process)."""
        value = getattr(self, name)
        if name == "model":
            return {n: p.detach().clone() for n, p in value.named_parameters()}
        return value

    # -- bookkeeping ---------------------------------------------------------------------------

    def _held(self) -> int:
        """Bytes per GPU the engine holds: without the memory saver nothing is ever released."""
        return self.plan.held(self.offload_tags if self.launch.get("enable_memory_saver") else ())

    def _hold(self) -> None:
        held = self._held()
        for gpu in self.gpus:
            gpu.engine = held

    def _call(self, kind: str, record=None) -> None:
        """Every call: recorded, announced, delayed; the injected crash; SIGTERM's drain-and-exit."""
        self.calls.append(kind if record is None else record)
        self.counts[kind] += 1
        if self.announce:
            with open(self.announce, "a") as f:
                f.write(f"{kind} {time.time()}\n")
        time.sleep(self.delay.get(kind, 0.0))
        if self.gracefully_exit:  # sigterm_watchdog: the requests drained, the engine leaves
            sys.exit(0)
        if self.crash.get(kind) == self.counts[kind]:
            self._die(RuntimeError(f"injected scheduler failure in {kind} call {self.counts[kind]}"))
        if self.hang.get(kind) == self.counts[kind]:
            if self.announce:
                with open(self.announce, "a") as f:
                    f.write(f"hang {time.time()}\n")
            while True:
                time.sleep(1)

    def _die(self, error: Exception):
        """run_scheduler_process: log the exception, SIGQUIT the process that owns the engine (this one)."""
        print(f"Scheduler hit an exception: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGQUIT)
        while True:  # the handler runs at the next bytecode and does not return
            time.sleep(1)

    def _on_sigterm(self, signum, frame):
        self.gracefully_exit = True  # SignalHandler.sigterm_handler

    # -- memory --------------------------------------------------------------------------------

    def release_memory_occupation(self, tags=None):
        self._call("release", ("release", tuple(tags or ())))
        if not self._idle():
            self._die(AssertionError("release_memory_occupation should be called only when server is idle."))
        tags = list(tags) if tags else list(MEMORY_TAGS)
        self.offload_tags.update(tags)
        if "kv_cache" in tags:
            self._flush()
        self._hold()

    def resume_memory_occupation(self, tags=None):
        self._call("resume", ("resume", tuple(tags or ())))
        tags = list(tags) if tags else list(MEMORY_TAGS)
        before = self._held()
        for tag in tags:
            if tag not in self.offload_tags:
                self._die(KeyError(tag))  # offload_tags.remove(tag)
            self.offload_tags.remove(tag)
        need = self._held() - before  # what is mapped back now
        for rank, gpu in enumerate(self.gpus):
            if gpu.free < need:
                self._die(
                    RuntimeError(
                        f"CUDA out of memory: TP rank {rank} maps {need} bytes back ({tags}) with {gpu.free} free "
                        f"(trainer {gpu.trainer}, IPC limbo {gpu.limbo})"
                    )
                )
        self._hold()

    def flush_cache(self):
        self._call("flush")
        if "flush" in self.fail_next:
            return types.SimpleNamespace(success=False, message=self.fail_next.pop("flush"))
        return self._flush()

    def _idle(self) -> bool:  # Scheduler.is_fully_idle
        return not self.running and time.monotonic() >= self.last_batch_until

    def _flush(self):  # FlushCacheReqOutput
        return types.SimpleNamespace(success=self._idle(), message="")

    # -- weight updates ------------------------------------------------------------------------

    def begin_weight_update(self, selector="all"):
        self._call("begin")
        if self.session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        if "begin" in self.fail_next:
            return False, self.fail_next.pop("begin")
        self.session = {"selector": selector, "loaded": False}
        return True, "Success"

    def end_weight_update(self):
        self._call("end")
        if self.session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = None
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self._call("update")
        assert load_format == "flattened_bucket", load_format
        if self.session is None:
            return False, ("update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")
        if len(named_tensors) > self.tp_size:
            raise AssertionError(
                f"{len(named_tensors)} payloads for {self.tp_size} TP ranks: the extra ones are "
                "never opened, so their CUDA IPC references are never released"
            )
        try:
            tensors = self._open_payloads(named_tensors)
        except Exception as error:  # the TP workers' deserialisation and load run in the scheduler
            self._die(error)
        if "update" in self.fail_next:
            return False, self.fail_next.pop("update")
        names = [[n for n, _ in t] for t in tensors]
        assert all(n == names[0] for n in names), "TP ranks received different buckets"
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for hf_name, tensor in tensors[0]:
                params[from_hf_name(hf_name)].copy_(tensor)
        self.session["loaded"] = True
        if flush_cache:
            self._flush()
        return True, "Success"

    def _open_payloads(self, named_tensors) -> list:
        """What each TP rank does with its entry; any failure is an exception in the scheduler."""
        if len(named_tensors) < self.tp_size:
            raise IndexError(
                f"TP rank {len(named_tensors)} has no payload: {len(named_tensors)} for "
                f"{self.tp_size} ranks (deserialize_own_rank)"
            )
        decoded = [deserialize(entry) for entry in named_tensors]
        serials = [serial for serial, _ in decoded]
        if len(set(serials)) != len(serials) or self.opened & set(serials):
            raise RuntimeError("a CUDA IPC payload was opened twice: each TP rank needs its own serialization")
        self.opened.update(serials)
        if "weights" in self.offload_tags:
            raise RuntimeError("CUDA error: an illegal memory access (the weights are released)")
        return [reconstruct(payload) for _, payload in decoded]

    # -- generation ----------------------------------------------------------------------------

    def shutdown(self):
        self.calls.append("shutdown")
        for gpu in self.gpus:
            gpu.engine = 0

    # -- generation (Engine.async_generate, rollout/sglang_groups.py) ---------------------------------------

    def _background_init(self, max_running, tick_s, stall_after) -> None:
        self.loop = asyncio.new_event_loop()  # Engine.__init__: self.loop = self._ensure_event_loop()
        self.tokenizer_manager = _TokenizerManager()
        self.max_running, self.tick_s, self.stall_after = max_running, tick_s, stall_after
        self.held: list[_Request] = []  # the scheduler's requests: waiting (not yet admitted) or running
        self.steps = 0
        self._stepping = None

    async def async_generate(self, input_ids=None, sampling_params=None, return_logprob=False, **kwargs):
        """Not streaming: the batch's outputs once every request of it has finished (_collect_batch_responses)."""
        self._call("async_generate")
        if not self.sigterm_handler_installed:  # TokenizerManager.auto_create_handle_loop, at the first request
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self.sigterm_handler_installed = True
        assert not kwargs and return_logprob, kwargs
        if not input_ids:
            raise ValueError("input_ids cannot be empty.")
        single = isinstance(input_ids[0], int)
        input_ids, sampling_params = ([input_ids], [sampling_params]) if single else (input_ids, sampling_params)
        max_input = min(self.context_len - 1, self.plan.kv_tokens - 1) - 5
        for prompt, sp in zip(input_ids, sampling_params):
            assert sp.get("n", 1) == 1 and sp.get("no_stop_trim"), sp
            if len(prompt) >= self.context_len or len(prompt) + sp["max_new_tokens"] > self.context_len:
                raise ValueError(
                    f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens."
                )
            if len(prompt) >= max_input:  # validate_input_length's abort, status 400: raised
                raise ValueError(
                    f"Input length ({len(prompt)} tokens) exceeds the maximum allowed length ({max_input} tokens)."
                )
        if self.offload_tags & {"kv_cache", "weights"}:
            self._die(RuntimeError("CUDA error: an illegal memory access (generate with released memory)"))
        batch, self.generate_calls = self.generate_calls, self.generate_calls + 1
        self.max_new_tokens.append([sp["max_new_tokens"] for sp in sampling_params])
        requests = []
        for i, (prompt, sp) in enumerate(zip(input_ids, sampling_params)):
            r = _Request(f"{batch}-{i}", list(prompt), sp, self.loop.create_future())
            self.tokenizer_manager.rid_to_state[r.rid] = types.SimpleNamespace(output_ids=[])
            requests.append(r)
            if (batch, i) in self.abort:
                self._finish(r, {"type": "abort", "message": f"request {r.rid} aborted", "status_code": None})
            else:
                self.held.append(r)
                self.running += 1
        if self._stepping is None:
            self._stepping = self.loop.create_task(self._step_while_held())
        outputs = [await r.output for r in requests]
        return outputs[0] if single else outputs

    async def _step_while_held(self):
        """The scheduler, which here advances only while the engine's event loop runs."""
        while self.held:
            if self.stall_after is None or self.steps < self.stall_after:
                self.step()
            await asyncio.sleep(self.tick_s)
        self._stepping = None

    def step(self) -> None:
        """One scheduler step: admit waiting requests while fewer than max_running run, then every running one
        samples a token: t' = (7 t + 3) % 256 after its last token t (log-prob -(t' % 5 + 1) / 10), ending at a
        stop id or at max_new_tokens. Every FORCE_STREAM_INTERVAL tokens a request's are reported to the
        tokenizer manager."""
        self.steps += 1
        for r in self.held:
            r.running = r.running or self.max_running is None or sum(q.running for q in self.held) < self.max_running
        for r in [r for r in self.held if r.running]:
            token = (7 * (r.tokens or r.input_ids)[-1] + 3) % 256
            r.tokens.append(token)
            r.logprobs.append(-((token % 5) + 1) / 10)
            if token in r.params.get("stop_token_ids", ()):
                self._finish(r, {"type": "stop", "matched": token})
            elif len(r.tokens) >= r.params["max_new_tokens"]:
                self._finish(r, {"type": "length", "length": len(r.tokens)})
            elif len(r.tokens) % FORCE_STREAM_INTERVAL == 0:
                self.tokenizer_manager.rid_to_state[r.rid].output_ids = list(r.tokens)

    def _finish(self, r, reason) -> None:
        if r in self.held:  # finished by a step: in its last batch until the next loop
            self.held.remove(r)
            self.running -= 1
            self.last_batch_until = time.monotonic() + self.retire_s
        del self.tokenizer_manager.rid_to_state[r.rid]
        r.output.set_result(_output(r.tokens, r.logprobs, reason, len(r.input_ids), r.rid))


class _Request:
    def __init__(self, rid, input_ids, params, output):
        self.rid, self.input_ids, self.params, self.output = rid, input_ids, params, output
        self.tokens, self.logprobs, self.running = [], [], False


class _TokenizerManager:
    """Engine.tokenizer_manager: rid_to_state, each request's ReqState (its output_ids as reported so far)."""

    def __init__(self):
        self.rid_to_state: dict[str, types.SimpleNamespace] = {}
