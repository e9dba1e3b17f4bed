"""What a machine can run: a GPU recipe on a CPU is refused before any work with one error that lists every
override needed, the listed overrides make it run, and unusable data files end in one line with exit code 2."""

import dataclasses
import glob
import importlib.util
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch

import eval as eval_command
import train
from config import ConfigError, load_config
from model.args import get_preset
from model.hf import save_hf
from model.qwen2 import build_model
from model.tokenizer import IM_END, render_chat, train_bpe_tokenizer
from preflight.checks import check_runnable
from preflight.machine import Machine, machine_fixes, probe_machine
from rollout.sglang_engine import SGLANG_VERSION
from tasks.arithmetic import synthetic_arithmetic_rows
from tests.dist_utils import run_ranks
from tests.parquet_rows import write_parquet_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "**", "*.toml"), recursive=True)
)
# CPU recipes: demo_cpu, ablation_cpu and the mechanism probes (configs/probes/, bench/mechanisms.py)
GPU_CONFIGS = [c for c in CONFIGS if not c.endswith("_cpu.toml") and not c.startswith("configs/probes/")]

NO_AVX512 = "its kernel library needs AVX-512 or AMX, which this CPU lacks"  # preflight/machine.py's probe says
CPU = Machine(sglang_cpu=NO_AVX512)  # no CUDA, one process, a C++ compiler
TWO_CPU_PROCESSES = Machine(world_size=2, local_world_size=2, sglang_cpu=NO_AVX512)
H100_NODE = Machine(
    cuda_devices=8, cuda_capability=(9, 0), sglang_version=SGLANG_VERSION, world_size=8, local_world_size=8
)
PAPER_CLUSTER = dataclasses.replace(H100_NODE, world_size=128)  # 16 nodes of 8
A100 = Machine(cuda_devices=1, cuda_capability=(8, 0), sglang_version=SGLANG_VERSION)
SGLANG_CPU = Machine(sglang_version=SGLANG_VERSION)  # AVX-512 without AMX: SGLang's torch-native path
SGLANG_AMX_CPU = Machine(sglang_version=SGLANG_VERSION, cpu_amx=True)

# Shrinks a recipe to seconds on a CPU; none of these is a setting the machine rules look at.
SMALL = [
    "training.steps=1",
    "training.train_batch_size=2",
    "training.mini_batch_size=2",
    "rollout.n=2",
    "data.max_prompt_length=256",
    "rollout.max_response_length=8",
    "eval.max_response_length=8",
    "algorithm.overlong_buffer=4",
    "training.micro_batch_tokens=512",
    "rollout.max_batch_size=8",
    "algorithm.dynamic_sampling=false",
    "eval.interval=0",
    "eval.at_start=false",
    "eval.at_end=false",
    "data.eval_path=",
    "metrics.tensorboard=false",
    "job.cpu_threads=1",
]
NO_COMPILE = ["rollout.compile=false", "parallelism.compile=false"]  # compiling costs ~30 s on a 2-core CPU
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="shows what a CPU machine refuses; this one has CUDA")


def fixes_of(path_or_cfg, machine, overrides=()):
    cfg = path_or_cfg if not isinstance(path_or_cfg, str) else load_config(os.path.join(ROOT, path_or_cfg), overrides)
    fixes, launch = machine_fixes(cfg, machine)
    return {f.key: f.runs for f in fixes}, launch


def flags_in(message: str) -> list[str]:
    """The overrides a machine error lists ("...; to run it here, add: --a=b --c=d" on its first line)."""
    return message.splitlines()[0].split("to run it here, add: ")[1].split()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2.5-shaped checkpoint with its tokenizer, long enough for the recipes' sequences, and data."""
    folder = tmp_path_factory.mktemp("guard")
    rows = synthetic_arithmetic_rows(40, split="train", seed=0)
    args = dataclasses.replace(get_preset("demo"), max_position_embeddings=32768)
    save_hf(build_model(args, seed=0), str(folder / "ckpt"))
    texts = [render_chat(r["prompt"]) + r["extra_info"]["solution"] + IM_END for r in rows]
    train_bpe_tokenizer(texts, args.vocab_size).save(str(folder / "ckpt"))
    write_parquet_rows(rows, str(folder / "train.parquet"))
    return folder


# ------------------------------------------------------------------------------------------ the rules


@pytest.mark.parametrize("path", CONFIGS)
def test_every_shipped_config_runs_as_is_on_the_machines_it_was_written_for(path):
    # A CPU recipe on a CPU; a GPU recipe on an 8-GPU node (the ablation's 4-prompt mini-batch does not spread
    # over 8 data-parallel ranks, and it need not).
    assert fixes_of(path, H100_NODE if path in GPU_CONFIGS else CPU) == ({}, [])


def test_the_32b_mini_batch_does_not_divide_over_the_papers_128_gpus():
    # Whole groups live on one data-parallel rank, so a mini-batch of 32 prompts cannot spread over 128 ranks.
    assert fixes_of("configs/dapo_32b.toml", PAPER_CLUSTER) == ({"training.mini_batch_size": 128}, [])


@pytest.mark.parametrize("path", GPU_CONFIGS)
def test_a_gpu_recipe_in_one_cpu_process_needs_the_torch_engine_and_float32_compute(path):
    assert fixes_of(path, CPU) == ({"rollout.engine": "torch", "parallelism.param_dtype": "float32"}, [])
    # Several CPU processes start a gloo group, so bf16 mixed precision runs there; FSDP then refuses CPU
    # offload, which the 32B recipe (and its ablation rows) sets.
    offload = load_config(os.path.join(ROOT, path)).parallelism.cpu_offload
    assert fixes_of(path, TWO_CPU_PROCESSES) == (
        {"rollout.engine": "torch"} | ({"parallelism.cpu_offload": False} if offload else {}),
        [],
    )


def test_the_cpu_demo_runs_on_a_cpu_as_it_is():
    assert fixes_of("configs/demo_cpu.toml", CPU) == ({}, [])
    assert fixes_of("configs/demo_cpu.toml", TWO_CPU_PROCESSES) == ({}, [])


@pytest.mark.parametrize(
    "overrides, machine, expected",
    [
        # FlexAttention: no backward on a CPU.
        (["model.attention_backend=flex"], CPU, {"model.attention_backend": "sdpa"}),
        (["model.attention_backend=flex"], H100_NODE, {}),
        # torch.compile on a CPU builds C++ kernels; CUDA graphs are only captured on CUDA, so a CPU ignores them.
        (
            ["parallelism.compile=true", "rollout.compile=true"],
            dataclasses.replace(CPU, cxx_compiler=False),
            {"parallelism.compile": False, "rollout.compile": False},
        ),
        (["parallelism.compile=true", "rollout.compile=true", "rollout.cuda_graphs=true"], CPU, {}),
        # Mixed precision: one CPU process has no process group for FSDP; a bf16 model computes in bf16 there.
        (["model.dtype=bfloat16", "parallelism.param_dtype=float32"], CPU, {"parallelism.param_dtype": "bfloat16"}),
        (["model.dtype=bfloat16", "parallelism.param_dtype=bfloat16"], CPU, {}),
        (["parallelism.param_dtype=bfloat16"], A100, {}),  # one CUDA process starts a one-rank group itself
        # CPU offload: meaningless but harmless without FSDP, refused by FSDP on a CPU mesh.
        (["parallelism.param_dtype=float32", "parallelism.cpu_offload=true"], CPU, {}),
        (["parallelism.cpu_offload=true"], TWO_CPU_PROCESSES, {"parallelism.cpu_offload": False}),
        # The parallel layout must be the launch's process count.
        (["parallelism.param_dtype=float32", "parallelism.tp=2"], CPU, {"parallelism.tp": 1}),
        (["parallelism.dp_shard=4"], TWO_CPU_PROCESSES, {"parallelism.dp_shard": -1}),
        (["parallelism.dp_replicate=2", "parallelism.tp=2"], TWO_CPU_PROCESSES, {"parallelism.dp_replicate": 1}),
        (["parallelism.dp_replicate=2", "parallelism.dp_shard=2", "parallelism.tp=2"], H100_NODE, {}),
        # Whole groups live on one data-parallel rank: the batch sizes divide over them.
        (
            [
                "training.train_batch_size=12",
                "training.mini_batch_size=6",
                "training.sft_warmup_steps=5",
                "training.sft_batch_size=6",
            ],
            H100_NODE,
            {"training.mini_batch_size": 8, "training.train_batch_size": 16, "training.sft_batch_size": 8},
        ),
        (
            ["training.train_batch_size=12", "training.mini_batch_size=6", "parallelism.tp=2"],
            dataclasses.replace(H100_NODE, world_size=12, local_world_size=12, cuda_devices=12),
            {},
        ),
        (["training.sft_batch_size=6"], H100_NODE, {}),  # no warm-up: its batch size is unused
        # SGLang: CUDA only, the pinned release only, an engine's TP ranks on one node.
        (["rollout.engine=sglang"], dataclasses.replace(H100_NODE, sglang_version=None), {"rollout.engine": "torch"}),
        (
            ["rollout.engine=sglang"],
            dataclasses.replace(H100_NODE, sglang_version="0.4.6"),
            {"rollout.engine": "torch"},
        ),
        (
            ["rollout.engine=sglang", "rollout.tp_size=4"],
            dataclasses.replace(H100_NODE, world_size=2, local_world_size=2),
            {"rollout.tp_size": 2},
        ),
        (["rollout.engine=sglang", "rollout.tp_size=4"], H100_NODE, {}),
        # SGLang on a CPU its CPU backend runs on; with AMX its kernels compute in bf16 / fp16 only.
        (["rollout.engine=sglang", "rollout.dtype=float32"], SGLANG_CPU, {}),
        (["rollout.engine=sglang", "rollout.dtype=float32"], SGLANG_AMX_CPU, {"rollout.dtype": "bfloat16"}),
        (["rollout.engine=sglang"], SGLANG_AMX_CPU, {}),
        (
            ["rollout.engine=sglang"],
            dataclasses.replace(SGLANG_CPU, sglang_cpu="a reason"),
            {"rollout.engine": "torch"},
        ),
        (["rollout.engine=sglang"], dataclasses.replace(SGLANG_CPU, sglang_version=None), {"rollout.engine": "torch"}),
    ],
)
def test_each_rule_names_the_setting_and_the_value_that_runs(overrides, machine, expected):
    runs_anywhere = ["parallelism.param_dtype=float32"]  # the defaults compute in bf16: fine on CUDA only
    assert fixes_of(load_config(None, runs_anywhere + overrides), machine) == (expected, [])


def test_more_processes_than_gpus_is_a_launch_problem_no_setting_fixes():
    fixes, launch = fixes_of("configs/dapo_32b.toml", dataclasses.replace(H100_NODE, cuda_devices=4))
    assert fixes == {} and launch == [
        "this node runs 8 processes but has 4 CUDA GPUs: launch at most one process "
        "per GPU (torchrun --nproc_per_node=4)"
    ]


MACHINES = [
    CPU,
    TWO_CPU_PROCESSES,
    dataclasses.replace(CPU, cxx_compiler=False),
    A100,
    H100_NODE,
    dataclasses.replace(H100_NODE, sglang_version=None, world_size=2, local_world_size=2),
    Machine(world_size=6, local_world_size=6),
    SGLANG_AMX_CPU,
]
EDGES = [
    [],
    [
        "model.attention_backend=flex",
        "parallelism.tp=4",
        "parallelism.dp_replicate=2",
        "training.mini_batch_size=3",
        "training.train_batch_size=9",
        "training.sft_warmup_steps=1",
        "training.sft_batch_size=5",
        "model.dtype=bfloat16",
        "parallelism.param_dtype=float32",
        "parallelism.cpu_offload=true",
        "parallelism.compile=true",
    ],
]


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.describe())
def test_applying_the_listed_overrides_leaves_nothing_to_fix(machine):
    """The list is complete: the overrides, parsed back as the command line would, give a runnable config."""
    for path in CONFIGS:
        for edges in EDGES:
            cfg = load_config(os.path.join(ROOT, path), edges)
            fixes, launch = machine_fixes(cfg, machine)
            fixed = load_config(os.path.join(ROOT, path), edges + [f.flag[2:] for f in fixes])
            assert machine_fixes(fixed, machine) == ([], launch), (path, edges, [f.flag for f in fixes])


def test_the_error_lists_every_override_first_then_each_reason():
    cfg = load_config(os.path.join(ROOT, "configs/dapo_32b.toml"), ["model.attention_backend=flex"])
    with pytest.raises(ConfigError) as info:
        check_runnable(cfg, TWO_CPU_PROCESSES)  # before any path: hf_path and the data paths are unset here
    lines = str(info.value).splitlines()
    assert lines[0] == (
        "this machine (no CUDA GPU, 2 processes) cannot run this configuration as set; to run it "
        "here, add: --rollout.engine=torch --parallelism.cpu_offload=false "
        "--model.attention_backend=sdpa"
    )
    assert [line.split(":")[0] for line in lines[1:]] == [
        "  rollout.engine = 'sglang'",
        "  parallelism.cpu_offload = True",
        "  model.attention_backend = 'flex'",
    ]
    assert f"SGLang on a CPU: {NO_AVX512}" in lines[1] and "FlexAttention has no backward pass on CPU" in lines[3]


def test_the_documentation_shows_the_error_as_it_is():
    with open(os.path.join(ROOT, "docs", "configuration.md")) as f:
        page = f.read()
    shown = page[page.index("configuration error: this machine") :].split("\n```")[0]
    with pytest.raises(ConfigError) as info:
        check_runnable(load_config(os.path.join(ROOT, "configs/dapo_7b.toml")), CPU)
    assert shown == f"configuration error: {info.value}"


@cpu_only
def test_the_probe_names_what_keeps_sglang_off_this_cpu():
    """In order: the CPU (AVX-512 or AMX), SGLANG_USE_CPU_ENGINE (read from the environment passed, never the
    host's), the kernel library where sglang is installed."""
    capable = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_supported()
    unset, on = probe_machine({}).sglang_cpu, probe_machine({"SGLANG_USE_CPU_ENGINE": "1"}).sglang_cpu
    if not capable:
        assert unset == on == NO_AVX512
        return
    assert unset == "SGLang runs on a CPU only with SGLANG_USE_CPU_ENGINE=1 in the environment"
    kernel = importlib.util.find_spec("sglang") and not importlib.util.find_spec("sgl_kernel")
    assert on == (
        "its kernel library (sgl_kernel) is not installed; build it from SGLang's source (docs/sglang-cpu.md)"
        if kernel
        else None
    )
    assert probe_machine({}).cpu_amx == torch.cpu._is_amx_tile_supported()


def test_probe_reads_this_machine_and_torchrun_s_process_counts():
    machine = probe_machine({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert (machine.world_size, machine.local_world_size) == (16, 8)
    assert machine.cuda_devices == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert probe_machine({}).world_size == probe_machine({}).local_world_size == 1


# ------------------------------------------------------------------------------------------ through the CLI


def run(script, *args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "SGLANG_USE_CPU_ENGINE"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@cpu_only
@pytest.mark.parametrize("recipe", ["configs/dapo_7b.toml", "configs/dapo_32b.toml"])
def test_a_gpu_recipe_on_this_cpu_is_one_error_before_any_work(recipe, checkpoint, tmp_path):
    # A data path that does not exist: the machine is checked first (it reads no file, and a recipe's paths
    # differ between the machines it may run on), so that is the error, and nothing is created.
    proc = run(
        "train.py",
        "--config",
        recipe,
        f"--model.hf_path={checkpoint / 'ckpt'}",
        "--data.train_path=/nonexistent/train.parquet",
        f"--job.run_dir={tmp_path / 'runs'}",
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr and proc.stderr.count("configuration error") == 1
    assert proc.stderr.startswith("configuration error: this machine (no CUDA GPU, 1 process) cannot run")
    assert flags_in(proc.stderr.removeprefix("configuration error: ")) == [
        "--rollout.engine=torch",
        "--parallelism.param_dtype=float32",
    ]
    assert "nonexistent" not in proc.stderr and not (tmp_path / "runs").exists()


@cpu_only
@pytest.mark.parametrize(
    "speed", [NO_COMPILE, pytest.param([], marks=pytest.mark.slow)], ids=["without-compile", "as-set"]
)
def test_the_listed_overrides_make_the_7b_recipe_train_on_this_cpu(speed, checkpoint, tmp_path):
    recipe = [
        "--config",
        "configs/dapo_7b.toml",
        f"--model.hf_path={checkpoint / 'ckpt'}",
        f"--data.train_path={checkpoint / 'train.parquet'}",
        f"--job.run_dir={tmp_path}",
    ]
    recipe += [f"--{o}" for o in SMALL + speed]
    refused = run("train.py", *recipe)
    assert refused.returncode == 2, refused.stderr
    proc = run("train.py", *recipe, *flags_in(refused.stderr.removeprefix("configuration error: ")))
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "dapo-qwen2.5-7b" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1] and rows[0]["train_tokens"] > 0  # the update phase ran


def _rank_train(rank, world_size, argv):
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)  # this CPU refuses SGLang whatever the host's environment says
    try:
        return train.main(argv)
    except ConfigError as exc:
        return str(exc)


@cpu_only
@pytest.mark.multiprocess
def test_the_listed_overrides_make_the_32b_recipe_train_on_two_cpu_processes(checkpoint, tmp_path):
    argv = [
        "--config",
        os.path.join(ROOT, "configs/dapo_32b.toml"),
        f"--model.hf_path={checkpoint / 'ckpt'}",
        f"--data.train_path={checkpoint / 'train.parquet'}",
        f"--job.run_dir={tmp_path}",
    ]
    argv += [f"--{o}" for o in SMALL + NO_COMPILE]
    refused = run_ranks(_rank_train, 2, argv)
    assert refused[0] == refused[1] and flags_in(refused[0]) == [
        "--rollout.engine=torch",
        "--parallelism.cpu_offload=false",
    ]
    assert run_ranks(_rank_train, 2, argv + flags_in(refused[0])) == [0, 0]  # bf16 FSDP mixed precision on gloo
    with open(tmp_path / "dapo-qwen2.5-32b" / "metrics.jsonl") as f:
        assert [json.loads(line)["train_tokens"] > 0 for line in f] == [True]


# ------------------------------------------------------------------------------------------ bad data files


def _bad_files(folder):
    """One file per way a prompt file can be unusable, with the message that must name it."""
    folder.mkdir(exist_ok=True)
    empty, text, no_rows, other = (
        folder / n for n in ("empty.parquet", "text.parquet", "no_rows.parquet", "other.parquet")
    )
    empty.write_bytes(b"")
    text.write_text("question,answer\nWhat is 1 + 1?,2\n")
    write_parquet_rows(synthetic_arithmetic_rows(2), str(no_rows))
    pq.write_table(pq.read_table(str(no_rows)).slice(0, 0), str(no_rows))
    write_parquet_rows([{"question": "What is 1 + 1?", "answer": "2"}], str(other))
    return {
        "empty": (empty, f"{empty}: the file is empty (0 bytes), not a parquet file"),
        "not-parquet": (text, f"{text}: cannot be read as parquet (Parquet magic bytes not found"),
        "no-rows": (
            no_rows,
            f"{no_rows}: the parquet file has no rows (columns: data_source, prompt, ability, "
            "reward_model, extra_info)",
        ),
        "missing-columns": (other, f"{other}: no column 'prompt', 'reward_model' (it has question, answer)"),
        "missing": (folder / "missing.parquet", f"data file not found: {folder / 'missing.parquet'}"),
    }


KINDS = ["empty", "not-parquet", "no-rows", "missing-columns"]


@pytest.mark.parametrize("kind", KINDS)
def test_train_refuses_an_unusable_data_file_in_one_line_before_any_work(kind, checkpoint, tmp_path, capsys):
    path, message = _bad_files(tmp_path / "data")[kind]
    capsys.readouterr()  # the parquet writer's progress bars
    argv = [
        "--config",
        os.path.join(ROOT, "configs/demo_cpu.toml"),
        "--model.preset=",
        f"--model.hf_path={checkpoint / 'ckpt'}",
        f"--data.{'eval' if kind == 'no-rows' else 'train'}_path={path}",
        f"--job.run_dir={tmp_path / 'runs'}",
    ]
    with pytest.raises(SystemExit) as info:
        train.run_cli(argv)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err.startswith(f"data error: {message}") and len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()  # refused before the run folder is made


@pytest.mark.parametrize("kind", KINDS + ["missing"])
def test_eval_refuses_an_unusable_data_file_in_one_line(kind, checkpoint, tmp_path, capsys):
    path, message = _bad_files(tmp_path / "data")[kind]
    capsys.readouterr()  # the parquet writer's progress bars
    with pytest.raises(SystemExit) as info:
        eval_command.run_cli(["--model", str(checkpoint / "ckpt"), "--data", str(path), "--metrics.progress=false"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err.startswith(f"eval.py: data error: {message}") and len(err.splitlines()) == 1


def test_the_scripts_end_a_data_problem_with_one_line_and_exit_code_2(checkpoint, tmp_path):
    path, message = _bad_files(tmp_path / "data")["no-rows"]
    proc = run(
        "train.py",
        "--config",
        "configs/demo_cpu.toml",
        "--model.preset=",
        f"--model.hf_path={checkpoint / 'ckpt'}",
        f"--data.train_path={path}",
        f"--job.run_dir={tmp_path}",
    )
    assert (proc.returncode, proc.stderr.strip()) == (2, f"data error: {message}")
    proc = run("eval.py", "--model", str(checkpoint / "ckpt"), "--data", str(path), "--metrics.progress=false")
    assert (proc.returncode, proc.stderr.strip()) == (2, f"eval.py: data error: {message}")
