"""config/: TOML loading, `base` includes, command-line overrides with type conversion, and every error."""

import dataclasses
import inspect
import json
import os
import re
import textwrap

import pytest

import config
from config import Config, ConfigError, config_to_dict, load_config, parse_cli, validate
from config.loader import coerce
from data.prompts import DataError
from model.args import get_preset
from preflight.checks import check_runnable
from preflight.limits import check_rollout_batch_fits, check_torch_engine_fits
from preflight.machine import Machine
from tasks.arithmetic import synthetic_arithmetic_rows
from tests.parquet_rows import write_parquet_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return str(path)


# ------------------------------------------------------------------------------------------ defaults


def test_defaults_are_valid_and_are_the_papers_algorithm():
    cfg = load_config(None)
    assert cfg == dataclasses.replace(Config(), job=dataclasses.replace(Config().job, run_dir=f"{ROOT}/runs"))
    validate(cfg)
    alg, opt = cfg.algorithm, cfg.optimizer
    # DAPO (arXiv 2503.14476) Sec. 4.1 and verl's recipe: the values every default must reproduce.
    assert (alg.clip_low, alg.clip_high, alg.clip_c, alg.loss_agg) == (0.2, 0.28, 10.0, "token-mean")
    assert (alg.overlong_penalty, alg.overlong_buffer, alg.overlong_penalty_factor) == (True, 4096, 1.0)
    assert (alg.dynamic_sampling, alg.filter_metric, alg.max_num_gen_batches) == (True, "acc", 10)
    assert (alg.adv_eps, alg.kl_coef) == (1e-6, 0.0)
    assert (opt.lr, opt.warmup_steps, opt.weight_decay, opt.grad_clip) == (1e-6, 20, 0.1, 1.0)
    assert (cfg.rollout.n, cfg.training.train_batch_size, cfg.training.mini_batch_size) == (16, 512, 32)
    assert (cfg.eval.k, cfg.eval.temperature, cfg.eval.top_p) == (32, 1.0, 0.7)


def test_every_field_has_a_default_and_a_one_line_comment():
    for name, cls in config.SECTIONS.items():
        source = inspect.getsource(cls)
        for f in dataclasses.fields(cls):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, (name, f.name)
            line = re.search(rf"^    {f.name}: .*$", source, re.M)
            assert line and "  # " in line.group(0), f"{name}.{f.name} has no comment"


# ------------------------------------------------------------------------------------------ loading


def test_toml_values_are_applied_and_typed(tmp_path):
    path = write(
        tmp_path / "run.toml",
        """
        [job]
        name = "x"
        [algorithm]
        clip_c = 3            # an int where a float is expected widens to float
        loss_agg = "seq-mean-token-sum-norm"
        dynamic_sampling = false
        [optimizer]
        betas = [0.9, 0.95]   # a TOML array becomes the tuple of the field
    """,
    )
    cfg = load_config(path)
    assert cfg.job.name == "x"
    assert cfg.algorithm.clip_c == 3.0 and type(cfg.algorithm.clip_c) is float
    assert cfg.algorithm.loss_agg == "seq-mean-token-sum-norm" and cfg.algorithm.dynamic_sampling is False
    assert cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.training == Config().training  # untouched sections keep their defaults


def test_overrides_convert_by_field_type_and_win_over_the_file(tmp_path):
    path = write(tmp_path / "run.toml", "[training]\nsteps = 5\n[algorithm]\nclip_high = 0.3\n")
    cfg = load_config(
        path,
        [
            "training.steps=7",  # int, beats the file
            "--algorithm.overlong_filter=true",  # a leading -- is accepted here too
            "checkpoint.resume=0",  # bool from 0/1
            "metrics.tensorboard=FALSE",
            "optimizer.betas=0.8,0.9",  # tuple from a comma list
            "optimizer.lr=3e-5",  # float
            "parallelism.dp_shard=-1",  # negative int
            "rollout.engine=sglang",  # Literal
            "eval.eval_size=10",  # Optional[int]
            "model.hf_path=",  # empty string
            "job.name=123",  # a str field keeps digits as text
            "training.steps=9",  # the last override wins
        ],
    )
    assert cfg.training.steps == 9 and cfg.algorithm.clip_high == 0.3
    assert cfg.algorithm.overlong_filter is True and cfg.checkpoint.resume is False and cfg.metrics.tensorboard is False
    assert cfg.optimizer.betas == (0.8, 0.9) and cfg.optimizer.lr == 3e-5
    assert cfg.parallelism.dp_shard == -1 and cfg.rollout.engine == "sglang"
    assert cfg.eval.eval_size == 10 and cfg.model.hf_path == "" and cfg.job.name == "123"
    assert load_config(None, ["eval.eval_size=none"]).eval.eval_size is None
    assert load_config(None, ["optimizer.betas=[0.5, 0.6]"]).optimizer.betas == (0.5, 0.6)


def test_union_fields_try_each_member_in_order():
    convert = lambda text, tp: coerce(text, tp, "a.b", "command line", from_text=True)  # noqa: E731
    assert convert("5", int | str) == 5 and convert("five", int | str) == "five"
    assert convert("null", float | None) is None and convert("2.5", float | None) == 2.5
    assert convert("1,2,3", list[int]) == [1, 2, 3] and convert("", tuple[int, ...]) == ()
    with pytest.raises(ConfigError, match=r"a\.b = 'x' \(command line\): wrong type; a\.b expects an int or none"):
        convert("x", int | None)


def test_base_is_resolved_relative_to_its_file_and_chains(tmp_path, monkeypatch):
    write(tmp_path / "root.toml", "[training]\nsteps = 1\ntrain_batch_size = 64\n[rollout]\nn = 4\n")
    write(tmp_path / "mid" / "mid.toml", 'base = "../root.toml"\n[training]\nsteps = 2\n')
    leaf = write(tmp_path / "mid" / "deeper" / "leaf.toml", 'base = "../mid.toml"\n[rollout]\nn = 8\n')
    monkeypatch.chdir(tmp_path / "mid" / "deeper")  # bases must not depend on the working directory
    cfg = load_config("leaf.toml")
    assert (cfg.training.steps, cfg.training.train_batch_size, cfg.rollout.n) == (2, 64, 8)
    monkeypatch.chdir(tmp_path)
    assert load_config(leaf) == cfg


def test_config_to_dict_is_json_and_round_trips_through_overrides():
    cfg = load_config(None, ["optimizer.betas=0.5,0.6", "eval.eval_size=3", "model.preset=tiny"])
    data = config_to_dict(cfg)
    assert json.loads(json.dumps(data)) == data
    assert set(data) == set(config.SECTIONS) and data["optimizer"]["betas"] == [0.5, 0.6]

    def text(v):
        if isinstance(v, bool) or v is None:
            return {True: "true", False: "false", None: "none"}[v]
        return ",".join(map(str, v)) if isinstance(v, list) else str(v)

    overrides = [f"{s}.{k}={text(v)}" for s, table in data.items() for k, v in table.items()]
    assert load_config(None, overrides) == cfg  # every field converts back from its command-line form


# ------------------------------------------------------------------------------------------ command line


def test_parse_cli_config_dry_run_and_both_override_forms(tmp_path):
    path = write(tmp_path / "run.toml", "[training]\nsteps = 5\n")
    cfg, args = parse_cli(
        [
            "--config",
            path,
            "--dry-run",
            "--training.steps",
            "11",
            "--parallelism.dp_shard",
            "-1",
            "--algorithm.clip_high=0.3",
        ]
    )
    assert args.config == path and args.dry_run is True
    assert args.overrides == ["training.steps=11", "parallelism.dp_shard=-1", "algorithm.clip_high=0.3"]
    assert cfg.training.steps == 11 and cfg.parallelism.dp_shard == -1 and cfg.algorithm.clip_high == 0.3


def test_parse_cli_defaults_to_the_demo_config():
    cfg, args = parse_cli([])
    root = os.path.dirname(os.path.dirname(config.__file__))
    assert os.path.samefile(args.config, os.path.join(root, "configs", "demo_cpu.toml"))
    assert args.dry_run is False and cfg.model.hf_path == os.path.join(root, "bases", "demo")


def test_parse_cli_errors():
    with pytest.raises(ConfigError, match=r"--training\.steps \(command line\) needs a value"):
        parse_cli(["--training.steps"])
    with pytest.raises(ConfigError, match="needs a value"):
        parse_cli(["--training.steps", "--dry-run"])
    with pytest.raises(
        ConfigError, match=r"unknown key 'training\.stpes' \(command line\); did you mean 'training\.steps'"
    ):
        parse_cli(["--training.stpes=3"])
    with pytest.raises(SystemExit):  # flags that are not settings are argparse's to refuse
        parse_cli(["--no-such-flag"])


# ------------------------------------------------------------------------------------------ errors: names


def test_unknown_section_names_it_the_file_and_the_closest_section(tmp_path):
    path = write(tmp_path / "bad.toml", "[algorthm]\nclip_low = 0.2\n")
    with pytest.raises(
        ConfigError, match=rf"unknown section \[algorthm\] \({re.escape(path)}\); did you mean \[algorithm\]"
    ):
        load_config(path)


def test_unknown_key_names_it_the_file_and_the_closest_key(tmp_path):
    path = write(tmp_path / "bad.toml", "[algorithm]\nclip_hihg = 0.3\n")
    with pytest.raises(
        ConfigError,
        match=rf"unknown key 'algorithm\.clip_hihg' \({re.escape(path)}\); "
        r"did you mean 'algorithm\.clip_high'\?",
    ):
        load_config(path)


def test_key_in_the_wrong_section_points_to_the_right_one(tmp_path):
    path = write(tmp_path / "bad.toml", "[training]\nlr = 1e-5\n")
    with pytest.raises(ConfigError, match=r"unknown key 'training\.lr'.*did you mean 'optimizer\.lr'"):
        load_config(path)
    path = write(tmp_path / "top.toml", "lr = 1e-5\n")
    with pytest.raises(ConfigError, match=r"unknown top-level key 'lr'.*did you mean 'optimizer\.lr'"):
        load_config(path)


def test_unknown_key_without_a_close_match_lists_the_valid_keys():
    with pytest.raises(
        ConfigError, match=r"unknown key 'job\.zzz' \(command line\); valid keys of \[job\]: name, run_dir, seed"
    ):
        load_config(None, ["job.zzz=1"])
    with pytest.raises(ConfigError, match=r"unknown section \[zzz\] \(command line\); valid sections: job, model"):
        load_config(None, ["zzz.a=1"])


@pytest.mark.parametrize("item", ["training.steps", "steps=3", ".steps=3", "training.=3"])
def test_malformed_override(item):
    with pytest.raises(ConfigError, match="is not of the form section.key=value"):
        load_config(None, [item])


# ------------------------------------------------------------------------------------------ errors: types


@pytest.mark.parametrize(
    "line, message",
    [
        ('[training]\nsteps = "ten"', r"training\.steps = 'ten' \(FILE\): wrong type; training\.steps expects an int"),
        ("[training]\nsteps = 1.5", r"training\.steps = 1\.5 \(FILE\): wrong type; training\.steps expects an int"),
        ("[training]\nsteps = true", r"training\.steps = True \(FILE\): wrong type; training\.steps expects an int"),
        ("[algorithm]\noverlong_filter = 1", r"algorithm\.overlong_filter = 1 \(FILE\): wrong type; .* expects a bool"),
        ('[optimizer]\nlr = "1e-6"', r"optimizer\.lr = '1e-6' \(FILE\): wrong type; optimizer\.lr expects a number"),
        ("[optimizer]\nlr = nan", r"optimizer\.lr = nan \(FILE\): wrong type; optimizer\.lr expects a finite number"),
        (
            "[optimizer]\nbetas = [0.9]",
            r"optimizer\.betas = \[0\.9\] \(FILE\): wrong type; .* expects a list of 2 values",
        ),
        ("[model]\nhf_path = 3", r"model\.hf_path = 3 \(FILE\): wrong type; model\.hf_path expects a string"),
        (
            '[rollout]\nengine = "vllm"',
            r"rollout\.engine = 'vllm' \(FILE\): unknown value; expected one of 'torch', 'sglang'",
        ),
        (
            "[eval]\neval_size = 2.5",
            r"eval\.eval_size = 2\.5 \(FILE\): wrong type; eval\.eval_size expects an int or none",
        ),
        ("[training]\nsteps = {a = 1}", r"training\.steps = \{'a': 1\} \(FILE\): wrong type"),
        ("training = 3", r"FILE: 'training' must be a table \(\[training\]\)"),
    ],
)
def test_wrong_type_in_a_file_names_key_file_and_expected_type(tmp_path, line, message):
    path = write(tmp_path / "bad.toml", line + "\n")
    with pytest.raises(ConfigError, match=message.replace("FILE", re.escape(path))):
        load_config(path)


@pytest.mark.parametrize(
    "item, message",
    [
        ("training.steps=ten", r"training\.steps = 'ten' \(command line\): wrong type; training\.steps expects an int"),
        ("checkpoint.resume=yes", r"checkpoint\.resume = 'yes' \(command line\): wrong type; .* expects a bool"),
        ("optimizer.betas=0.9", r"optimizer\.betas = '0\.9' \(command line\): wrong type; .* a list of 2 values"),
        ("optimizer.betas=[0.9, x]", r"optimizer\.betas = '\[0\.9, x\]' \(command line\): wrong type"),
        ("optimizer.lr=inf", r"optimizer\.lr = 'inf' \(command line\): wrong type; .* a finite number"),
        (
            "algorithm.loss_agg=mean",
            r"algorithm\.loss_agg = 'mean' \(command line\): unknown value; expected one of 'token-mean'",
        ),
    ],
)
def test_wrong_type_on_the_command_line(item, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [item])


def test_toml_syntax_error_names_the_file_and_line(tmp_path):
    path = write(tmp_path / "broken.toml", '[job]\nname = "x"\nseed = = 3\n')
    with pytest.raises(ConfigError, match=rf"{re.escape(path)}: invalid TOML: .*line 3"):
        load_config(path)


def test_missing_file_and_bad_bases(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.toml"):
        load_config(str(tmp_path / "nope.toml"))
    with pytest.raises(ConfigError, match=rf"cannot read config file {re.escape(str(tmp_path))}: Is a directory"):
        load_config(str(tmp_path))
    path = write(tmp_path / "a.toml", 'base = "missing.toml"\n')
    with pytest.raises(ConfigError, match=rf"{re.escape(path)}: base file 'missing.toml' not found"):
        load_config(path)
    path = write(tmp_path / "b.toml", "base = 3\n")
    with pytest.raises(ConfigError, match="base must be the path of another TOML file, got 3"):
        load_config(path)
    write(tmp_path / "c.toml", 'base = "d.toml"\n')
    path = write(tmp_path / "d.toml", 'base = "c.toml"\n')
    with pytest.raises(ConfigError, match="base files form a cycle"):
        load_config(path)


# ------------------------------------------------------------------------------------------ errors: values


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.max_prompt_length=0"], r"data\.max_prompt_length = 0 \(command line\): must be >= 1"),
        (["rollout.max_response_length=-5"], r"rollout\.max_response_length = -5 \(command line\): must be >= 1"),
        (["training.train_batch_size=0"], r"training\.train_batch_size = 0 .*must be >= 1"),
        (["training.micro_batch_tokens=-1"], r"training\.micro_batch_tokens = -1 .*must be >= 1"),
        (["rollout.n=0"], r"rollout\.n = 0 .*must be >= 1"),
        (["eval.k=0"], r"eval\.k = 0 .*must be >= 1"),
        (["training.steps=-1"], r"training\.steps = -1 .*must be >= 0"),
        (["optimizer.lr=0"], r"optimizer\.lr = 0\.0 .*must be in \(0, 3\.403e\+38\]"),
        (["optimizer.lr=1e39"], r"optimizer\.lr = 1e\+39 .*must be in \(0, 3\.403e\+38\] \(float32 holds no more\)"),
        (["training.sft_lr=1e39"], r"training\.sft_lr = 1e\+39 .*\(float32 holds no more\)"),
        (["optimizer.weight_decay=-0.1"], r"optimizer\.weight_decay = -0\.1 .*must be >= 0"),
        (["algorithm.clip_low=0"], r"algorithm\.clip_low = 0\.0 .*must be in \(0, 1\)"),
        (["algorithm.clip_low=1"], r"algorithm\.clip_low = 1\.0 .*must be in \(0, 1\)"),
        (["algorithm.clip_high=0"], r"algorithm\.clip_high = 0\.0 .*must be in \(0, 3\.403e\+38\]"),
        (["algorithm.clip_high=-0.1"], r"algorithm\.clip_high = -0\.1 .*must be in \(0, "),
        (["algorithm.clip_high=1e39"], r"algorithm\.clip_high = 1e\+39 .*\(0, 3\.403e\+38\] \(the upper clip bound 1 "),
        (["algorithm.clip_c=1"], r"algorithm\.clip_c = 1\.0 .*must be in \(1, 3\.403e\+38\]"),
        (["algorithm.clip_c=1e39"], r"algorithm\.clip_c = 1e\+39 .*must be in \(1, 3\.403e\+38\]"),
        (["algorithm.overlong_penalty_factor=4e10"], r"overlong_penalty_factor = 4.*must be in \[0, 3\.8e\+10\]"),
        (
            ["algorithm.truncated_is_cap=1e39"],
            r"algorithm\.truncated_is_cap = 1e\+39 .*must be in \(0, 4\.852e\+08\] \(r's clamp",
        ),
        (["rollout.temperature=1e-45"], r"rollout\.temperature = 1e-45 .*must be 0 \(greedy\) or in \[5\.421e-20, "),
        (["eval.temperature=1e39"], r"eval\.temperature = 1e\+39 .*must be 0 \(greedy\) or in \[5\.421e-20, 3\.403e"),
        (
            ["training.mini_batch_size=48"],
            r"training\.train_batch_size = 512 \(default\): must be divisible by training\.mini_batch_size = 48",
        ),
        (
            ["rollout.max_response_length=1000", "training.micro_batch_tokens=4000"],
            r"algorithm\.overlong_buffer = 4096 \(default\): must be <= rollout\.max_response_length = 1000",
        ),
        (["rollout.temperature=-0.5"], r"rollout\.temperature = -0\.5 .*must be 0 \(greedy\) or in"),
        (["eval.temperature=-1"], r"eval\.temperature = -1\.0 .*must be 0 \(greedy\) or in"),
        (["rollout.top_p=0"], r"rollout\.top_p = 0\.0 .*must be in \(0, 1\]"),
        (["rollout.top_p=1.01"], r"rollout\.top_p = 1\.01 .*must be in \(0, 1\]"),
        (["eval.top_p=2"], r"eval\.top_p = 2\.0 .*must be in \(0, 1\]"),
        (["rollout.top_k=0"], r"rollout\.top_k = 0 .*must be -1 \(off\) or >= 1"),
        (["rollout.mem_fraction_static=1"], r"rollout\.mem_fraction_static = 1\.0 .*must be in \(0, 1\)"),
        (["algorithm.kl_coef=0.001"], r"algorithm\.kl_coef = 0\.001 \(command line\): must be 0: DAPO removes the KL"),
        (["rollout.n=1"], r"rollout\.n = 1 .*must be >= 2 with algorithm\.dynamic_sampling"),
        (
            ["training.micro_batch_tokens=4096"],
            r"training\.micro_batch_tokens = 4096 .*"
            r"must be >= data\.max_prompt_length \+ rollout\.max_response_length = 22528",
        ),
        (["model.preset=qwen9"], r"model\.preset = 'qwen9' .*unknown preset; known presets: qwen2\.5-0\.5b"),
        (
            ["model.preset=tiny", "model.hf_path=/ckpt"],
            r"model\.preset = 'tiny' .*set either model\.preset or model\.hf_path",
        ),
        (["parallelism.dp_shard=0"], r"parallelism\.dp_shard = 0 .*must be -1 \(all remaining ranks\) or >= 1"),
        (["parallelism.tp=0"], r"parallelism\.tp = 0 .*must be >= 1"),
        (["optimizer.betas=0.9,1.0"], r"optimizer\.betas = \(0\.9, 1\.0\) .*both betas must be in \[0, 1\)"),
        (["eval.greedy=true"], r"eval\.k = 32 \(default\): must be 1 with eval\.greedy"),
        (["eval.eval_size=0"], r"eval\.eval_size = 0 .*must be >= 1 \(or none"),
        (["eval.max_response_length=0"], r"eval\.max_response_length = 0 .*must be >= 1"),
        (["job.name=a/b"], r"job\.name = 'a/b' .*without path separators"),
        (["job.name="], r"job\.name = '' .*non-empty folder name"),
        (["algorithm.adv_eps=0"], r"algorithm\.adv_eps = 0\.0 .*must be > 0"),
        (["algorithm.overlong_penalty_factor=-1"], r"algorithm\.overlong_penalty_factor = -1\.0 .*must be in \[0, "),
        (["algorithm.max_num_gen_batches=0"], r"algorithm\.max_num_gen_batches = 0 .*must be >= 1"),
        (["parallelism.ac_every_k_blocks=-1"], r"parallelism\.ac_every_k_blocks = -1 .*must be >= 0"),
        (["training.ppo_epochs=0"], r"training\.ppo_epochs = 0 .*must be >= 1"),
        (["algorithm.carry_over_max_staleness=-1"], r"algorithm\.carry_over_max_staleness = -1 .*must be >= 0"),
        (["algorithm.truncated_is_cap=0"], r"algorithm\.truncated_is_cap = 0\.0 .*must be in \(0, "),
        (
            ["data.synthetic_difficulty=7"],
            r"data\.synthetic_difficulty = 7 .*must be one of the arithmetic task's levels "
            r"\[1, 2, 3, 4, 5\]",
        ),
        (
            ["data.synthetic_difficulty=1"],
            r"data\.synthetic_num_train = 2000 \(default\): must be <= 72: the train split "
            r"of difficulty 1 has no more distinct problems",
        ),
        (["data.synthetic_num_eval=2000"], r"data\.synthetic_num_eval = 2000 \(command line\): must be <= 1800"),
        (["eval.top_k=0"], r"eval\.top_k = 0 \(command line\): must be -1 \(off\) or >= 1"),
        (
            ["eval.k=4", "eval.pass_at=1,8"],
            r"eval\.pass_at = \(1, 8\) \(command line\): each j must be in "
            r"\[1, eval\.k = 4\]",
        ),
    ],
)
def test_impossible_values_name_the_key_and_the_constraint(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_each_float_bound_is_what_float32_carries_through_the_sampler_the_reward_and_the_loss():
    """At the bounds of config/schema.py: the sampler draws the argmax with a finite log-prob at the lowest
    temperature (at 1e-45 every logit / T was inf and the draw NaN garbage); the policy losses, at the widest clip
    bounds and with the largest overlong factor under Dr. GRPO (advantages not divided by the std) on ratios at
    their e^20 clamp, give a finite loss and a gradient whose squares float32 sums; the largest truncated-IS cap
    gives finite weights."""
    import math

    import torch

    from config.schema import ADVANTAGE_MAX, FLOAT32_MAX, FLOAT32_ROOT
    from rl.advantage import group_advantages
    from rl.correction import truncated_is_weights
    from rl.loss import LOG_RATIO_CLAMP, LossSettings, policy_loss
    from rl.loss_modes import GlobalCounts
    from rl.reward import overlong_penalty
    from rollout.sampling import sample

    logits = torch.tensor([[3.0, -1.0, 7.5, 0.25], [-2.0, 4.0, 1.0, 3.9]])
    tokens, logp = sample(logits, 1 / FLOAT32_ROOT)
    assert tokens.tolist() == [2, 1] and torch.isfinite(logp).all()
    assert torch.isnan(sample(logits, 1e-45)[1]).all()  # what the bound refuses
    penalty = overlong_penalty(9, 8, 4, ADVANTAGE_MAX - 2)  # beyond L_max: -factor
    rewards = torch.tensor([1.0 + penalty, -1.0 + penalty, 1.0, -1.0])  # float32, as the trainer scores
    advantages = group_advantages(rewards, group_size=4, norm_by_std=False)[:, None].expand(4, 3)
    assert advantages.abs().max() <= ADVANTAGE_MAX
    mask = torch.ones(4, 3, dtype=torch.bool)
    for variant in ("dapo", "gspo", "cispo"):
        logp = torch.full((4, 3), LOG_RATIO_CLAMP, requires_grad=True)  # r = e^20 against old log-probs of 0
        settings = LossSettings(clip_high=FLOAT32_MAX, clip_c=FLOAT32_MAX, variant=variant)
        loss, _ = policy_loss(logp, torch.zeros(4, 3), advantages, mask, settings, GlobalCounts(tokens=12))
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad.square().sum()), variant
    weights = truncated_is_weights(torch.full((1, 2), 100.0), torch.zeros(1, 2), cap=math.exp(LOG_RATIO_CLAMP))
    assert torch.isfinite(weights).all() and torch.isinf(truncated_is_weights(weights, weights * 0, cap=1e39)).all()


def test_overlong_buffer_is_only_bound_by_the_response_length_when_the_penalty_is_on():
    cfg = load_config(None, ["algorithm.overlong_penalty=false", "rollout.max_response_length=1000"])
    assert cfg.algorithm.overlong_buffer == 4096


def test_value_errors_name_the_file_that_set_the_value(tmp_path):
    path = write(tmp_path / "run.toml", "[algorithm]\nclip_low = 1.5\n")
    with pytest.raises(ConfigError, match=rf"algorithm\.clip_low = 1\.5 \({re.escape(path)}\): must be in \(0, 1\)"):
        load_config(path)
    base = write(tmp_path / "base.toml", "[algorithm]\nclip_c = 0.5\n")
    child = write(tmp_path / "child.toml", 'base = "base.toml"\n[job]\nname = "c"\n')
    with pytest.raises(ConfigError, match=rf"algorithm\.clip_c = 0\.5 \({re.escape(base)}\): must be in \(1, "):
        load_config(child)


def test_validate_checks_programmatic_edits():
    cfg = Config()
    cfg.algorithm.clip_c = 0.9
    with pytest.raises(ConfigError, match=r"^algorithm\.clip_c = 0\.9: must be in \(1, "):
        validate(cfg)


# ------------------------------------------------------------------------------------------ check_runnable

# The path and length checks, on a machine that runs the defaults (bf16 compute over fp32 weights needs CUDA
# in one process); what a machine can run is tested in tests/test_cpu_guard.py.
ONE_GPU = Machine(cuda_devices=1, cuda_capability=(9, 0))


def _checkpoint_dir(path, max_positions: int) -> None:
    """What check_runnable reads of a checkpoint directory: a Qwen2 config.json, and a tokenizer.json (present)."""
    from model.args import PRESETS
    from model.hf_adapter import hf_config_from_args

    args = dataclasses.replace(PRESETS["tiny"], max_position_embeddings=max_positions)
    (path / "config.json").write_text(json.dumps(hf_config_from_args(args)))
    (path / "tokenizer.json").write_text("{}")


def test_check_runnable_names_each_missing_setting(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.hf_path is not set: set model\.hf_path"):
        check_runnable(load_config(None), ONE_GPU)
    with pytest.raises(ConfigError, match=r"model\.hf_path = '.*' is not a checkpoint directory \(no config\.json\)"):
        check_runnable(load_config(None, [f"model.hf_path={tmp_path}"]), ONE_GPU)
    _checkpoint_dir(tmp_path, max_positions=131072)
    with pytest.raises(ConfigError, match=r"data\.train_path = '.*/x\.parquet' does not exist"):
        check_runnable(load_config(None, [f"model.hf_path={tmp_path}", "data.train_path=x.parquet"]), ONE_GPU)
    with pytest.raises(ConfigError, match=r"data\.eval_path is not set: set data\.eval_path"):
        check_runnable(load_config(None, [f"model.hf_path={tmp_path}", "data.eval_path="]), ONE_GPU)
    with pytest.raises(ConfigError, match=r"model\.tokenizer_path = '.*/nowhere' is not a directory"):
        check_runnable(load_config(None, [f"model.hf_path={tmp_path}", "model.tokenizer_path=nowhere"]), ONE_GPU)
    check_runnable(load_config(None, [f"model.hf_path={tmp_path}"]), ONE_GPU)  # synthetic data needs no file


def test_check_runnable_refuses_sequences_longer_than_the_model_allows(tmp_path):
    small = [
        "model.preset=tiny",
        "data.max_prompt_length=100",
        "rollout.max_response_length=900",
        "algorithm.overlong_buffer=100",
        "training.micro_batch_tokens=1000",
    ]
    check_runnable(load_config(None, small), ONE_GPU)  # 1000 tokens = the tiny preset's 1024 positions minus 24
    with pytest.raises(ConfigError, match=r"= 1100 tokens exceed the model's max_position_embeddings = 1024"):
        check_runnable(load_config(None, small + ["eval.max_response_length=1000"]), ONE_GPU)
    _checkpoint_dir(tmp_path, max_positions=4096)
    with pytest.raises(ConfigError, match=r"= 22528 tokens exceed the model's max_position_embeddings = 4096"):
        check_runnable(load_config(None, [f"model.hf_path={tmp_path}"]), ONE_GPU)


def test_a_rollout_batch_no_machine_holds_is_refused_with_its_figure():
    cfg = load_config(None, ["training.train_batch_size=1000000000", "training.mini_batch_size=1000000000"])
    # 3e9 prompts x 16 samples x 22528 tokens x 12 bytes = 1.2976128e16 bytes.
    with pytest.raises(ConfigError, match=r"take at least 12,976,128\.0 GB on this node .* more than its 1,000\.0 GB"):
        check_rollout_batch_fits(cfg, memory_bytes=10**12)
    check_rollout_batch_fits(load_config(os.path.join(ROOT, "configs", "dapo_32b.toml")), memory_bytes=10**12)
    with pytest.raises(ConfigError, match=r"one step's samples cannot fit this machine"):  # and at run start
        check_runnable(load_config(None, ["training.train_batch_size=10000000000000", "model.preset=tiny"]), ONE_GPU)


def test_the_torch_engines_kv_cache_is_sized_against_its_gpus_memory_on_a_gpu(monkeypatch):
    import torch

    class H100:
        total_memory = 80 * 10**9

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H100)
    sizes = ["model.preset=qwen2.5-7b", "rollout.dtype=bfloat16", "data.max_prompt_length=1024"]
    # 7B: k and v of 28 layers x 4 KV heads x 128 in bfloat16 = 57,344 bytes a token; 1024 + 20480 tokens a
    # sequence = 1344 blocks of 16.
    check_torch_engine_fits(load_config(None, [*sizes, "rollout.max_batch_size=64"]), get_preset("qwen2.5-7b"), 21504)
    cfg = load_config(None, [*sizes, "rollout.max_batch_size=128"])  # 128 x 21504 x 57344 = 157.8 GB
    with pytest.raises(ConfigError) as refused:
        check_torch_engine_fits(cfg, get_preset("qwen2.5-7b"), 21504)
    assert str(refused.value) == (
        "the torch engine's KV cache cannot fit this machine: rollout.max_batch_size = 128 sequences of up to 21504 "
        "tokens take 157.8 GB (57,344 bytes a token: k and v of 28 layers x 4 KV heads x 128 in bfloat16), more "
        "than the 80.0 GB of its GPU; lower rollout.max_batch_size"
    )
    check_torch_engine_fits(load_config(None, [*sizes, "rollout.engine=sglang"]), get_preset("qwen2.5-7b"), 21504)


def test_eval_path_is_only_required_when_the_run_evaluates(tmp_path):
    _checkpoint_dir(tmp_path, max_positions=131072)
    no_eval = [
        f"model.hf_path={tmp_path}",
        "data.eval_path=",
        "eval.interval=0",
        "eval.at_start=false",
        "eval.at_end=false",
    ]
    check_runnable(load_config(None, no_eval), ONE_GPU)
    for evaluation in ("eval.interval=5", "eval.at_start=true", "eval.at_end=true"):
        with pytest.raises(
            ConfigError,
            match=r"data\.eval_path is not set: .* or to 'synthetic' \(or turn evaluation "
            r"off: eval\.interval = 0, eval\.at_start = eval\.at_end = false\)",
        ):
            check_runnable(load_config(None, no_eval + [evaluation]), ONE_GPU)


def test_check_runnable_reads_the_data_files_footers(tmp_path):
    _checkpoint_dir(tmp_path, max_positions=131072)
    empty, rows = tmp_path / "empty.parquet", tmp_path / "rows.parquet"
    empty.write_bytes(b"")
    write_parquet_rows(synthetic_arithmetic_rows(3), str(rows))
    with pytest.raises(DataError, match=f"{empty}: the file is empty"):
        check_runnable(load_config(None, [f"model.hf_path={tmp_path}", f"data.train_path={empty}"]), ONE_GPU)
    with pytest.raises(DataError, match=f"{empty}: the file is empty"):
        check_runnable(
            load_config(None, [f"model.hf_path={tmp_path}", f"data.train_path={rows}", f"data.eval_path={empty}"]),
            ONE_GPU,
        )
    check_runnable(
        load_config(None, [f"model.hf_path={tmp_path}", f"data.train_path={rows}", f"data.eval_path={rows}"]), ONE_GPU
    )


# ------------------------------------------------------------------------------------------ the generic loader


def test_the_loader_knows_nothing_of_the_project():
    import ast

    from config import loader

    tree = ast.parse(inspect.getsource(loader))
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported.isdisjoint({"config", "model", "rl", "rollout", "trainer", "parallel", "observe"}), imported


def test_the_loader_serves_any_schema_with_bounds_beside_fields_and_rules_per_section(tmp_path):
    from config.loader import at_least, load

    @dataclasses.dataclass
    class Shop:
        items: int = at_least(1, 0)  # items on the shelf
        shelves: int = at_least(1, 1)  # shelves

        def rules(self):
            yield "items", self.items <= 10 * self.shelves, f"must be <= 10 x shop.shelves = {10 * self.shelves}"

    @dataclasses.dataclass
    class Root:
        shop: Shop = dataclasses.field(default_factory=Shop)

        def rules(self):
            yield "shop.shelves", self.shop.shelves < 100, "must be < 100"

    path = write(
        tmp_path / "shop.toml",
        """
        [shop]
        shelves = 2
    """,
    )
    assert load(Root, str(path), ["shop.items=20"]).shop == Shop(items=20, shelves=2)
    with pytest.raises(ConfigError, match=r"shop\.items = 21 \(command line\): must be <= 10 x shop\.shelves = 20"):
        load(Root, str(path), ["shop.items=21"])
    empty = write(tmp_path / "empty.toml", "[shop]\nshelves = 0\n")
    with pytest.raises(ConfigError, match=rf"shop\.shelves = 0 \({re.escape(str(empty))}\): must be >= 1"):
        load(Root, str(empty))
    with pytest.raises(ConfigError, match=r"shop\.shelves = 100 \(command line\): must be < 100"):
        load(Root, None, ["shop.shelves=100"])
    with pytest.raises(ConfigError, match=r"unknown key 'shop\.shelfs' \(command line\); did you mean 'shop\.shelves"):
        load(Root, None, ["shop.shelfs=3"])
