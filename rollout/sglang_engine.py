"""The production rollout engine on GPUs: SGLang's offline `sglang.Engine`, driven by token ids.

Pinned to sglang 0.5.21, the release whose own pin is torch==2.13.0 (ours, requirements.txt);
requirements-gpu.txt installs it. The installed version is checked when an engine starts and any
other is refused: the weight-update protocol below changes between releases. sglang is imported
lazily, so this module imports (and its pure functions are tested) on machines without it.

Engine start: `sglang.Engine(model_path, tp_size, base_gpu_id, mem_fraction_static,
enable_memory_saver=True, skip_tokenizer_init=True, dtype, random_seed)`; prompts go in as token ids.
The engine lives in a child process that owns it (rollout/engine_process.py: SGLang's crash handling
SIGKILLs the process tree of the process that owns the engine, and its first request installs a SIGTERM
handler); every call below crosses that process's pipe. When that process ends, every call raises
EngineDied on every rank of the group, and so does every later call.

Generation: one batched `Engine.generate(input_ids=..., sampling_params=..., return_logprob=True)`,
one sampling_params dict per request whose max_new_tokens is capped at what the context leaves (SGLang
refuses the whole batch otherwise); prompts must leave SGLang's margin of PROMPT_MARGIN tokens.
The n samples of a prompt are n requests with n = 1, the prompt repeated n times in a row (as verl and
slime do): 0.5.21 serves n > 1 by first prefilling each prompt alone, one request after another, before
the batch runs (TokenizerManager._handle_batch_request). Outputs come back in request order, so grouped
per prompt, the order of the protocol. A request SGLang aborts fails the whole call on every rank of
the group, so the group retries (or gives up) together; a prompt SGLang refuses as too long (a
non-streaming abort with status 400) already makes SGLang's generate raise for the whole batch
(srt/managers/tokenizer_manager.py TokenizerManager._handle_abort_finish_reason). Every output dict is translated by
rollout/sglang_groups.py `completions_from_sglang`:
    token_ids  <- the token ids of meta_info["output_token_logprobs"] (entries (logprob, id, text))
    logprobs   <- their log-probs: log_softmax(logits / T) of the sampled token (SGLang's default)
    finish     <- meta_info["finish_reason"]["type"] ("stop" | "length" | "abort")
and checked against `output_ids`. A sampled stop token is kept (`no_stop_trim`), as in the torch
engine. SGLang also stops on the checkpoint's own `eos_token_id` (config.json / generation_config);
save checkpoints with the stop ids you pass. `SamplingParams.seed` is not used: SGLang seeds its
sampler once, from `random_seed` at engine start (per-request seeds exist only in its deterministic
mode, where the n samples of a prompt would share one seed and come out identical).

Partial rollout (submit / poll / stop, rollout/engine.py PartialEngine): the leader records every rank's groups
and runs each as a batch of Engine.async_generate in the engine's process between calls, stopped by SGLang's
abort with what each request has (rollout/sglang_groups.py); generate, weight updates and memory calls are
refused until stop().

Weight updates (after each optimizer step), inside one update session:
    begin_weight_update()                                   # opened by the first bucket
    update_weights_from_tensor(payloads, load_format="flattened_bucket", flush_cache=False)  per bucket
    end_weight_update(); flush_cache()                      # closed by resume_memory() / generate()
A bucket is flattened into one uint8 tensor plus metadata (SGLang's FlattenedTensorBucket), and
serialized with SGLang's MultiprocessingSerializer: a CUDA tensor travels as a CUDA IPC handle, not
as bytes. SGLang's TP rank i opens payload i, and each payload is a serialization of its own (a CUDA
IPC reference is released once per serialization). With a process group (one trainer rank per SGLang TP
rank, on the same GPUs), each rank serializes its own gathered copy and the payloads are gathered to
the group's rank 0, which owns the sglang.Engine; every rank keeps its bucket alive until the leader's
call returned (a broadcast of the result), and then collects CUDA IPC handles (torch.cuda.ipc_collect):
torch keeps a sent block in its IPC limbo until then, and without it every bucket of the sync would still
be reserved when the engine maps its KV cache back. Tensors must already be on this rank's GPU (`device`):
SGLang opens CUDA IPC handles, and rollout/weight_sync.py moves offloaded shards there before gathering.
Names are Hugging Face's, as SGLang loads them.

Memory (colocated with the trainer on one GPU pool):
    release_memory()        release_memory_occupation(RELEASED_TAGS)   (KV cache, weights; graphs stay)
    update_weights(...)     resume_memory_occupation(["weights"]) first, then the buckets
    resume_memory()         end the update session, flush_cache(), resume_memory_occupation(the rest)
Released weights are discarded, not offloaded: after a release every weight must be pushed again
before resume_memory(), which refuses otherwise and names the missing weights.

Deadlines: every call into the engine process has one (rollout/engine_process.py): a control call (release,
resume, begin / end of an update, a bucket, flush, a partial round's submit, poll and stop) `call_timeout_s`
(rollout.call_timeout_s), a generate call `generate_deadline_s` of its size; past it the engine is killed and
the call raises EngineDied, as a dead one. A partial round whose polls answer but whose groups outlast the
`generate_deadline_s` of its requests, counted from its first submit, ends the same way at the next poll.

Protocol state (update session open, released tags, weights pushed since the release) is the leader's:
the leader updates it after each SGLang call that succeeded, and after every call, failed or not, the
group adopts it, so a failure part-way (weights resumed, then the update failed) never leaves a rank
believing what SGLang did not do. The group should be a gloo group with a timeout longer than the
slowest generation (rollout/engine_spec.py engine_group): non-leader ranks wait in it while the leader generates.
"""

from __future__ import annotations

import functools
import importlib.metadata
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist

from model.hf_adapter import dtype_name, hf_shapes, read_hf_config, to_dtype
from rollout.engine import Completion, EngineDied, GroupRequest, SamplingParams, checked_bucket, validate_prompts
from rollout.engine_process import EngineCallError, EngineProcess, describe
from rollout.sglang_groups import GroupLedger, Key, with_groups
from rollout.sglang_memory import MEMORY_TAGS as _MEMORY_TAGS

if TYPE_CHECKING:
    import sglang
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

_T = TypeVar("_T")
# The protocol state every rank of an engine group holds alike: (update session open, released memory tags,
# weights pushed since the release, why the engine died or None, partial-rollout groups in flight).
_ProtocolState = tuple[bool, frozenset[str], frozenset[str], str | None, int]

SGLANG_VERSION = "0.5.21"

# Released for training. Not the CUDA graphs: by default 0.5.21 does not capture them under the memory saver,
# so releasing their tag frees nothing (rollout/sglang_memory.py); with SGLANG_MEMORY_SAVER_CUDA_GRAPH it would
# back them up to host and restore them every step, for ~1-1.5 GB per GPU (the rehearsal's ledger).
RELEASED_TAGS = ("kv_cache", "weights")


def start_sglang(**server_args: object) -> sglang.Engine:
    """The engine process's target in production: `sglang.Engine(**server_args)` of the pinned release."""
    check_sglang_version()
    import sglang

    return sglang.Engine(**server_args)


def _collective(name: str, *args: Any, **kwargs: Any) -> None:
    """torch.distributed's `name`(*args, **kwargs) over the engine group. Its failure (a gloo timeout is a plain
    RuntimeError) is raised as a DistError: a collective's failure, never named as the engine's own (run/guard.py)."""
    try:
        getattr(dist, name)(*args, **kwargs)
    except RuntimeError as exc:
        raise dist.DistError(f"{name} over the engine group: {exc}") from exc


def _why(exc: BaseException) -> str:
    """An error's message; the engine process's errors already name their type."""
    return str(exc) if isinstance(exc, EngineCallError) else describe(exc)


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
    """The SGLang context in which a prompt of max_prompt_length tokens still gets all max_new_tokens, also when
    a stopped sample continues with all but one of them as input (partial rollout): SGLang takes an input of
    context - PROMPT_MARGIN tokens at most."""
    return max_prompt_length + max_new_tokens - 1 + PROMPT_MARGIN


def generate_deadline_s(requests: int, max_new_tokens: int, call_timeout_s: float, min_tokens_per_s: float) -> float:
    """A generate call's deadline: call_timeout_s + requests x max_new_tokens / min_tokens_per_s, every request
    generating its longest response at the slowest throughput that is not a hang (rollout.min_tokens_per_s)."""
    return call_timeout_s + requests * max_new_tokens / min_tokens_per_s


def _leader_of(group: dist.ProcessGroup | None, tp_size: int) -> tuple[int | None, bool]:
    """(the global rank of the group's leader, whether this rank is it); without a group this rank leads."""
    if group is None:
        return None, True
    if dist.get_world_size(group) != tp_size:
        raise ValueError(f"group has {dist.get_world_size(group)} ranks; it needs one per SGLang TP rank ({tp_size})")
    return dist.get_global_rank(group, 0), dist.get_rank(group) == 0


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
        min_tokens_per_s: float = 2500.0,
        poll_s: float = 1.0,
        **engine_kwargs: object,  # more sglang.Engine server arguments
    ) -> None:
        dtype = to_dtype(dtype)  # config files name dtypes as strings
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.args = read_hf_config(model_path)
        self.weight_shapes = hf_shapes(self.args)  # {HF name: shape}: what update_weights accepts
        self.dtype = dtype
        self.tp_size = tp_size
        self.context_length = context_length or self.args.max_position_embeddings
        self.call_timeout_s, self.min_tokens_per_s = call_timeout_s, min_tokens_per_s  # deadlines (module doc)
        self.group = group
        self.device = torch.device(device) if device is not None else None
        self._leader, self.is_leader = _leader_of(group, tp_size)
        # Protocol state, kept identical on every rank of the group; only the leader holds the engine.
        self._engine: EngineProcess | None = None
        self._released: set[str] = set()
        self._pushed: set[str] = set()
        self._session_open = False
        self._dead: str | None = None  # why the engine process ended, once it has
        self._in_flight = 0  # partial-rollout groups submitted and not yet returned
        self._round_requests, self._round_start, self._round_tokens = 0, 0.0, 0  # the leader's round deadline
        self._ledger = GroupLedger()  # the leader's record of them (rollout/sglang_groups.py)
        self.poll_s = poll_s
        launch = dict(
            model_path=model_path,
            tp_size=tp_size,
            base_gpu_id=base_gpu_id,
            mem_fraction_static=mem_fraction_static,
            enable_memory_saver=True,
            skip_tokenizer_init=True,
            dtype=dtype_name(dtype),
            random_seed=seed,
            context_length=self.context_length,
            **engine_kwargs,
        )

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
        monkey_patch_torch_reductions()
        flat = FlattenedTensorBucket(named_tensors=bucket)
        return {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}, flat

    def _serialize(self, payload: object) -> str:
        from sglang.srt.utils import MultiprocessingSerializer

        return MultiprocessingSerializer.serialize(payload, output_str=True)

    def _serialize_bucket(
        self, bucket: list[tuple[str, torch.Tensor]], copies: int
    ) -> tuple[list[str], FlattenedTensorBucket]:
        """(`copies` serialized payloads, keep-alive). Each serialization of a CUDA tensor takes one
        reference on the sender's block that exactly one receiver releases, so every SGLang TP rank must
        open a payload of its own: one shared string opened by tp ranks would never let the memory go."""
        payload, keep_alive = self._flatten_bucket(bucket)
        return [self._serialize(payload) for _ in range(copies)], keep_alive

    @staticmethod
    def _collect_ipc_handles() -> None:
        """Free the sent buckets torch keeps for CUDA IPC receivers (its IPC limbo) once they let go."""
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()

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

    def _call(self, method: str, *args: object, deadline_s: float | None = None, **kwargs: object) -> Any:
        """The leader's call into the engine process, by deadline_s (default call_timeout_s); its death (or
        hang) is recorded before it is raised. (Any: what the engine's method returned, unpickled.)"""
        return self._recorded(
            lambda engine: engine.call(method, *args, deadline_s=deadline_s or self.call_timeout_s, **kwargs)
        )

    def _recorded(self, fn: Callable[[EngineProcess], _T]) -> _T:
        """fn(the leader's engine process); the engine's death (or hang) is recorded before it is raised."""
        assert self._engine is not None  # the leader's, from __init__ (shutdown marks the engine dead first)
        try:
            return fn(self._engine)
        except EngineDied as exc:
            self._dead = str(exc)
            raise

    def _leader_call(self, what: str, fn: Callable[[], object]) -> None:
        """Run fn on the leader; then every rank adopts the leader's protocol state (what SGLang really
        did, also when fn failed part-way) and a failure there becomes an error on every rank."""

        def check() -> None:
            if self._in_flight:
                raise RuntimeError(f"{what}() while submitted groups are in flight; stop() them first")

        self._per_rank(what, check, lambda inputs: [fn(), *[None] * len(inputs)][1:])

    # -- protocol ----------------------------------------------------------------------------------

    @staticmethod
    def _check(what: str, result: object) -> None:
        """SGLang's update calls return (success, message); flush_cache a FlushCacheReqOutput(success, message),
        success False when requests are pending (srt/managers/scheduler.py Scheduler.flush_cache) or another
        flush is under way (srt/managers/scheduler_components/flush_wrapper.py SchedulerFlushWrapper.handle)."""
        if isinstance(result, (tuple, list)) and not result[0]:
            raise RuntimeError(f"{what}: {result[1]}")
        if getattr(result, "success", True) is False:
            raise RuntimeError(f"{what} refused: {getattr(result, 'message', '') or 'the engine was not idle'}")

    def _end_session(self) -> None:
        """Leader only: close an open update session and drop cached prefixes computed with old weights."""
        if self._session_open:
            self._check("end_weight_update", self._call("end_weight_update"))
            self._session_open = False
            self._check("flush_cache", self._call("flush_cache"))  # prefixes cached with the old weights

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send one bucket of (HF name, full tensor); validated whole before anything is sent."""
        self._refuse_if_dead()
        bucket = checked_bucket(
            named_tensors, {name: (shape, self.dtype) for name, shape in self.weight_shapes.items()}
        )
        for name, tensor in bucket:
            if self.device is not None and tensor.device != self.device:
                raise ValueError(
                    f"update_weights: {name!r} is on {tensor.device}; SGLang opens CUDA IPC handles of "
                    f"tensors on this rank's GPU ({self.device}): move each shard to the GPU before "
                    "gathering (rollout.weight_sync.sync_weights does, with device=)"
                )
        if not bucket:
            return
        # With a group each rank serializes its own gathered copy for its SGLang TP rank; without one this
        # process feeds every TP rank, one serialization each.
        payloads, keep_alive = self._serialize_bucket(bucket, 1 if self.group is not None else self.tp_size)
        per_rank = self._gather(payloads[0]) if self.group is not None else payloads

        def send() -> None:
            if "weights" in self._released:
                self._call("resume_memory_occupation", ["weights"])
                self._released.discard("weights")
            if not self._session_open:
                self._check("begin_weight_update", self._call("begin_weight_update"))
                self._session_open = True
            self._check(
                "update_weights_from_tensor",
                self._call(
                    "update_weights_from_tensor",
                    named_tensors=per_rank,
                    load_format="flattened_bucket",
                    flush_cache=False,
                ),
            )
            self._pushed.update(name for name, _ in bucket)

        try:
            self._leader_call("update_weights", send)
        finally:
            del keep_alive  # only now, after the leader's call returned, may the memory behind the handles go
            self._collect_ipc_handles()

    def release_memory(self) -> None:
        """Free the KV cache and the weights while the trainer runs (the CUDA graphs stay: RELEASED_TAGS)."""

        def release() -> None:
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
            rest = [tag for tag in _MEMORY_TAGS if tag in self._released]
            if rest:
                self._call("resume_memory_occupation", rest)
                self._released -= set(rest)

        self._leader_call("resume_memory", resume)

    def _generate_on_leader(
        self, rank_prompts: list[list[list[int]]], params: SamplingParams
    ) -> list[list[Completion]]:
        """The group's prompts as one SGLang batch, n requests of n = 1 per prompt; the completions of each rank."""
        ledger = GroupLedger()  # of this call only: a failed one leaves nothing in flight
        groups = [[GroupRequest(p, prompt) for p, prompt in enumerate(prompts)] for prompts in rank_prompts]
        batch = ledger.add(groups, params, self.context_length - NEW_TOKEN_MARGIN)
        if not batch:  # SGLang refuses an empty batch (GenerateReqInput: input_ids cannot be empty)
            return [[] for _ in rank_prompts]
        self._end_session()
        inputs = [x for _, xs, _ in batch for x in xs]
        outputs = self._call(
            "generate",
            deadline_s=generate_deadline_s(
                len(inputs), params.max_new_tokens, self.call_timeout_s, self.min_tokens_per_s
            ),
            input_ids=inputs,
            sampling_params=[sp for *_, sps in batch for sp in sps],
            return_logprob=True,
        )
        n = params.n
        return ledger.join(
            {key: outputs[i * n : (i + 1) * n] for i, (key, _, _) in enumerate(batch)}, len(rank_prompts)
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Every rank of the group passes its own prompts (possibly none: it still takes part); the leader
        runs them all as one SGLang batch."""

        def check() -> list[list[int]]:
            self._check_ready(params, "generate")
            if not isinstance(prompts, (list, tuple)):
                raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
            if prompts:
                validate_prompts(prompts, self.context_length - PROMPT_MARGIN, self.args.vocab_size)
            return [list(map(int, p)) for p in prompts]

        return self._per_rank("generate", check, lambda rank_prompts: self._generate_on_leader(rank_prompts, params))

    def submit(self, groups: list[GroupRequest], params: SamplingParams) -> None:
        """Partial rollout (rollout/engine.py PartialEngine): every rank passes its own groups (possibly none)."""

        def check() -> list[GroupRequest]:
            self._check_ready(params)
            stopped = [[c.token_ids for c in g.samples if c.finish_reason == "abort"] for g in groups]
            continued = [g.prompt_ids + max(tokens, key=len, default=[]) for g, tokens in zip(groups, stopped)]
            if continued:  # what SGLang takes in: the prompt and the tokens a stopped sample has
                validate_prompts(continued, self.context_length - PROMPT_MARGIN, self.args.vocab_size)
            return list(groups)

        def on_leader(rank_groups: list[list[GroupRequest]]) -> list[None]:
            if not self._ledger.groups:  # a new round: its deadline counts from now
                self._round_requests, self._round_start = 0, time.monotonic()
            batch = self._ledger.add(rank_groups, params, self.context_length - NEW_TOKEN_MARGIN)
            self._end_session()
            if batch:
                self._call("submit_groups", batch)
                self._round_requests += sum(len(inputs) for _, inputs, _ in batch)
                self._round_tokens = params.max_new_tokens
            return [None] * len(rank_groups)

        self._per_rank("submit", check, on_leader)

    def poll(self) -> list[Completion]:
        """The groups of this rank that finished (waiting up to poll_s for one of the group's ranks)."""
        return self._per_rank("poll", lambda: None, lambda ranks: self._ledger.join(self._outputs(False), len(ranks)))

    def stop(self) -> list[Completion]:
        """Abort what runs; this rank's groups not yet returned, stopped samples with what they have."""
        return self._per_rank(
            "stop", lambda: None, lambda ranks: self._ledger.join(self._outputs(True), len(ranks), True)
        )

    def _outputs(self, stop: bool) -> dict[Key, list[dict]]:
        """Leader: SGLang's outputs of the groups in flight that finished (stop: of all), by (rank, key)."""
        out: dict[Key, list[dict]] = {key: [] for key in self._ledger.idle()}  # nothing for SGLang to do
        requests, tokens = self._round_requests, self._round_tokens
        deadline = generate_deadline_s(requests, tokens, self.call_timeout_s, self.min_tokens_per_s)
        if not stop and self._ledger.groups and time.monotonic() - self._round_start > deadline:
            why = f"a round of {requests} requests x {tokens} tokens outlasted its deadline of {deadline:,.0f} s"
            self._recorded(lambda engine: engine.kill_hung("poll_groups", why))
        if len(out) < len(self._ledger.groups):
            out.update(self._call("stop_groups") if stop else self._call("poll_groups", 0.0 if out else self.poll_s))
        return out

    def _check_ready(self, params: SamplingParams, refuse_in_flight: str = "") -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if self._released:
            raise RuntimeError("the engine's memory is released; call resume_memory() before generating")
        if refuse_in_flight and self._in_flight:
            raise RuntimeError(f"{refuse_in_flight}() while submitted groups are in flight; stop() them first")

    def _per_rank(self, what: str, check: Callable[[], Any], on_leader: Callable[[list[Any]], list[Any]]) -> Any:
        """A collective over the group: every rank's check() (its input, validated) gathered on the leader, which
        computes on_leader(inputs), one result per rank; each rank returns its own and adopts the leader's
        protocol state. A refused input on any rank or a failure on the leader raises on every rank (EngineDied
        when the engine died); without a group the error is raised as it is."""
        self._refuse_if_dead()
        try:
            mine: tuple[str, Any] = ("ok", check())
        except (TypeError, ValueError, RuntimeError) as e:
            if self.group is None:
                raise
            mine = ("error", f"{type(e).__name__}: {e}")
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
                results = [("error", _why(e))] * len(gathered)
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
