"""What this machine can run: the settings of a configuration that would fail here, and the values that run.

A recipe written for GPUs (configs/dapo_32b.toml, dapo_7b.toml) meets a CPU machine, a node with fewer GPUs
than processes, or a launch whose process count does not fit the parallel layout. Each of these would stop
the run only after the data and the model are loaded, one error at a time. `machine_fixes` finds all of
them at once from the configuration and a `Machine` (what `probe_machine` reads: CUDA devices, SGLang and
whether its CPU backend runs here, a C++ compiler, torchrun's process counts), before anything is loaded.

Only settings that cannot run are listed, each with the value that runs and why. Settings that are merely
unused on a CPU are left alone: `rollout.cuda_graphs` (the torch engine captures graphs only on CUDA),
`rollout.mem_fraction_static` (SGLang on GPUs only), and `parallelism.cpu_offload` in a
single CPU process (no FSDP wrapping there; with several CPU processes FSDP refuses it).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from config import Config


@dataclass(frozen=True)
class Machine:
    """The facts about this machine and launch that decide what a configuration may use."""

    cuda_devices: int = 0  # CUDA devices this process sees (0: CPU only)
    cuda_capability: tuple[int, int] | None = None  # compute capability of the first one
    sglang_version: str | None = None  # installed sglang release, None when absent
    sglang_cpu: str | None = None  # why SGLang's CPU backend cannot run here (None: it can; see _sglang_cpu_problem)
    cpu_amx: bool = False  # the CPU has AMX tiles: SGLang's CPU kernels then take over, in bf16 / fp16 only
    cxx_compiler: bool = True  # a C++ compiler for torch.compile's CPU kernels (inductor)
    world_size: int = 1  # processes of this launch (torchrun's WORLD_SIZE; 1 without torchrun)
    local_world_size: int = 1  # processes on this node (torchrun's LOCAL_WORLD_SIZE)

    def describe(self) -> str:
        devices = f"{self.cuda_devices} CUDA GPU{'s' * (self.cuda_devices > 1)}" if self.cuda_devices else "no CUDA GPU"
        return f"{devices}, {self.world_size} process{'es' * (self.world_size > 1)}"


@dataclass(frozen=True)
class Fix:
    """A setting this machine cannot run (`key` = `value`), the value that runs here, and why."""

    key: str
    value: object
    runs: object
    reason: str

    @property
    def flag(self) -> str:
        """The command-line override that applies the fix (config/loader.py parses it back to `runs`)."""
        text = str(self.runs).lower() if isinstance(self.runs, bool) else str(self.runs)
        return f"--{self.key}={text}"


def _cxx_compiler_found() -> bool:
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception:  # inductor's InvalidCxxCompiler: none of its candidates answers `--version`
        return False
    return True


def _sglang_cpu_problem(environ: Mapping[str, str]) -> str | None:
    """Why SGLang's CPU backend (docs/sglang-cpu.md) cannot run on this machine, or None. Its kernel library
    (sgl_kernel) is compiled for AVX-512 with AMX (x86-64-v4); with AMX SGLang runs its own kernels, without it
    the torch-native fallback. SGLang takes the CPU only with SGLANG_USE_CPU_ENGINE=1 (srt/utils/common.py is_cpu)."""
    import torch

    if not (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_supported()):
        return "its kernel library needs AVX-512 or AMX, which this CPU lacks"
    if environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return "SGLang runs on a CPU only with SGLANG_USE_CPU_ENGINE=1 in the environment"
    if importlib.util.find_spec("sglang") and not importlib.util.find_spec("sgl_kernel"):  # else: the version rule
        return "its kernel library (sgl_kernel) is not installed; build it from SGLang's source (docs/sglang-cpu.md)"
    return None


def probe_machine(environ: Mapping[str, str] | None = None) -> Machine:
    """This process's machine: CUDA devices, the sglang release and, without CUDA, whether its CPU backend runs,
    a C++ compiler, torchrun's process counts."""
    import torch

    environ = os.environ if environ is None else environ
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        sglang = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        sglang = None
    world_size = int(environ.get("WORLD_SIZE", "1"))
    return Machine(
        cuda_devices=cuda,
        cuda_capability=torch.cuda.get_device_capability(0) if cuda else None,
        sglang_version=sglang,
        sglang_cpu=None if cuda else _sglang_cpu_problem(environ),
        cpu_amx=torch.cpu._is_amx_tile_supported(),
        cxx_compiler=cuda > 0 or _cxx_compiler_found(),
        world_size=world_size,
        local_world_size=int(environ.get("LOCAL_WORLD_SIZE", str(world_size))),
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _Fixer:
    """The configuration as the fixes so far leave it: `value` reads a key, `fix` records a change."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.fixes: list[Fix] = []
        self.current: dict[str, object] = {}

    def value(self, key: str) -> Any:
        if key in self.current:
            return self.current[key]
        section, name = key.split(".")
        return getattr(getattr(self.cfg, section), name)

    def fix(self, key: str, runs: object, reason: str) -> None:
        self.fixes.append(Fix(key, self.value(key), runs, reason))
        self.current[key] = runs


def machine_fixes(cfg: Config, machine: Machine) -> tuple[list[Fix], list[str]]:
    """(settings to change, launch problems) for running `cfg` on `machine`; both empty when it runs as is.

    Each rule sees the fixes before it applied (e.g. once the engine is the torch engine, SGLang's tensor
    parallel size no longer matters), so applying every listed fix gives a configuration with no fix left.
    The launch problems are those no setting can fix (more processes on a node than it has GPUs).
    """
    fixer = _Fixer(cfg)
    _fix_layout(fixer, machine)
    _fix_batch_sizes(fixer, machine.world_size // fixer.value("parallelism.tp"))
    _fix_engine(fixer, machine)
    _fix_precision(fixer, machine)
    _fix_cpu_kernels(fixer, machine)
    launch: list[str] = []
    if machine.cuda_devices and machine.local_world_size > machine.cuda_devices:
        gpus = f"{machine.cuda_devices} CUDA GPU{'s' * (machine.cuda_devices > 1)}"
        launch.append(
            f"this node runs {machine.local_world_size} processes but has {gpus}: launch at most one "
            f"process per GPU (torchrun --nproc_per_node={machine.cuda_devices})"
        )
    return fixer.fixes, launch


def _fix_layout(fixer: _Fixer, machine: Machine) -> None:
    """Parallel layout: dp_replicate x dp_shard x tp must be the number of processes (dp_shard = -1 takes the rest)."""
    value, fix, world = fixer.value, fixer.fix, machine.world_size
    replicate, shard, tp = (value(f"parallelism.{k}") for k in ("dp_replicate", "dp_shard", "tp"))
    fits = world % (replicate * tp) == 0 if shard == -1 else replicate * shard * tp == world
    if fits:
        return
    processes = f"{world} process{'es' * (world > 1)}"
    reason = (
        f"dp_replicate x dp_shard x tp = {replicate} x {shard} x {tp} must equal the {processes} of this launch "
        "(WORLD_SIZE); dp_shard = -1 takes the ranks left"
    )
    if world % tp:
        fix("parallelism.tp", math.gcd(tp, world), reason)
    if world % (value("parallelism.dp_replicate") * value("parallelism.tp")):
        fix("parallelism.dp_replicate", 1, reason)
    if shard != -1:
        fix("parallelism.dp_shard", -1, reason)


def _fix_batch_sizes(fixer: _Fixer, dp: int) -> None:
    """Whole groups live on one data-parallel rank: batch sizes divide over the `dp` ranks."""
    if dp <= 1:
        return
    value, fix = fixer.value, fixer.fix
    mini = value("training.mini_batch_size")
    if mini % dp:
        fix(
            "training.mini_batch_size",
            _round_up(mini, dp),
            f"must divide over the {dp} data-parallel ranks (whole groups live on one rank); a larger "
            "mini-batch means fewer updates per step, which fewer processes would avoid",
        )
    train = value("training.train_batch_size")
    if train % value("training.mini_batch_size"):
        fix(
            "training.train_batch_size",
            _round_up(train, value("training.mini_batch_size")),
            f"must be whole mini-batches of {value('training.mini_batch_size')} prompts, divided over the "
            f"{dp} data-parallel ranks",
        )
    sft = value("training.sft_batch_size")
    if value("training.sft_warmup_steps") and sft % dp:
        fix("training.sft_batch_size", _round_up(sft, dp), f"must divide over the {dp} data-parallel ranks")


def _fix_engine(fixer: _Fixer, machine: Machine) -> None:
    """Rollout engine: SGLang runs on CUDA GPUs and on CPUs its CPU backend supports (`Machine.sglang_cpu`), and
    only the release its engine is written against."""
    from rollout.sglang_engine import SGLANG_VERSION

    value, fix = fixer.value, fixer.fix
    if value("rollout.engine") != "sglang":
        return
    found = f"sglang {machine.sglang_version} is installed" if machine.sglang_version else "sglang is not installed"
    if not machine.cuda_devices and machine.sglang_cpu:
        fix("rollout.engine", "torch", f"SGLang on a CPU: {machine.sglang_cpu}; the torch engine runs everywhere")
    elif machine.sglang_version != SGLANG_VERSION:
        fix(
            "rollout.engine",
            "torch",
            f"the SGLang engine needs sglang=={SGLANG_VERSION} and {found} (pip install -r requirements-gpu.txt; "
            "on a CPU docs/sglang-cpu.md); or use the torch engine",
        )
    elif not machine.cuda_devices and machine.cpu_amx and value("rollout.dtype") == "float32":
        # Their norms and attention dispatch bf16 / fp16 only (sgl_kernel's norm.cpp, decode.cpp, extend.cpp).
        fix("rollout.dtype", "bfloat16", "SGLang's AMX kernels compute in bf16 or fp16 only, not in float32")
    elif machine.local_world_size % value("rollout.tp_size"):
        engine_tp = value("rollout.tp_size")
        fix(
            "rollout.tp_size",
            math.gcd(engine_tp, machine.local_world_size),
            f"one SGLang engine spans rollout.tp_size consecutive processes of one node, and this node "
            f"runs {machine.local_world_size}",
        )


def _fix_precision(fixer: _Fixer, machine: Machine) -> None:
    """Mixed precision and CPU offload: what FSDP allows on this machine."""
    value, fix = fixer.value, fixer.fix
    cuda = machine.cuda_devices > 0
    # Mixed precision (param_dtype differs from model.dtype) is FSDP's; on a CPU only torchrun's several
    # processes start the process group FSDP needs (a single CUDA process starts a one-rank group itself).
    model_dtype = value("model.dtype")
    if not cuda and machine.world_size == 1 and value("parallelism.param_dtype") != model_dtype:
        fix(
            "parallelism.param_dtype",
            model_dtype,
            f"computing in {value('parallelism.param_dtype')} over {model_dtype} weights is FSDP mixed "
            "precision, which needs a process group: one CPU process has none",
        )
    dp = machine.world_size // value("parallelism.tp")
    fsdp = dp > 1 or value("parallelism.param_dtype") != model_dtype
    if not cuda and fsdp and value("parallelism.cpu_offload"):
        fix(
            "parallelism.cpu_offload",
            False,
            "offloading moves GPU state to host memory: on a CPU it is there "
            "already, and FSDP refuses the option on a CPU mesh",
        )


def _fix_cpu_kernels(fixer: _Fixer, machine: Machine) -> None:
    """FlexAttention's backward and torch.compile's C++ kernels on a CPU."""
    if machine.cuda_devices:
        return
    # FlexAttention has no backward on CPU; SDPA with a document mask computes the same attention.
    if fixer.value("model.attention_backend") == "flex":
        fixer.fix(
            "model.attention_backend",
            "sdpa",
            "FlexAttention has no backward pass on CPU; SDPA computes the same packed attention there",
        )
    # torch.compile generates C++ kernels on a CPU, built with the system's C++ compiler.
    if not machine.cxx_compiler:
        for key in ("parallelism.compile", "rollout.compile"):
            if fixer.value(key):
                fixer.fix(
                    key, False, "torch.compile builds C++ kernels on a CPU and no C++ compiler (g++, clang++) was found"
                )
