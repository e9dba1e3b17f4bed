"""Supervised warm-up on solved examples, before DAPO.

DAPO learns only from groups whose samples disagree (Eq. 11): a policy that never answers correctly
yields no kept group and no gradient. A randomly initialised demo model is such a policy, so the CPU demo
first fits worked solutions (`PromptExample.solution`) by teacher forcing, to a modest pass rate:

    L_SFT = - sum_{samples, t} log pi(y_t | q, y_<t) / (number of solution tokens in the batch)
"""

from __future__ import annotations

import random

import torch

from parallel.grad_clip import clip_grad_norm_
from trainer.packing import PackItem, pack_micro_batches
from trainer.policy import sft_micro_batch_loss
from trainer.update import equalise_micro_batch_count


def sft_warmup(model, examples, tokenizer, *, steps: int, batch_size: int, lr: float, micro_batch_tokens: int,
               dist_env, device, seed: int = 0, weight_decay: float = 0.0, log_every: int = 50,
               on_log=None, progress=None) -> list[float]:
    """Run `steps` AdamW steps of teacher forcing on solved examples; returns the loss curve.

    progress: an observe.progress.Progress advanced once per step (None: no display).
    Every data-parallel rank draws its own share of each batch. The optimizer is separate from DAPO's
    (its state would otherwise bias DAPO's first updates); a linear decay to 10% keeps the end stable.
    """
    solved = [e for e in examples if e.solution]
    if not solved:
        raise ValueError("the supervised warm-up needs examples with worked solutions (extra_info.solution); "
                         "set training.sft_warmup_steps = 0 for this data set")
    if batch_size % dist_env.dp_size:
        raise ValueError(f"sft_batch_size {batch_size} does not divide over {dist_env.dp_size} data-parallel ranks")
    share = batch_size // dist_env.dp_size
    rng = random.Random(f"sft-{seed}-{dist_env.dp_rank}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - 0.9 * s / max(1, steps))
    stop = tokenizer.stop_ids[0]
    losses = []
    model.train()
    for step in range(steps):
        picked = rng.sample(solved, min(share, len(solved)))
        items = [PackItem(e.prompt_ids, tokenizer.encode(e.solution) + [stop]) for e in picked]
        micro_batches = equalise_micro_batch_count(pack_micro_batches(items, micro_batch_tokens, dist_env.dims.tp), dist_env)
        num_tokens = dist_env.all_reduce([float(sum(len(it.response_ids) for it in items))])[0]
        total = 0.0
        for mb in micro_batches:
            loss = sft_micro_batch_loss(model, mb.to(device), global_num_tokens=num_tokens)
            loss.backward()
            total += loss.item()
        total = dist_env.all_reduce([total])[0]
        clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(total)
        if progress is not None:
            progress.update(1, loss=total)
        if on_log is not None and (step % log_every == 0 or step == steps - 1):
            on_log(step, total)
    return losses

