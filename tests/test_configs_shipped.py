"""The shipped configs: they load and validate, hold the paper's recipe, the ablation rows switch exactly one
DAPO technique each, the demo is runnable as is, and the memory-budget arithmetic in the recipes' comments
is right for the presets' parameter counts."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from config import Config, ConfigError, config_to_dict, load_config, parse_cli
from model.args import PRESETS, num_params
from model.hf import CHECKSUMS, check_checksums
from model.hf_adapter import hf_config_from_args, read_hf_config
from preflight.checks import check_runnable
from preflight.machine import Machine
from rollout.sglang_engine import SGLANG_VERSION
from tasks.arithmetic import synthetic_arithmetic_rows
from tests.parquet_rows import write_parquet_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "**", "*.toml"), recursive=True)
)
ABLATION = [
    "1_naive_grpo",
    "2_overlong_filtering",
    "3_clip_higher",
    "4_soft_overlong_punishment",
    "5_token_level_loss",
    "6_dynamic_sampling_dapo",
]
SWITCHES = ("clip_high", "loss_agg", "overlong_filter", "overlong_penalty", "dynamic_sampling")
GB = 1e9
# The node the GPU recipes are written for: 8 Hopper GPUs, the pinned SGLang, one process per GPU.
GPU_NODE = Machine(
    cuda_devices=8, cuda_capability=(9, 0), sglang_version=SGLANG_VERSION, world_size=8, local_world_size=8
)


def load(name: str) -> Config:
    return load_config(os.path.join(ROOT, "configs", name))


def flat(cfg: Config) -> dict:
    return {f"{s}.{k}": v for s, table in config_to_dict(cfg).items() for k, v in table.items()}


def differences(a: Config, b: Config) -> set[str]:
    fa, fb = flat(a), flat(b)
    return {k for k in fa if fa[k] != fb[k]}


def test_every_expected_config_is_shipped():
    expected = {"configs/dapo_32b.toml", "configs/dapo_7b.toml", "configs/demo_cpu.toml"}
    expected |= {f"configs/{name}" for name in ONE_GPU_RECIPES}
    expected |= {f"configs/ablation/{name}.toml" for name in ABLATION}
    assert expected <= set(CONFIGS)


@pytest.mark.parametrize("path", CONFIGS)
def test_shipped_config_loads_validates_and_serializes(path):
    cfg = load_config(os.path.join(ROOT, path))
    data = config_to_dict(cfg)
    assert json.loads(json.dumps(data)) == data
    dry_cfg, args = parse_cli(["--config", os.path.join(ROOT, path), "--dry-run"])  # what `train.py --dry-run` parses
    assert dry_cfg == cfg and args.dry_run


def test_dapo_32b_holds_the_papers_recipe():
    cfg = load("dapo_32b.toml")
    expected = {
        "algorithm.clip_low": 0.2,
        "algorithm.clip_high": 0.28,
        "algorithm.clip_c": 10.0,
        "algorithm.loss_agg": "token-mean",
        "algorithm.kl_coef": 0.0,
        "algorithm.dynamic_sampling": True,
        "algorithm.filter_metric": "acc",
        "algorithm.max_num_gen_batches": 10,
        "rollout.gen_batch_multiplier": 3,
        "training.train_batch_size": 512,
        "rollout.n": 16,
        "training.mini_batch_size": 32,
        "data.max_prompt_length": 2048,
        "rollout.max_response_length": 20480,
        "algorithm.overlong_penalty": True,
        "algorithm.overlong_buffer": 4096,
        "algorithm.overlong_penalty_factor": 1.0,
        "rollout.temperature": 1.0,
        "rollout.top_p": 1.0,
        "eval.temperature": 1.0,
        "eval.top_p": 0.7,
        "eval.k": 32,
        "optimizer.lr": 1e-6,
        "optimizer.warmup_steps": 20,
        "optimizer.weight_decay": 0.1,
        "optimizer.grad_clip": 1.0,
        "parallelism.param_dtype": "bfloat16",
        "parallelism.dp_shard": -1,
        "rollout.engine": "sglang",
        "rollout.tp_size": 4,
        "rollout.dtype": "bfloat16",
    }
    assert {k: flat(cfg)[k] for k in expected} == expected
    assert cfg.training.train_batch_size // cfg.training.mini_batch_size == 16  # 16 updates per step


def test_recipe_placeholders_pass_dry_run_but_not_training(tmp_path):
    cfg = load("dapo_32b.toml")  # loading is what --dry-run does: it must succeed
    with pytest.raises(ConfigError, match=r"model\.hf_path is not set: set model\.hf_path"):
        check_runnable(cfg, GPU_NODE)
    # What check_runnable reads of a checkpoint folder: a Qwen2 config.json and the presence of tokenizer.json.
    args = PRESETS["qwen2.5-32b"]
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_args(args)))
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg.model.hf_path = str(tmp_path)
    with pytest.raises(ConfigError, match=r"data\.train_path is not set: set data\.train_path"):
        check_runnable(cfg, GPU_NODE)
    for name in ("train.parquet", "aime.parquet"):
        write_parquet_rows(synthetic_arithmetic_rows(3), str(tmp_path / name))
    cfg.data.train_path, cfg.data.eval_path = str(tmp_path / "train.parquet"), str(tmp_path / "aime.parquet")
    check_runnable(cfg, GPU_NODE)


def test_dapo_7b_changes_only_model_size_dependent_settings():
    base, cfg = load("dapo_32b.toml"), load("dapo_7b.toml")
    assert differences(base, cfg) == {
        "job.name",
        "rollout.max_response_length",
        "rollout.tp_size",
        "rollout.mem_fraction_static",
        "training.micro_batch_tokens",
        "parallelism.cpu_offload",
        "eval.max_response_length",
        "rehearse.preset",
    }
    assert cfg.rollout.max_response_length == 8192 and cfg.algorithm.overlong_buffer == 4096


def test_naive_grpo_row_turns_every_dapo_technique_off():
    alg = load("ablation/1_naive_grpo.toml").algorithm
    assert alg.clip_high == alg.clip_low == 0.2
    assert alg.loss_agg == "seq-mean-token-mean"
    assert not alg.overlong_filter and not alg.overlong_penalty and not alg.dynamic_sampling


@pytest.mark.parametrize(
    "row, switch, value",
    [
        (1, "algorithm.overlong_filter", True),
        (2, "algorithm.clip_high", 0.28),
        (3, "algorithm.overlong_penalty", True),
        (4, "algorithm.loss_agg", "token-mean"),
        (5, "algorithm.dynamic_sampling", True),
    ],
)
def test_each_ablation_row_adds_exactly_its_technique(row, switch, value):
    before, after = load(f"ablation/{ABLATION[row - 1]}.toml"), load(f"ablation/{ABLATION[row]}.toml")
    assert differences(before, after) == {"job.name", switch}
    assert flat(after)[switch] == value


def test_ablation_rows_are_the_recipe_apart_from_the_table_1_switches():
    recipe = load("dapo_32b.toml")
    for name in ABLATION:
        assert differences(recipe, load(f"ablation/{name}.toml")) <= {"job.name"} | {f"algorithm.{s}" for s in SWITCHES}
    # The cumulative DAPO row keeps overlong filtering, which verl's released script (dapo_32b.toml) leaves off.
    dapo_row = load("ablation/6_dynamic_sampling_dapo.toml")
    assert differences(recipe, dapo_row) == {"job.name", "algorithm.overlong_filter"}
    assert len({load(f"ablation/{name}.toml").job.name for name in ABLATION}) == len(ABLATION)  # separate run folders


def test_demo_is_runnable_small_and_has_every_technique_on():
    cfg = load("demo_cpu.toml")
    check_runnable(cfg, Machine())  # no paths to fill in: the shipped base, synthetic data; a CPU runs it as it is
    assert cfg.model.hf_path == f"{ROOT}/bases/demo" and cfg.data.train_path == cfg.data.eval_path == "synthetic"
    assert cfg.rollout.engine == "torch" and cfg.model.dtype == cfg.parallelism.param_dtype == "float32"
    assert (cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard, cfg.parallelism.tp) == (1, -1, 1)
    assert cfg.training.sft_warmup_steps == 0  # the base policy is the warm-up's result (configs/bases/demo_cpu.toml)
    alg = cfg.algorithm
    assert alg.clip_high > alg.clip_low and alg.loss_agg == "token-mean"
    assert alg.overlong_filter and alg.overlong_penalty and alg.dynamic_sampling
    # Small enough for the 10-minute CPU budget (measured by bench/demo_learning.py).
    assert cfg.training.train_batch_size * cfg.rollout.n <= 512 and cfg.rollout.max_response_length <= 48


@pytest.mark.parametrize("name, user", [("demo", "demo_cpu.toml"), ("chain", "ablation_cpu.toml")])
def test_a_shipped_base_is_what_its_recipe_makes_and_what_its_run_starts_from(name, user):
    folder = os.path.join(ROOT, "bases", name)
    check_checksums(folder)  # every file as SHA256SUMS lists it (not a Git LFS pointer, not changed)
    with open(os.path.join(folder, CHECKSUMS)) as f:
        listed = {line.split()[1] for line in f if line.strip()}
    assert listed == set(os.listdir(folder)) - {CHECKSUMS}  # and nothing beside them that it does not list
    recipe, run = load(f"bases/{name}_cpu.toml"), load(user)
    assert run.model.hf_path == folder and run.training.sft_warmup_steps == 0
    # The recipe is the run's own configuration from the preset's random weights with the warm-up on and no DAPO
    # step (what it writes is the base: its held-out accuracy at step 0, then the HF export).
    changed = {"job.name", "job.seed", "model.preset", "model.hf_path", "training.steps", "training.sft_warmup_steps"}
    assert differences(run, recipe) <= changed | {"eval.at_end"}
    assert (recipe.model.hf_path, recipe.training.steps, recipe.training.sft_warmup_steps) == ("", 0, 600)
    assert read_hf_config(folder) == PRESETS[recipe.model.preset]


def test_a_configs_relative_paths_are_the_repositorys_from_any_working_directory(tmp_path):
    """configs/demo_cpu.toml's `bases/demo` is the repository's folder when train.py runs from another one (never
    the id of a hub account named "bases"); the command line's relative run_dir is the working directory's; the run
    folder's config.json records both as absolute paths."""
    argv = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "demo_cpu.toml"),
            "--training.steps=0", "--eval.at_start=false", "--eval.at_end=false", "--checkpoint.export_hf=false",
            "--metrics.progress=false", "--job.run_dir=runs"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(OMP_NUM_THREADS="1", HF_ENDPOINT="http://127.0.0.1:9")  # were it looked up: no hub answers
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "runs" / "demo-cpu" / "config.json") as f:
        saved = json.load(f)
    assert saved["model"]["hf_path"] == os.path.join(ROOT, "bases", "demo")
    assert saved["job"]["run_dir"] == str(tmp_path / "runs")


def test_a_reward_functions_file_is_the_repositorys_in_a_config_and_the_working_directorys_on_the_command_line(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    gsm8k = load_config(os.path.join(ROOT, "configs", "gsm8k_cpu.toml"), ["reward.workers=1"])
    assert gsm8k.reward.function == f"{ROOT}/examples/gsm8k_reward.py:gsm8k_reward"
    assert load_config(None, ["reward.function=mine.py:score"]).reward.function == f"{tmp_path}/mine.py:score"
    assert load_config(None, ["reward.function=pkg.mod:score"]).reward.function == "pkg.mod:score"  # a module


def test_dapo_32b_memory_budget_arithmetic():
    """The numbers in dapo_32b.toml's budget comment, recomputed from the 32B preset."""
    cfg, args = load("dapo_32b.toml"), PRESETS["qwen2.5-32b"]
    p, ranks, hbm = num_params(args), 8, 80 * GB
    assert round(p / GB, 2) == 32.76
    state = 16 * p / ranks  # fp32 weights (4) + gradients (4) + two AdamW moments (8) bytes per parameter
    engine = 2 * p / cfg.rollout.tp_size  # bf16 engine weights at TP 4
    assert (round(state / GB, 1), round(engine / GB, 1)) == (65.5, 16.4)
    assert state + engine > hbm and cfg.parallelism.cpu_offload  # hence CPU offload
    assert round(16 * p / GB) == 524  # host memory per node for the offloaded state
    assert round(16 * p / 128 / GB, 1) == 4.1  # the same state over the paper's 128 GPUs
    tokens = cfg.training.micro_batch_tokens
    assert tokens == 22528
    assert round(tokens * args.hidden_size * 2 * args.num_layers / GB, 1) == 14.8  # checkpointed block inputs
    assert round(tokens * args.intermediate_size * 2 / GB, 2) == 1.25  # one MLP activation
    assert cfg.parallelism.activation_checkpoint == "full"
    kv_per_token = 2 * args.num_layers * (args.num_kv_heads // cfg.rollout.tp_size) * args.head_dim * 2
    assert kv_per_token == 64 * 1024
    kv_bytes = cfg.rollout.mem_fraction_static * hbm - engine
    assert round(kv_bytes / GB, 1) == 47.6 and round(kv_bytes / kv_per_token / 1e3) == 727
    assert int(kv_bytes / kv_per_token / tokens) == 32  # whole samples


def test_dapo_7b_memory_budget_arithmetic():
    """The numbers in dapo_7b.toml's budget comment, recomputed from the 7B preset."""
    cfg, args = load("dapo_7b.toml"), PRESETS["qwen2.5-7b"]
    p, hbm = num_params(args), 80 * GB
    state, engine = 16 * p / 8, 2 * p / cfg.rollout.tp_size
    assert (round(state / GB, 1), round(engine / GB, 1)) == (15.2, 15.2)
    assert not cfg.parallelism.cpu_offload
    tokens = cfg.training.micro_batch_tokens
    assert round(tokens * args.hidden_size * 2 * args.num_layers / GB, 1) == 4.1
    assert round(4 * tokens * args.intermediate_size * 2 / GB, 1) == 3.1
    kv_per_token = 2 * args.num_layers * args.num_kv_heads * args.head_dim * 2
    kv_bytes = cfg.rollout.mem_fraction_static * hbm - engine
    assert kv_per_token == 56 * 1024 and round(kv_bytes / GB, 1) == 36.8
    assert round(kv_bytes / kv_per_token / 1e3) == 641
    assert int(kv_bytes / kv_per_token / (cfg.data.max_prompt_length + cfg.rollout.max_response_length)) == 62
    assert state + 5 * GB + cfg.rollout.mem_fraction_static * hbm < hbm  # rollout phase: ~72 GB of 80


def test_every_documented_torchrun_command_gives_the_graceful_stop_time_to_checkpoint():
    """torchrun SIGKILLs its workers 30 s after it forwards a SIGTERM unless --shutdown-timeout says otherwise;
    every launch command the README, docs/ and the recipes' headers show gives the stop at the next phase
    boundary, and its checkpoint, 1800 s."""
    pages = ["README.md", *glob.glob("docs/*.md", root_dir=ROOT), *CONFIGS]
    launches = []
    for page in pages:
        with open(os.path.join(ROOT, page)) as f:
            launches += [(page, line) for line in f if re.match(r"[#\s]*torchrun .*train\.py", line)]
    assert {"README.md", "docs/gpu.md", "configs/dapo_32b.toml", "configs/dapo_7b.toml"} <= {p for p, _ in launches}
    for page, line in launches:
        given = re.search(r"--shutdown-timeout[= ](\d+)", line)
        assert given is not None and int(given.group(1)) >= 1800, (page, line)


# ------------------------------------------------------------------------------------------ one GPU

ONE_GPU = Machine(cuda_devices=1, cuda_capability=(8, 9), sglang_version=SGLANG_VERSION)
ONE_GPU_RECIPES = ("dapo_1.5b.toml", "dapo_1.5b_24gb.toml")


def test_the_one_gpu_recipes_are_the_papers_algorithm_on_hub_inputs_within_the_models_positions():
    recipe, cfg, small = load("dapo_32b.toml"), load("dapo_1.5b.toml"), load("dapo_1.5b_24gb.toml")
    assert cfg.model.hf_path == "Qwen/Qwen2.5-Math-1.5B" and not cfg.model.preset
    assert (cfg.data.train_path, cfg.data.eval_path) == (
        "BytedTsinghua-SIA/DAPO-Math-17k",
        "BytedTsinghua-SIA/AIME-2024",
    )
    assert {k for k in differences(recipe, cfg) if k.startswith(("algorithm.", "optimizer."))} == {
        "algorithm.overlong_buffer"
    }
    assert cfg.engine_max_seq_len == PRESETS[cfg.rehearse.preset].max_position_embeddings == 4096
    assert differences(cfg, small) == {
        "job.name",
        "rollout.mem_fraction_static",
        "training.micro_batch_tokens",
        "parallelism.cpu_offload",
        "parallelism.activation_checkpoint",
        "rehearse.gpu_memory_gb",
        "rehearse.host_memory_gb",
    }
    for one in (cfg, small):
        check_runnable(one, ONE_GPU)  # the hub ids pass as names here: train.py fetches, then checks them
        # Without SGLang the start-up check names the switch to the torch engine.
        with pytest.raises(ConfigError, match=r"to run it here, add: --rollout\.engine=torch\n"):
            check_runnable(one, Machine(cuda_devices=1, cuda_capability=(8, 9)))


def test_dapo_1_5b_memory_budget_arithmetic():
    """The numbers in the one-GPU recipes' budget comments, recomputed from the Qwen2.5-Math-1.5B preset."""
    cfg, small, args = load("dapo_1.5b.toml"), load("dapo_1.5b_24gb.toml"), PRESETS["qwen2.5-math-1.5b"]
    p = num_params(args)
    assert round(p / GB, 2) == 1.54
    assert (round(4 * p / GB, 1), round(8 * p / GB, 1), round(2 * p / GB, 1)) == (6.2, 12.3, 3.1)
    assert 24 * GB < 16 * p < 80 * GB  # fp32 parameters, gradients and AdamW: only the larger card holds them
    assert small.parallelism.cpu_offload and not cfg.parallelism.cpu_offload
    kv_per_token = 2 * args.num_layers * args.num_kv_heads * args.head_dim * 2
    assert kv_per_token == 28 * 1024
    seq = cfg.engine_max_seq_len
    assert (round(384 * seq * kv_per_token / GB, 1), round(128 * seq * kv_per_token / GB, 1)) == (45.1, 15.0)
    assert int(504_100 / seq) == 123  # the 24 GB card's KV pool in full samples
    assert cfg.prompts_per_round * cfg.rollout.n == 3072 and cfg.training.train_batch_size // 16 == 4
    assert cfg.training.micro_batch_tokens == 4 * seq and small.training.micro_batch_tokens == 2 * seq


def test_the_7b_lora_recipe_is_the_one_gpu_run_on_qwen2_5_math_7b_with_adapters_and_its_arithmetic():
    """configs/dapo_7b_lora_1gpu.toml: dapo_1.5b.toml's run on the 7B model with LoRA on every linear, and the numbers
    of its header recomputed from the qwen2.5-math-7b preset."""
    import torch

    from model.qwen2 import Qwen2
    from parallel.lora import adapter_count

    one_gpu, cfg = load("dapo_1.5b.toml"), load("dapo_7b_lora_1gpu.toml")
    assert differences(one_gpu, cfg) == {
        "job.name",
        "model.hf_path",
        "model.dtype",
        "lora.enabled",
        "lora.rank",
        "optimizer.lr",
        "parallelism.activation_checkpoint",
        "rollout.mem_fraction_static",
        "rehearse.preset",
    }
    assert (cfg.model.hf_path, cfg.model.dtype, cfg.lora.rank, cfg.lora.alpha) == (
        "Qwen/Qwen2.5-Math-7B",
        "bfloat16",
        32,
        32,
    )
    assert cfg.optimizer.lr == pytest.approx(10 * load("dapo_32b.toml").optimizer.lr)  # ten times the full-model rate
    args = PRESETS[cfg.rehearse.preset]
    assert cfg.engine_max_seq_len == args.max_position_embeddings == 4096
    p = num_params(args)
    with torch.device("meta"):
        adapters = adapter_count(Qwen2(args), cfg.lora.rank, cfg.lora.targets)
    assert (round(p / 1e9, 2), round(adapters / 1e6, 1), round(adapters / p * 100, 1)) == (7.62, 80.7, 1.1)
    assert (round(2 * p / GB, 1), round(3 * 4 * adapters / GB, 1), round(16 * p / GB)) == (15.2, 1.0, 122)
    kv_per_token = 2 * args.num_layers * args.num_kv_heads * args.head_dim * 2
    assert kv_per_token == 56 * 1024 and int(604_534 / 4096) == 147 and int(40_279 / 4096) == 9
    assert cfg.training.micro_batch_tokens == 4 * cfg.engine_max_seq_len
    check_runnable(cfg, ONE_GPU)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, largest_gb, host_gb, disk_gb",
    [
        ("dapo_1.5b.toml", 68.3, 17.8, 64.8),
        ("dapo_1.5b_24gb.toml", 20.2, 44.4, 64.8),
        ("dapo_7b_lora_1gpu.toml", 69.3, 17.8, 33.4),
    ],
)
def test_the_one_gpu_recipes_fit_as_their_headers_say(
    name, largest_gb, host_gb, disk_gb, tmp_path, monkeypatch, capsys
):
    """The rehearsal of each (about a minute of CPU each), with an empty hub cache: the preset's shapes."""
    from huggingface_hub import constants

    import train

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert train.main(["--config", os.path.join(ROOT, "configs", name), "--rehearse"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["fits"] and result["world_size"] == 1 and result["host"]["ranks_per_node"] == 1
    assert round(max(p["total_gb"] for p in result["rehearsal"]["phases"]), 1) == largest_gb
    assert round(result["host"]["peak_node_gb"], 1) == host_gb
    assert round(result["disk_gb"]["total"], 1) == disk_gb


# ------------------------------------------------------------------------------------------ your own task


def test_the_gsm8k_recipe_reads_gsm8k_by_its_columns_with_the_example_reward():
    recipe, cfg = load("dapo_32b.toml"), load("gsm8k_0.5b.toml")
    assert cfg.model.hf_path == "Qwen/Qwen2.5-0.5B-Instruct" and not cfg.model.preset
    assert (cfg.data.train_path, cfg.data.eval_path) == ("openai/gsm8k:main:train", "openai/gsm8k:main:test")
    assert (cfg.data.prompt_key, cfg.data.answer_key) == ("question", "answer")
    assert cfg.reward.function == f"{ROOT}/examples/gsm8k_reward.py:gsm8k_reward"  # the repository's file
    assert os.path.isfile(os.path.join(ROOT, "examples", "gsm8k_reward.py"))
    # DAPO's algorithm as the paper sets it, but for the buffer of Eq. 13 at a quarter of the shorter L_max.
    assert {k for k in differences(recipe, cfg) if k.startswith(("algorithm.", "optimizer."))} == {
        "algorithm.overlong_buffer"
    }
    assert cfg.algorithm.overlong_buffer * 4 == cfg.rollout.max_response_length
    assert cfg.engine_max_seq_len <= PRESETS[cfg.rehearse.preset].max_position_embeddings
    assert cfg.prompts_per_round * cfg.rollout.n == 3072 and cfg.training.train_batch_size // 16 == 4
    check_runnable(cfg, ONE_GPU)  # the hub ids pass as names here: train.py fetches, then checks them
    with pytest.raises(ConfigError, match=r"to run it here, add: --rollout\.engine=torch\n"):
        check_runnable(cfg, Machine(cuda_devices=1, cuda_capability=(8, 9)))


def test_the_gsm8k_cpu_run_is_the_demo_with_gsm8k_columns_and_the_example_reward():
    demo, cfg = load("demo_cpu.toml"), load("gsm8k_cpu.toml")
    check_runnable(cfg, Machine())  # the shipped base, the shipped jsonl files: a CPU runs it as it is
    assert differences(demo, cfg) == {
        "job.name",
        "data.train_path",
        "data.eval_path",
        "data.prompt_key",
        "data.answer_key",
        "reward.function",
        "reward.timeout_s",
        "optimizer.lr",
        "training.steps",
        "eval.interval",
    }
    assert cfg.reward.function == load("gsm8k_0.5b.toml").reward.function and cfg.training.steps == 5


@pytest.mark.slow
@pytest.mark.parametrize("gpu_gb, largest_gb", [(24, 18.5), (80, 47.0)])
def test_the_gsm8k_recipe_fits_one_gpu_as_its_header_says(gpu_gb, largest_gb, tmp_path, monkeypatch, capsys):
    """The rehearsal on each card (about 10 s of CPU each), with an empty hub cache: the preset's shapes."""
    from huggingface_hub import constants

    import train

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    config = os.path.join(ROOT, "configs", "gsm8k_0.5b.toml")
    assert train.main(["--config", config, "--rehearse", f"--rehearse.gpu_memory_gb={gpu_gb}"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["fits"] and result["world_size"] == 1
    assert round(max(p["total_gb"] for p in result["rehearsal"]["phases"]), 1) == largest_gb
    assert round(result["host"]["peak_node_gb"], 1) == 16.6 and round(result["disk_gb"]["total"], 1) == 20.7
