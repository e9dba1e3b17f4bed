"""The production rollout engine on GPUs: SGLang's offline `sglang.Engine`, driven by token ids.

Pinned to sglang 0.5.21 (its own pin is our torch==2.13.0; requirements-gpu.txt installs it): any other version
is refused at start, since the weight-update protocol below changes between releases. sglang is imported lazily:
this module imports, and its pure functions are tested, without it.

Start: `sglang.Engine(model_path, tp_size, base_gpu_id, mem_fraction_static, enable_memory_saver=True,
skip_tokenizer_init=True, dtype, random_seed)`, in a child process that owns it (rollout/engine_process.py:
SGLang's crash handling SIGKILLs the owner's process tree, its first request installs a SIGTERM handler). Every
call crosses that process's pipe; once it has ended, every call raises EngineDied on every rank of the group.
On a CPU (`device` "cpu"; SGLang's CPU backend, docs/sglang-cpu.md, preflight/machine.py) there is no memory
saver (CUDA only), the KV pool holds max_batch_size full contexts (`max_total_tokens`: SGLang would otherwise
commit a share of the host's memory at start), and a head size that is not a multiple of 32 takes SGLang's
torch-native attention (its AMX kernels need one).

Generation (submit / poll, rollout/engine.py): the leader records every rank's prompts and runs each prompt's n
samples as one batch of `Engine.async_generate(input_ids, sampling_params, return_logprob=True)` in the engine's
process, between calls (rollout/sglang_groups.py); a poll waits up to poll_s for a batch to finish and returns
the finished ones with the tokens SGLang reported meanwhile (the progress run/guard.py watches). A request's
max_new_tokens is capped at what the context leaves (SGLang refuses the whole batch otherwise); prompts leave
SGLang's margin of PROMPT_MARGIN tokens. The n samples are n requests with n = 1, the prompt repeated (as verl
and slime do): 0.5.21 serves n > 1 by first prefilling each prompt alone, one after another
(TokenizerManager._handle_batch_request). A request SGLang aborts fails the poll on every rank of the group; a
prompt it refuses as too long (a non-streaming abort, status 400) makes its batch raise
(srt/managers/tokenizer_manager.py TokenizerManager._handle_abort_finish_reason). Weight updates and memory calls
are refused until every batch is back. Outputs are translated by sglang_groups.py `completions_from_sglang`:
token ids and log-probs (log_softmax(logits / T), SGLang's default) from meta_info["output_token_logprobs"],
the finish reason's type, checked against `output_ids`. A sampled stop token is kept (`no_stop_trim`), as in
the torch engine; SGLang also stops on the checkpoint's own `eos_token_id`, so save checkpoints with the stop
ids you pass. `SamplingParams.seed` is not used: SGLang seeds its sampler once, from `random_seed` (per-request
seeds exist only in its deterministic mode, where a prompt's n samples would come out identical).

Weight updates, in one session per sync: the first bucket opens it (begin_weight_update, after
resume_memory_occupation(["weights"]) if they were released), each bucket is one update_weights_from_tensor(
payloads, load_format="flattened_bucket", flush_cache=False), and resume_memory() or the next submit closes it
(end_weight_update, flush_cache). Every sync pushes every weight: on SGLang's AMX CPU path a session that
updates only some weights re-packs the others a second time, corrupting them (docs/sglang-cpu.md). A bucket is
flattened into one uint8 tensor plus metadata (SGLang's
FlattenedTensorBucket) and serialized with its MultiprocessingSerializer: a CUDA tensor travels as a CUDA IPC
handle. SGLang's TP rank i opens payload i, each payload a serialization of its own (a CUDA IPC reference is
released once per serialization). With a group (one trainer rank per SGLang TP rank, on the same GPUs) each rank
serializes its own gathered copy and the payloads are gathered to the group's rank 0, which owns the engine; a
rank whose flattening or serialization failed enters the gather with its error instead, and every rank of the
group raises it (none is left alone in the gather). Every rank keeps its bucket alive until the leader's call
returned, then collects CUDA IPC handles (torch.cuda.ipc_collect): torch keeps a sent block in its IPC limbo
until then, and every bucket of the sync would still be reserved when the engine maps its KV cache back. Tensors
are on this rank's GPU (`device`: rollout/weight_sync.py moves offloaded shards there), named as Hugging Face's.

Memory (colocated with the trainer): release_memory() waits until the scheduler is idle (flush_cache answers
success: SGLang asserts it), then releases RELEASED_TAGS (KV cache, weights; the CUDA graphs stay); resume_memory()
ends an update session and maps the rest back. On a CPU both free and map nothing. Released weights are discarded, not
offloaded: every weight must be pushed again before resume_memory(), which names the missing ones otherwise.

Deadlines: every call into the engine process must answer within `call_timeout_s` (rollout.call_timeout_s): a
poll returns after poll_s, the others in seconds on a working engine; past it the engine's processes are killed
and the call raises EngineDied. An engine that answers but produces no token is hung by run/guard.py's progress
rule, on the same call_timeout_s.

Protocol state (update session open, released tags, weights pushed since the release, groups in flight) is the
leader's, adopted by the group after every call, failed or not: a failure part-way (weights resumed, then the
update failed) never leaves a rank believing what SGLang did not do. The group is a gloo group with the long
timeout (rollout/engine_spec.py engine_group): non-leader ranks wait in it while the leader's calls run.
"""

from __future__ import annotations

import functools
import importlib.metadata
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist

from model.args import ModelArgs
from model.hf_adapter import dtype_name, hf_shapes, read_hf_config, to_dtype
from rollout.engine import EngineDied, Polled, SamplingParams, checked_bucket, validate_prompts
from rollout.engine_process import EngineCallError, EngineProcess, describe
from rollout.sglang_groups import GroupLedger, with_groups

if TYPE_CHECKING:
    import sglang
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

_T = TypeVar("_T")
# The protocol state every rank of an engine group holds alike: (update session open, released memory tags,
# weights pushed since the release, why the engine died or None, groups in flight).
_ProtocolState = tuple[bool, frozenset[str], frozenset[str], str | None, int]

SGLANG_VERSION = "0.5.21"

# sglang.srt.constants GPU_MEMORY_ALL_TYPES: the tags release/resume_memory_occupation know.
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
# Released for training. Not the CUDA graphs: by default 0.5.21 does not capture them under the memory saver,
# so releasing their tag frees nothing (preflight/sglang_memory.py); with SGLANG_MEMORY_SAVER_CUDA_GRAPH it would
# back them up to host and restore them every step, for ~1-1.5 GB per GPU (the rehearsal's ledger).
RELEASED_TAGS = ("kv_cache", "weights")


def start_sglang(**server_args: object) -> sglang.Engine:
    """The engine process's target in production: `sglang.Engine(**server_args)` (`_launch` checks the release)."""
    import sglang

    return sglang.Engine(**server_args)


def _collective(name: str, *args: Any, **kwargs: Any) -> None:
    """torch.distributed's `name`(*args, **kwargs) over the engine group. Its failure (a gloo timeout is a plain
    RuntimeError) is raised as a DistError: a collective's failure, never named as the engine's own (run/guard.py)."""
    try:
        getattr(dist, name)(*args, **kwargs)
    except RuntimeError as exc:
        raise dist.DistError(f"{name} over the engine group: {exc}") from exc


def check_sglang_version(installed: str | None = None) -> None:
    """Refuse any sglang other than SGLANG_VERSION, with the reason and the fix."""
    if installed is None:
        try:
            installed = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(
                f"the SGLang engine needs sglang=={SGLANG_VERSION}, which is not installed; "
                "install it on a GPU machine with `pip install -r requirements-gpu.txt`, or use the torch engine"
            ) from None
    if installed != SGLANG_VERSION:
        raise RuntimeError(
            f"sglang {installed} is installed, but this engine is written against sglang=={SGLANG_VERSION} "
            "(the release pinned to our torch 2.13.0; its weight-update and memory APIs differ between "
            "releases); install requirements-gpu.txt"
        )


# SGLang aborts a prompt of min(context, KV-cache tokens) - 6 tokens or more (its max_req_input_len is
# min(context - 1, kv tokens - 1) - 5), and caps a request's new tokens at context - 2 - prompt length.
PROMPT_MARGIN = 7
NEW_TOKEN_MARGIN = 2


def context_length_for(max_prompt_length: int, max_new_tokens: int) -> int:
    """The SGLang context in which a prompt of max_prompt_length tokens still gets all max_new_tokens: SGLang takes
    an input of context - PROMPT_MARGIN tokens at most and caps the new tokens at context - NEW_TOKEN_MARGIN - the
    input's length; max_new_tokens - 1 + PROMPT_MARGIN >= max_new_tokens + NEW_TOKEN_MARGIN covers both."""
    return max_prompt_length + max_new_tokens - 1 + PROMPT_MARGIN


def cpu_server_args(args: ModelArgs, context_length: int, max_batch_size: int) -> dict[str, object]:
    """What SGLang's CPU backend takes beyond a GPU's arguments (module doc): no memory saver (torch_memory_saver is
    CUDA only), a KV pool of max_batch_size full contexts, and torch's attention for a head size that SGLang's AMX
    attention kernels cannot take (a multiple of 32; without AMX SGLang uses torch's anyway)."""
    backend = {"attention_backend": "torch_native"} if args.head_dim % 32 else {}
    return dict(device="cpu", enable_memory_saver=False, max_total_tokens=max_batch_size * context_length, **backend)


class SGLangEngine:
    """Rollout engine backed by sglang.Engine (see the module docstring for every protocol step).

    model_path: a HF checkpoint directory (e.g. written by model.hf.save_hf).
    device: this rank's GPU; update_weights refuses tensors elsewhere (None: no check).
    group: the process group of the trainer ranks that share this engine's GPUs, one per SGLang TP rank
        (size tp_size); its rank 0 owns the sglang.Engine. None: this process alone drives the engine.
    Every rank of `group` must make the same calls in the same order (they are collectives); a failure
    on the leader is raised on every rank.
    engine_target: what the engine process builds from the server arguments (`start_sglang`; tests put
        the strict model of tests/sglang_model.py there).
    """

    engine_target = staticmethod(start_sglang)

    def __init__(
        self,
        model_path: str,
        *,
        tp_size: int = 1,
        base_gpu_id: int = 0,
        mem_fraction_static: float = 0.6,
        dtype: torch.dtype | str = torch.bfloat16,
        seed: int = 0,
        context_length: int | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        call_timeout_s: float = 600.0,
        poll_s: float = 1.0,
        max_batch_size: int = 64,
    ) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.args = read_hf_config(model_path)
        self.weight_shapes = hf_shapes(self.args)  # {HF name: shape}: what update_weights accepts
        self.dtype = dtype = to_dtype(dtype)  # config files name dtypes as strings
        self.tp_size = tp_size
        longest = self.args.max_position_embeddings  # SGLang refuses a longer context
        self.context_length = min(context_length or longest, longest)
        self.call_timeout_s = call_timeout_s  # each call's deadline (module doc)
        self.group = group
        self.device = torch.device(device) if device is not None else None
        if group is not None and dist.get_world_size(group) != tp_size:
            raise ValueError(
                f"group has {dist.get_world_size(group)} ranks; it needs one per SGLang TP rank ({tp_size})"
            )
        self._leader = None if group is None else dist.get_global_rank(group, 0)  # the leader's global rank
        self.is_leader = group is None or dist.get_rank(group) == 0  # without a group this rank leads
        # Protocol state, kept identical on every rank of the group; only the leader holds the engine.
        self._engine: EngineProcess | None = None
        self._released: set[str] = set()
        self._pushed: set[str] = set()
        self._session_open = False
        self._dead: str | None = None  # why the engine process ended, once it has
        self._in_flight = 0  # groups submitted and not yet returned
        self._ledger = GroupLedger()  # the leader's record of them (rollout/sglang_groups.py)
        self.poll_s = poll_s
        launch: dict[str, object] = dict(
            model_path=model_path,
            tp_size=tp_size,
            base_gpu_id=base_gpu_id,
            mem_fraction_static=mem_fraction_static,
            enable_memory_saver=True,
            skip_tokenizer_init=True,
            dtype=dtype_name(dtype),
            random_seed=seed,
            context_length=self.context_length,
        )
        if self.device is not None and self.device.type == "cpu":  # SGLang's CPU backend
            launch.update(cpu_server_args(self.args, self.context_length, max_batch_size))

        def start() -> None:
            self._engine = self._launch(**launch)

        self._leader_call("start", start)

    # -- the SGLang boundary (the only methods that import sglang) --------------------------------

    def _launch(self, **kwargs: object) -> EngineProcess:
        """The engine process, which builds `engine_target(**kwargs)` (see rollout/engine_process.py)."""
        if self.engine_target is start_sglang:
            check_sglang_version()  # here, before a process starts
        try:
            return EngineProcess(functools.partial(with_groups, self.engine_target), kwargs, name="the SGLang engine")
        except EngineDied as exc:
            self._dead = str(exc)
            raise

    def _flatten_bucket(
        self, bucket: list[tuple[str, torch.Tensor]]
    ) -> tuple[dict[str, object], FlattenedTensorBucket]:
        """(payload, keep-alive): {"flattened_tensor", "metadata"} of SGLang's FlattenedTensorBucket."""
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        # CUDA IPC handles then name the device by UUID, so the receiver finds it whatever its CUDA_VISIBLE_DEVICES.
        # Only for CUDA tensors: the patch rewrites every tensor's reduction for CUDA's, and a CPU tensor (SGLang's
        # CPU backend: torch's shared-memory reduction) no longer pickles.
        if any(tensor.is_cuda for _, tensor in bucket):
            monkey_patch_torch_reductions()
        flat = FlattenedTensorBucket(named_tensors=bucket)
        return {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}, flat

    def _serialize(self, payload: object) -> str:
        from sglang.srt.utils import MultiprocessingSerializer

        return MultiprocessingSerializer.serialize(payload, output_str=True)

    def _serialize_bucket(self, bucket: list[tuple[str, torch.Tensor]], copies: int) -> tuple[list[str], object]:
        """(`copies` serialized payloads, keep-alive): one per receiving TP rank, since each serialization of a
        CUDA tensor takes one reference on the sender's block that exactly one receiver releases."""
        payload, keep_alive = self._flatten_bucket(bucket)
        return [self._serialize(payload) for _ in range(copies)], keep_alive

    # -- collectives over the group ----------------------------------------------------------------

    def _gather(self, obj: _T) -> list[_T] | None:
        """Every rank's `obj`, in group order, on the leader; None on the others."""
        if self.group is None:
            return [obj]
        gathered: list[_T | None] | None = [None] * self.tp_size if self.is_leader else None
        _collective("gather_object", obj, gathered, dst=self._leader, group=self.group)
        return cast("list[_T] | None", gathered)  # the leader's slots now hold every rank's value

    def _scatter(self, parts: list[_T] | None) -> _T:
        """This rank's entry of the leader's `parts` (None on the other ranks)."""
        if self.group is None:
            assert parts is not None  # without a group this process is the leader
            return parts[0]
        out: list[Any] = [None]  # filled with this rank's entry
        _collective("scatter_object_list", out, parts if self.is_leader else None, src=self._leader, group=self.group)
        return out[0]

    def _state(self) -> _ProtocolState:
        return (
            self._session_open,
            frozenset(self._released),
            frozenset(self._pushed),
            self._dead,
            len(self._ledger.groups),
        )

    def _adopt(self, state: _ProtocolState) -> None:
        self._session_open, released, pushed, self._dead, self._in_flight = state
        self._released, self._pushed = set(released), set(pushed)

    def _refuse_if_dead(self) -> None:
        """Every rank of the group knows the same (adopted state), so all refuse without a collective."""
        if self._dead is not None:
            raise EngineDied(self._dead)

    def _call(self, method: str, *args: object, **kwargs: object) -> Any:
        """The leader's call into the engine process, answered within call_timeout_s; its death (or hang) is
        recorded before it is raised. (Any: what the engine's method returned, unpickled.)"""
        assert self._engine is not None  # the leader's, from __init__ (shutdown marks the engine dead first)
        try:
            return self._engine.call(method, *args, deadline_s=self.call_timeout_s, **kwargs)
        except EngineDied as exc:
            self._dead = str(exc)
            raise

    def _leader_call(self, what: str, fn: Callable[[], object]) -> None:
        """Run fn on the leader; then every rank adopts the leader's protocol state (what SGLang really
        did, also when fn failed part-way) and a failure there becomes an error on every rank."""
        self._per_rank(what, lambda: self._refuse_in_flight(what), lambda inputs: [fn(), *[None] * len(inputs)][1:])

    def _refuse_in_flight(self, what: str) -> None:
        if self._in_flight:
            raise RuntimeError(f"{what}() while submitted groups are in flight")

    # -- protocol ----------------------------------------------------------------------------------

    def _checked_call(self, method: str, **kwargs: object) -> None:
        """`_call`, refused unless it succeeded. SGLang's update calls return (success, message); flush_cache a
        FlushCacheReqOutput(success, message), success False when requests are pending (srt/managers/scheduler.py
        Scheduler.flush_cache) or another flush is under way (srt/managers/scheduler_components/flush_wrapper.py
        SchedulerFlushWrapper.handle)."""
        result = self._call(method, **kwargs)
        if isinstance(result, (tuple, list)) and not result[0]:
            raise RuntimeError(f"{method}: {result[1]}")
        if getattr(result, "success", True) is False:
            raise RuntimeError(f"{method} refused: {getattr(result, 'message', '') or 'the engine was not idle'}")

    def _wait_until_idle(self) -> None:
        """Leader only: flush_cache until SGLang answers success, for at most call_timeout_s. Every generation has
        returned, but a finished request stays in the scheduler's last batch until its next loop (srt/managers/
        scheduler.py Scheduler.event_loop_normal sets last_batch after sending the outputs; is_fully_idle needs it
        empty), and release_memory_occupation asserts idleness (a crash); flush_cache checks the same, answering."""
        deadline = time.monotonic() + self.call_timeout_s
        while not self._call("flush_cache").success:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the SGLang scheduler was still busy {self.call_timeout_s:,.0f} s after every request came back "
                    "(flush_cache kept answering False): its memory cannot be released"
                )
            time.sleep(0.01)

    def _end_session(self) -> None:
        """Leader only: close an open update session and drop cached prefixes computed with old weights."""
        if self._session_open:
            self._checked_call("end_weight_update")
            self._session_open = False
            self._checked_call("flush_cache")  # prefixes cached with the old weights

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send one bucket of (HF name, full tensor); validated whole before anything is sent. Every rank of the
        group prepares its payload (checks, flattening, serialization) and enters the gather with it, or with its
        error: then every rank raises it (module docstring)."""
        bucket: list[tuple[str, torch.Tensor]] = []
        keep_alive: list[object] = []  # the flattened bucket behind this rank's CUDA IPC handles

        def prepare() -> list[str]:
            self._refuse_in_flight("update_weights")
            bucket.extend(
                checked_bucket(named_tensors, {n: (shape, self.dtype) for n, shape in self.weight_shapes.items()})
            )
            for name, tensor in bucket:
                if self.device is not None and tensor.device != self.device:
                    raise ValueError(
                        f"update_weights: {name!r} is on {tensor.device}; SGLang opens CUDA IPC handles of "
                        f"tensors on this rank's GPU ({self.device}): move each shard to the GPU before "
                        "gathering (rollout.weight_sync.sync_weights does, with device=)"
                    )
            if not bucket:
                return []
            # With a group each rank serializes its own gathered copy for its SGLang TP rank; without one this
            # process feeds every TP rank.
            payloads, flat = self._serialize_bucket(bucket, 1 if self.group is not None else self.tp_size)
            keep_alive.append(flat)
            return payloads

        def send(rank_payloads: list[list[str]]) -> list[None]:
            per_rank = [p for payloads in rank_payloads for p in payloads]  # one per SGLang TP rank
            if per_rank:
                if "weights" in self._released:
                    self._call("resume_memory_occupation", ["weights"])
                    self._released.discard("weights")
                if not self._session_open:
                    self._checked_call("begin_weight_update")
                    self._session_open = True
                self._checked_call(
                    "update_weights_from_tensor",
                    named_tensors=per_rank,
                    load_format="flattened_bucket",
                    flush_cache=False,
                )
                self._pushed.update(name for name, _ in bucket)
            return [None] * len(rank_payloads)

        try:
            self._per_rank("update_weights", prepare, send)
        finally:
            keep_alive.clear()  # only now, after the leader's call returned, may the memory behind the handles go
            if torch.cuda.is_initialized():  # free what torch keeps for the receivers (its IPC limbo)
                torch.cuda.ipc_collect()

    def release_memory(self) -> None:
        """Free the KV cache and the weights while the trainer runs (the CUDA graphs stay: RELEASED_TAGS), once the
        scheduler is idle (`_wait_until_idle`). On a CPU this frees nothing: without the memory saver (CUDA only)
        SGLang's release and resume keep the memory; they still run, so the protocol is the same everywhere."""

        def release() -> None:
            self._wait_until_idle()
            self._end_session()
            self._call("release_memory_occupation", tags=list(RELEASED_TAGS))
            self._released, self._pushed = set(RELEASED_TAGS), set()

        self._leader_call("release_memory", release)

    def resume_memory(self) -> None:
        """Finish a weight update and take back the KV cache (see the module doc)."""
        self._refuse_if_dead()
        if self._released and self._pushed != set(self.weight_shapes):
            missing = sorted(set(self.weight_shapes) - self._pushed)
            raise RuntimeError(
                f"the engine's weights were released and {len(missing)} weights were not pushed again "
                f"(e.g. {missing[:3]}); call sync_weights before resume_memory"
            )

        def resume() -> None:
            self._end_session()
            rest = [tag for tag in MEMORY_TAGS if tag in self._released]
            if rest:
                self._call("resume_memory_occupation", rest)
                self._released -= set(rest)

        self._leader_call("resume_memory", resume)

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """A round (rollout/engine.py Engine): every rank of the group passes its own prompts (possibly none); the
        leader runs each prompt's n samples as one batch in the engine's process (rollout/sglang_groups.py)."""

        def check() -> list[list[int]]:
            if not isinstance(params, SamplingParams):
                raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
            if self._released:
                raise RuntimeError("the engine's memory is released; call resume_memory() before generating")
            self._refuse_in_flight("submit")
            if prompts:
                validate_prompts(prompts, self.context_length - PROMPT_MARGIN, self.args.vocab_size)
            return [list(map(int, p)) for p in prompts]

        def on_leader(rank_prompts: list[list[list[int]]]) -> list[None]:
            batch = self._ledger.add(rank_prompts, params, self.context_length - NEW_TOKEN_MARGIN)
            self._end_session()
            if batch:
                self._call("submit_groups", batch)
            return [None] * len(rank_prompts)

        self._per_rank("submit", check, on_leader)

    def poll(self) -> Polled:
        """This rank's completions that finished (waiting up to poll_s for a group of the engine's), and the
        tokens the engine produced meanwhile, for all its ranks."""

        def on_leader(ranks: list[None]) -> list[Polled]:
            outputs, tokens = self._call("poll_groups", self.poll_s) if self._ledger.groups else ({}, 0)
            parts = self._ledger.join(outputs, len(ranks))
            return [Polled(mine, tokens, self._ledger.idle(rank)) for rank, mine in enumerate(parts)]

        return self._per_rank("poll", lambda: None, on_leader)

    def _per_rank(self, what: str, check: Callable[[], Any], on_leader: Callable[[list[Any]], list[Any]]) -> Any:
        """A collective over the group: every rank's check() (its input, validated) gathered on the leader, which
        computes on_leader(inputs), one result per rank; each rank returns its own and adopts the leader's
        protocol state. A refused input on any rank or a failure on the leader raises on every rank (EngineDied
        when the engine died); without a group the error is raised as it is."""
        self._refuse_if_dead()
        try:
            mine: tuple[str, Any] = ("ok", check())
        except Exception as e:  # this rank's input refused or not prepared: the others hear of it in the gather
            if self.group is None:
                raise
            mine = ("error", describe(e))
        gathered = self._gather(mine)
        parts: list[tuple[str, Any, _ProtocolState]] | None = None
        if self.is_leader:
            assert gathered is not None  # the leader gathers every rank's
            errors = [f"rank {i}: {value}" for i, (status, value) in enumerate(gathered) if status == "error"]
            try:
                if errors:
                    raise ValueError("; ".join(errors))
                results = [("ok", part) for part in on_leader([value for _, value in gathered])]
            except Exception as e:
                if self.group is None:
                    raise
                why = str(e) if isinstance(e, EngineCallError) else describe(e)  # the first already names its type
                results = [("error", why)] * len(gathered)
            parts = [(status, value, self._state()) for status, value in results]
        status, value, state = self._scatter(parts)
        self._adopt(state)
        self._refuse_if_dead()
        if status == "error":
            raise RuntimeError(f"SGLang engine {what} failed: {value}")
        return value

    def shutdown(self) -> None:
        """End the engine process (SGLang's own shutdown first); also after it died. No collective."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        self._dead = self._dead or "the SGLang engine was shut down"
