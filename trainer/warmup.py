"""Supervised warm-up on solved examples, before DAPO.

DAPO learns only from groups whose samples disagree (Eq. 11): a policy that never answers correctly
yields no kept group and no gradient. A randomly initialised demo model is such a policy, so the CPU demo
first fits worked solutions (`PromptExample.solution`) by teacher forcing, to a modest pass rate:

    L_SFT = - sum_{samples, t} log pi(y_t | q, y_<t) / (number of solution tokens in the batch)

The warm-up is checkpointed like the DAPO loop (checkpoint.warmup_interval, in warm-up steps): model,
the warm-up's own AdamW state and schedule, its sampling RNG and the process RNGs, so a warm-up resumed
at step k ends with the same parameters as one that was never interrupted.
"""

from __future__ import annotations

import logging
import random
import shutil
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from run.phase_runner import Checkpointed, PhaseRunner
from trainer.losses import sft_micro_batch_loss
from trainer.optimizer import OptimizerStep
from trainer.packing import PackItem, pack_micro_batches
from trainer.update import equalize_micro_batch_count

if TYPE_CHECKING:
    from checkpoint.manager import CheckpointManager
    from config.schema import OptimizerConfig, TrainingConfig
    from data.prompts import PromptExample
    from model.qwen2 import Qwen2
    from model.tokenizer import Tokenizer
    from observe.progress import Progress
    from parallel.dist_env import DistEnv

log = logging.getLogger("train")


class SFTWarmup:
    """Teacher forcing on solved examples, one AdamW step at a time; `done` steps so far. Built once from the
    [training] section (sft_warmup_steps, sft_batch_size, sft_lr, micro_batch_tokens) and the [optimizer] one
    (grad_clip), then run under a phase runner (`run`).

    Every data-parallel rank draws its own share of each batch. The optimizer is separate from DAPO's
    (its state would otherwise bias DAPO's first updates); a linear decay to 10% keeps the end stable. Its
    step is DAPO's (trainer/optimizer.py): clipped at optimizer.grad_clip, weights checked after it.
    """

    def __init__(
        self,
        training: TrainingConfig,
        opt: OptimizerConfig,
        model: Qwen2,
        examples: Sequence[PromptExample],
        tokenizer: Tokenizer,
        dist_env: DistEnv,
        *,
        seed: int = 0,
    ):
        self.solved = [e for e in examples if e.solution]
        if not self.solved:
            raise ValueError(
                "the supervised warm-up needs examples with worked solutions (extra_info.solution); "
                "set training.sft_warmup_steps = 0 for this data set"
            )
        steps, batch_size = training.sft_warmup_steps, training.sft_batch_size
        if batch_size % dist_env.dp_size:
            raise ValueError(f"sft_batch_size {batch_size} does not divide over {dist_env.dp_size} data-parallel ranks")
        self.model, self.tokenizer, self.steps = model, tokenizer, steps
        self.micro_batch_tokens, self.dist_env, self.device = training.micro_batch_tokens, dist_env, dist_env.device
        self.share = batch_size // dist_env.dp_size
        self.rng = random.Random(f"sft-{seed}-{dist_env.dp_rank}")
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=training.sft_lr, weight_decay=0.0)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 - 0.9 * s / max(1, steps))
        self.optimizer_step = OptimizerStep(opt, model, self.optimizer)
        self.done = 0

    def checkpointed(self) -> Checkpointed:
        """What the warm-up's checkpoints hold: the model, its own AdamW and schedule, the steps done and
        `state_dict`."""
        return Checkpointed(
            self.model, self.optimizer, self.schedule, lambda: self.done, lambda: {"warmup": self.state_dict()}
        )

    def state_dict(self) -> dict[str, Any]:
        """What the model, optimizer and schedule do not hold: the step count and the batch sampler's RNG."""
        return {"done": self.done, "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = state["done"]
        self.rng.setstate(state["rng"])

    def step(self) -> float:
        """One AdamW step on this rank's share of a batch; returns L_SFT over the whole batch."""
        self.model.train()
        picked = self.rng.sample(self.solved, min(self.share, len(self.solved)))
        stop = self.tokenizer.stop_ids[0]
        items = [PackItem(e.prompt_ids, self.tokenizer.encode(e.solution or "") + [stop]) for e in picked]
        micro_batches = equalize_micro_batch_count(
            pack_micro_batches(items, self.micro_batch_tokens, self.dist_env.dims.tp), self.dist_env
        )
        num_tokens = self.dist_env.all_reduce([float(sum(len(it.response_ids) for it in items))])[0]
        total = 0.0
        for mb in micro_batches:
            loss = sft_micro_batch_loss(self.model, mb.to(self.device), global_num_tokens=num_tokens)
            loss.backward()
            total += loss.item()
        total = self.dist_env.all_reduce([total])[0]
        self.optimizer_step(f"supervised warm-up step {self.done}")  # a non-finite gradient skips the update
        self.schedule.step()
        self.done += 1
        return total

    def run(
        self,
        runner: PhaseRunner | None = None,
        *,
        resume: bool = True,
        progress: Progress | None = None,
        on_log: Callable[[int, float], None] | None = None,
        log_every: int = 50,
    ) -> list[float]:
        """The warm-up to `steps` AdamW steps; returns the loss curve of the steps run here.

        runner: resumes the newest warm-up checkpoint (with `resume`), writes its interval checkpoints and
        stops on a signal after checkpointing (None: no checkpoints, no stop). progress: advanced once per
        step. on_log(step index, loss): every `log_every` steps and at the last.
        """
        saved = runner.resume() if runner is not None and resume else None
        if saved is not None:
            self.load_state_dict(saved["warmup"])
            log.info("supervised warm-up resumed after step %d of %d", self.done, self.steps)
            if progress is not None:
                progress.update(self.done)
        losses = []
        while self.done < self.steps:
            loss = self.step()
            losses.append(loss)
            if progress is not None:
                progress.update(1, loss=loss)
            if on_log is not None and ((self.done - 1) % log_every == 0 or self.done == self.steps):
                on_log(self.done - 1, loss)
            if runner is not None:
                runner.end_of_step()
        return losses


def discard_warmup_checkpoints(checkpoints: CheckpointManager, is_main: bool) -> None:
    """Remove the warm-up's checkpoints once the run holds a checkpoint taken after the warm-up."""
    if is_main:
        shutil.rmtree(checkpoints.folder, ignore_errors=True)
