"""LoRA (parallel/lora.py): the adapted policy starts as the base exactly, only the adapters train, the engines get
W + (alpha / r) B A (one process and sharded), the HF export round-trips through transformers (merged) and peft
(the adapter on the base), checkpoints hold the adapters and the base's identity and resume exactly, and bad
settings are one line with exit code 2. The sharded-training invariances with LoRA on are in
tests/test_parallel_parity.py, tests/test_parallel_compile.py and tests/test_trainer_update.py."""

import copy
import dataclasses
import json
import os
import shutil

import pytest
import torch
from dist_utils import OneProcess, run_ranks
from numerics import assert_close_to_float64
from test_old_logprobs import FP32_TORCH, _config, _engine_groups, _NoSchedule, _sample_logprobs
from test_parallel_parity import LORA, _random_b

import rl.reward
import train
from checkpoint.hf_export import export_hf
from checkpoint.manager import CheckpointManager
from model.args import PRESETS
from model.hf import load_hf, save_hf
from model.qwen2 import build_model
from parallel.dims import ParallelDims
from parallel.lora import Adapters, apply_lora, merged_parameters, reset_adapters
from parallel.parallelize import parallelize_qwen2
from rollout.torch_engine import TorchEngine
from rollout.weight_sync import sync_weights
from tests.planted_train import planted_score
from tests.test_train_e2e import overrides, read_rows
from trainer.mismatch import ROLLOUT_LOGP_TOLERANCE
from trainer.observers import TrainWatch, no_display
from trainer.update import TrainPhase

ARGS = PRESETS["tiny"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _adapted(seed=0, random_b=True, args=ARGS):
    model = build_model(args, seed=seed)
    apply_lora(model, LORA)
    if random_b:
        _random_b(model)
    return model


def _tokens(n=3, length=12, seed=0):
    return torch.randint(0, ARGS.vocab_size, (n, length), generator=torch.Generator().manual_seed(seed))


def test_with_b_zero_the_policy_and_its_merged_weights_are_the_bases_exactly():
    base, model = build_model(ARGS, seed=0), _adapted(random_b=False)
    tokens = _tokens()
    assert torch.equal(model(tokens), base(tokens))
    merged = dict(merged_parameters(model))
    assert list(merged) == [n for n, _ in base.named_parameters()]  # the base's names, the adapters left out
    assert all(torch.equal(merged[n], p) for n, p in base.named_parameters())


def test_gradients_reach_the_adapters_only():
    model = _adapted(random_b=False)
    model(_tokens()).logsumexp(-1).mean().backward()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {n for n, p in model.named_parameters() if n.rpartition(".")[2] in ("lora_A", "lora_B")}
    assert len(trained) == 2 * 7 * ARGS.num_layers
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trained)
    grads = {n: p.grad for n, p in model.named_parameters() if n in trained}
    # At B = 0 the term's gradient reaches B only: dL/dA = scale B^T (dL/dy)^T x = 0 (LoRA's start).
    assert all(g.abs().max() > 0 for n, g in grads.items() if n.endswith("lora_B"))
    assert all(torch.equal(g, torch.zeros_like(g)) for n, g in grads.items() if n.endswith("lora_A"))


def test_the_merged_weights_compute_what_the_adapted_policy_computes():
    model = _adapted()
    plain = build_model(ARGS, seed=1)
    plain.load_state_dict(dict(merged_parameters(model)))
    model64 = copy.deepcopy(model).double()
    tokens = _tokens()
    assert_close_to_float64(plain(tokens).detach(), model(tokens).detach(), model64(tokens).detach(), "logits")


def test_the_engines_log_probs_equal_the_lora_trainers_within_the_mismatch_bound():
    """The torch engine holds the merged weights (sync_weights) and samples; its log-probs of the sampled tokens are
    the adapted trainer's within fp32 rounding (against float64), and a DAPO step that takes them as pi_old measures
    a mismatch below the trainer's threshold, as without LoRA (tests/test_old_logprobs.py)."""
    model = _adapted()
    engine_model = build_model(ARGS, seed=5)
    sync_weights(model, TorchEngine(engine_model, max_batch_size=2, max_seq_len=32))
    groups = _engine_groups(engine_model)
    engine = torch.tensor([lp for group in groups for s in group.payload for lp in s.rollout_logprobs])
    trainer, trainer64 = _sample_logprobs(model, groups), _sample_logprobs(copy.deepcopy(model).double(), groups)
    assert_close_to_float64(engine, trainer, trainer64, "engine log-probs")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    phase = TrainPhase(_config(**FP32_TORCH), model, optimizer, _NoSchedule(), OneProcess(), TrainWatch(no_display))
    stats = phase.run(1, groups).metrics()
    assert stats["updates"] == 2 and 0 <= stats["mismatch/max_abs_logp"] < ROLLOUT_LOGP_TOLERANCE


def _sharded_sync_worker(rank, world, layout):
    dims = ParallelDims(world_size=world, **layout)
    model = build_model(ARGS, seed=0)
    parallelize_qwen2(model, dims.build_mesh("cpu"), dims, param_dtype=torch.float32, lora=LORA)
    _random_b(model)
    engine = TorchEngine(build_model(ARGS, seed=8), max_batch_size=2, max_seq_len=32)
    sync_weights(model, engine, bucket_bytes=30_000)
    attention = model.layers["0"].self_attn
    layout = {
        f"{m}.{a}": str(getattr(attention, m).get_parameter(a).placements)
        for m in ("q_proj", "o_proj")
        for a in ("lora_A", "lora_B")
    }
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}, layout


@pytest.mark.parametrize("layout", [{"dp_shard": 2}, {"dp_shard": 1, "tp": 2}], ids=["fsdp2", "tp2"])
def test_a_sharded_trainer_sends_the_merged_weights(layout):
    """FSDP=2 and TP=2 (A and B laid out as the base's plan): the engine of every rank gets W + scale B A, merged on
    each rank's part of W, as one process merges it (within fp32 rounding, against float64)."""
    results = run_ranks(_sharded_sync_worker, 2, layout)
    engines = [engine for engine, _ in results]
    if "tp" in layout:  # column-wise q_proj: A replicated, B with W's rows; row-wise o_proj: A with W's columns
        assert results[0][1] == {
            "q_proj.lora_A": "(Replicate(),)",
            "q_proj.lora_B": "(Shard(dim=0),)",
            "o_proj.lora_A": "(Shard(dim=1),)",
            "o_proj.lora_B": "(Replicate(),)",
        }
    model = _adapted()
    want = dict(merged_parameters(model))
    want64 = {n: t.double() for n, t in merged_parameters(copy.deepcopy(model).double())}
    for engine in engines:
        assert list(engine) == list(want)
        assert_close_to_float64(engine, want, want64, f"merged weights {layout}")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """The demo preset's shapes with random weights (and bases/demo's tokenizer) as an HF checkpoint."""
    folder = tmp_path_factory.mktemp("base") / "base"
    save_hf(build_model(PRESETS["demo"], seed=3), str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(ROOT, "bases", "demo", name), folder / name)
    return str(folder)


def test_the_export_round_trips_through_transformers_merged_and_through_peft_on_the_base(base_dir, tmp_path):
    """hf/ loads in transformers unchanged (the merged model) and hf/adapter/ loads with peft onto the base: both give
    the trainer's logits within fp32 rounding (measured against the adapted policy in float64)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = load_hf(base_dir)
    apply_lora(model, Adapters(LORA.rank, LORA.alpha, LORA.targets, base_dir))
    _random_b(model)
    export_hf(model, str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["base_model_name_or_path"]) == ("LORA", LORA.rank, base_dir)
    assert not (tmp_path / "hf" / "adapter_config.json").exists()  # transformers would take hf/ for an adapter
    tokens = torch.randint(0, PRESETS["demo"].vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ours64 = model(tokens), copy.deepcopy(model).double()(tokens)
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, str(tmp_path / "hf" / "adapter"))
        for what, logits in (("transformers (merged)", merged(tokens).logits), ("peft", peft(input_ids=tokens).logits)):
            assert_close_to_float64(logits, ours, ours64, what)


LORA_RUN = {"lora.enabled": True, "lora.rank": 2, "model.preset": "", "optimizer.lr": 1e-2}


def _checkpoint_keys(path):
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def test_a_run_checkpoints_the_adapters_resumes_exactly_and_refuses_a_changed_base(
    base_dir, tmp_path, monkeypatch, capsys
):
    """train.py with LoRA: its checkpoints hold the adapters and their AdamW moments and name the base; a run resumed
    from step 1 (the engine gets the merged weights right after the resume) repeats the uninterrupted run's step 2
    exactly and exports the same adapter; with the base's weights changed, the resume is refused in one line."""
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    base = str(tmp_path / "base")
    shutil.copytree(base_dir, base)
    settings = {**LORA_RUN, "model.hf_path": base}
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert train.main(overrides(straight, steps=2, **settings)) == 0
    assert train.main(overrides(resumed, steps=1, **settings)) == 0
    step_1 = CheckpointManager(os.path.join(resumed, "run", "checkpoints")).step_path(1)
    keys = _checkpoint_keys(step_1)
    assert keys and all(".lora_A" in k or ".lora_B" in k for k in keys), sorted(keys)[:5]
    assert {k.split(".", 1)[0] for k in keys} == {"model", "optimizer"}
    manifest = json.load(open(os.path.join(step_1, "COMPLETE.json")))
    assert manifest["base"]["path"] == base and len(manifest["base"]["xxh3_128"]) == 32
    assert train.main(overrides(resumed, steps=2, **settings)) == 0  # resumes from the step-1 checkpoint
    expected, got = ([r for r in read_rows(run) if r["step"] == 2 and "loss" in r][0] for run in (straight, resumed))
    for key in ("loss", "reward/mean", "entropy", "grad_norm", "pg_clipfrac", "response_length/mean"):
        assert got[key] == expected[key], key
    from safetensors.torch import load_file

    adapters = [
        load_file(os.path.join(run, "run", "hf", "adapter", "adapter_model.safetensors")) for run in (straight, resumed)
    ]
    assert adapters[0].keys() == adapters[1].keys() and all(
        torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0]
    )

    changed = load_hf(base)
    with torch.no_grad():
        changed.layers["0"].mlp.up_proj.weight[0, 0] += 1.0
    save_hf(changed, base)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        train.run_cli(overrides(resumed, steps=3, **settings))
    assert info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("checkpoint error")]
    assert len(lines) == 1 and "holds LoRA adapters trained on the base" in lines[0] and "other weights" in lines[0]


@pytest.mark.parametrize(
    "setting,message",
    [
        ({"lora.rank": 0}, "lora.rank = 0 (command line): must be >= 1"),
        ({"lora.rank": 65}, "lora.rank = 65 is above the width of layers.0.self_attn.k_proj (64)"),
        ({"lora.targets": "q_proj,qkv_proj"}, "lora.targets = 'q_proj,qkv_proj' (command line): wrong type"),
        ({"model.hf_path": "", "model.preset": "demo"}, "lora.enabled = True (command line): needs model.hf_path"),
    ],
    ids=["rank-0", "rank-above-width", "unknown-target", "no-base-weights"],
)
def test_bad_lora_settings_are_one_line_and_exit_2(base_dir, tmp_path, capsys, setting, message):
    argv = overrides(str(tmp_path / "runs"), steps=1, **{**LORA_RUN, "model.hf_path": base_dir, **setting})
    with pytest.raises(SystemExit) as info:
        train.run_cli(argv)
    assert info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and err[0].startswith(f"configuration error: {message}"), err
    assert not (tmp_path / "runs").exists()  # nothing left behind


def test_the_rehearsal_counts_no_gradient_and_no_optimizer_state_for_the_frozen_base():
    """The ledger of a rehearsal with LoRA (a fake 2-rank job, bases/chain's shapes): the optimizer step holds the
    adapters' float32 gradients and two moments (this rank's half) and nothing for the frozen base, whose fp32
    moments alone would be 2 x 4 x 854,144 / 2 bytes; with cpu_offload the host ledger pins gradient blocks for the
    adapters only."""
    from preflight.gpu_ledger import MemoryLedger
    from preflight.host_ledger import host_facts
    from preflight.rehearsal import fake_dist_env, fake_job, fake_tensor_mode, run_phases, sharding_propagation_apart
    from tests.test_rehearsal import small_config

    chain = os.path.join(ROOT, "bases", "chain")
    cfg = small_config(2, **{"model.preset": "", "model.hf_path": chain, "lora.enabled": True, "lora.rank": 4})
    ledger = MemoryLedger(10**12, 0)
    with fake_job(2):
        dist_env = fake_dist_env(cfg, 2)
        with fake_tensor_mode(), sharding_propagation_apart():
            run = run_phases(cfg, dist_env, ledger)
        offload = dataclasses.replace(cfg.parallelism, cpu_offload=True)
        host = host_facts(dataclasses.replace(cfg, parallelism=offload), run.policy, run.args)
    step = next(r for r in ledger.rows if r.phase == "train: optimizer step").trainer
    adapters = 4 * 2432 * PRESETS["demo"].num_layers  # r (in + out) over the seven linears of each block
    assert 2 * 4 * adapters / 2 <= step["optimizer"] <= 2 * 4 * adapters < 2 * 4 * 854_144 / 2
    assert 0 < step["grads"] <= 4 * adapters
    assert 0 < host.pinned_grads < host.pinned_params / 10


def _sharded_checkpoint_worker(rank, world, folder, base):
    dims = ParallelDims(world_size=world)
    adapters = Adapters(LORA.rank, LORA.alpha, LORA.targets, base)
    models = []
    for seed in (0, 1):  # the same base, adapters initialised differently
        model = load_hf(base)
        parallelize_qwen2(model, dims.build_mesh("cpu"), dims, param_dtype=torch.float32, lora=adapters)
        reset_adapters(model, seed)
        models.append(model)
    _random_b(models[0])
    optimizer = torch.optim.AdamW([p for p in models[0].parameters() if p.requires_grad], lr=1e-2)
    models[0](torch.randint(0, 512, (1, 8))).float().logsumexp(-1).mean().backward()
    optimizer.step()
    manager = CheckpointManager(folder)
    manager.save(1, models[0], optimizer)
    fresh = torch.optim.AdamW([p for p in models[1].parameters() if p.requires_grad], lr=1e-2)
    manager.load(1, models[1], fresh)
    same = [
        torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(models[0].parameters(), models[1].parameters())
    ]
    moments = [
        torch.equal(fresh.state[q]["exp_avg"].full_tensor(), optimizer.state[p]["exp_avg"].full_tensor())
        for p, q in zip(optimizer.param_groups[0]["params"], fresh.param_groups[0]["params"])
    ]
    return all(same), all(moments), len(moments)


def test_a_sharded_lora_checkpoint_holds_the_adapters_and_loads_them_back(base_dir, tmp_path):
    """FSDP=2: the checkpoint of the adapters and their moments (no base weight) loads back into a policy built from
    the same base, every parameter and moment equal."""
    results = run_ranks(_sharded_checkpoint_worker, 2, str(tmp_path / "ckpt"), base_dir)
    assert results == [(True, True, 2 * 7 * PRESETS["demo"].num_layers)] * 2
    keys = _checkpoint_keys(str(tmp_path / "ckpt" / "step-00000001"))
    assert keys and all(".lora_A" in k or ".lora_B" in k for k in keys)
