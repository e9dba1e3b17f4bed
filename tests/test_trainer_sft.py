"""The supervised warm-up resumes from its checkpoints exactly: interrupted at step k or not, same result."""

import dataclasses

import pytest
import torch

from checkpoint.manager import CheckpointManager
from config import Config
from data.prompts import PromptExample
from model.args import PRESETS
from model.qwen2 import build_model
from parallel.dims import ParallelDims
from parallel.dist_env import DistEnv
from run.phase_runner import PhaseRunner
from run.signals import StopRequested
from trainer.warmup import SFTWarmup

ARGS = PRESETS["tiny"]
STEPS = 6


class CharTokenizer:
    stop_ids = [1]

    def encode(self, text):
        return [2 + ord(c) % (ARGS.vocab_size - 2) for c in text]


def _examples():
    return [
        PromptExample(
            [3, 4 + i % 7, 5], str(i), "synthetic", [], solution=f"{i} + {i} = {2 * i}\nAnswer: {2 * i}", index=i
        )
        for i in range(24)
    ]


def _warmup(model, checkpoints=None, interval=0, stop=None, resume=True, **run_options):
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), dims=ParallelDims(world_size=1))
    cfg = Config()
    training = dataclasses.replace(
        cfg.training, sft_warmup_steps=STEPS, sft_batch_size=4, sft_lr=1e-2, micro_batch_tokens=64
    )
    warm = SFTWarmup(training, cfg.optimizer, model, _examples(), CharTokenizer(), env, seed=5)
    runner = None
    if checkpoints is not None:
        runner = PhaseRunner(
            checkpoints,
            warm.checkpointed(),
            stop,
            env,
            interval=interval,
            step_name="supervised warm-up step",
            last_step=STEPS,
        )
    return warm.run(runner, resume=resume, **run_options)


def build_manager(tmp_path):
    return CheckpointManager(str(tmp_path), keep=1)


class Killed(Exception):
    pass


def test_a_warm_up_resumed_from_its_interval_checkpoint_ends_bitwise_where_an_uninterrupted_one_does(tmp_path):
    straight = build_model(ARGS, seed=0)
    straight_losses = _warmup(straight)

    def kill_after_step_5(index, loss):
        if index == 4:  # step 5 is done; its checkpoint (interval 2) is not: the run dies with step 4's
            raise Killed

    manager = build_manager(tmp_path)
    first = build_model(ARGS, seed=0)
    with pytest.raises(Killed):
        _warmup(first, checkpoints=manager, interval=2, on_log=kill_after_step_5, log_every=1)
    assert manager.complete_steps() == [4]

    resumed = build_model(ARGS, seed=1)  # another initialisation: the checkpoint replaces it
    torch.manual_seed(123)  # and another global RNG state: restored too
    resumed_losses = _warmup(resumed, checkpoints=build_manager(tmp_path), interval=2)
    assert resumed_losses == straight_losses[4:]
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    initial = build_model(ARGS, seed=0)
    assert not torch.equal(straight.get_parameter("norm.weight"), initial.get_parameter("norm.weight"))


class StopAfter:
    """A GracefulStop stand-in whose signal arrives during warm-up step `n`."""

    def __init__(self, n):
        self.n, self.calls, self.signal_name = n, 0, None

    def requested(self, dist_env, anyone=None):
        self.calls += 1
        if self.calls >= self.n:
            self.signal_name = "SIGTERM"
        return self.signal_name is not None


def test_a_signal_during_the_warm_up_checkpoints_its_last_step_and_the_rerun_goes_on_from_there(tmp_path):
    straight = build_model(ARGS, seed=0)
    _warmup(straight)
    manager = build_manager(tmp_path)
    with pytest.raises(StopRequested, match="stopped by SIGTERM after supervised warm-up step 3"):
        _warmup(build_model(ARGS, seed=0), checkpoints=manager, interval=100, stop=StopAfter(3))
    assert manager.complete_steps() == [3]
    resumed = build_model(ARGS, seed=1)
    assert len(_warmup(resumed, checkpoints=manager, interval=100)) == STEPS - 3
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
    # resume=False (checkpoint.resume = false) ignores the checkpoint and runs every step.
    assert len(_warmup(build_model(ARGS, seed=1), checkpoints=manager, resume=False)) == STEPS
