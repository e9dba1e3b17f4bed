"""Run a function on N gloo ranks (CPU processes) inside a test and collect each rank's return value.

Ranks are forked (torch and the project are already imported, so start-up costs milliseconds), each with
one intra-op thread so N ranks share the machine's cores fairly. A rank's exception is re-raised in the
test process with that rank's traceback. Each call is a fresh process group, so two calls in one test are
two independent jobs (as a restart after a checkpoint would be).
"""

from __future__ import annotations

import io
import logging
import os
import queue
import tempfile
import time
import traceback
import types

import torch

# Imported here so forked ranks inherit them instead of each importing them again.
import torch._dynamo  # noqa: F401  (imported lazily by meta-device initialisation: seconds per rank)
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401
import torch.multiprocessing as mp


def _rank_main(fn, rank, world_size, store_path, results, args, kwargs):
    torch.set_num_threads(1)
    # Gathering 2-D sharded tensors for comparisons is allowed to be suboptimal in tests.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store)
        out = fn(rank, world_size, *args, **kwargs)
        # Serialised to bytes: tensors sent through the queue directly would live in shared memory owned
        # by a process that is about to exit.
        buffer = io.BytesIO()
        torch.save(out, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.barrier()  # no rank tears gloo down while a peer still uses it
            except Exception:
                pass
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0, start: str = "fork", **kwargs) -> list:
    """fn(rank, world_size, *args, **kwargs) on `world_size` gloo ranks; returns the results ordered by rank.

    `fn` must be a module-level function; its return value must be picklable (tensors are fine).
    start="spawn" starts each rank in a fresh interpreter (seconds each) instead of forking the test
    process: for measurements of what a rank holds, which must not inherit the test process's heap,
    threads and mappings, whatever ran in it before.
    """
    ctx = mp.get_context(start)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world_size, store_path, results, args, kwargs))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        collected: dict[int, object] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        while len(collected) < world_size and not errors:
            try:
                rank, ok, out = results.get(timeout=0.5)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(collected))
                # A rank killed by a signal (an abort inside a collective) never reports: say so at once.
                dead = [
                    f"rank {r} exited with code {procs[r].exitcode} before reporting"
                    for r in missing
                    if procs[r].exitcode is not None
                ]
                if dead and results.empty():
                    errors.extend(dead)
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout}s waiting for ranks {missing}")
                continue
            if ok:
                collected[rank] = torch.load(io.BytesIO(out), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{out}")  # the others are probably blocked in a collective
        for p in procs:
            # After every rank reported, exit codes are not checked: gloo can abort while tearing down
            # after a rank's work is done, which says nothing about what the test checked.
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
                p.join()
        if errors:
            raise AssertionError("\n".join(errors))
    return [collected[r] for r in range(world_size)]


# ---------------------------------------------------------------------------------------------------
# Packed micro-batches shared by the parallel tests.
# ---------------------------------------------------------------------------------------------------


def packed_row(doc_lengths: list[int], vocab: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One packed row [1, T] of documents: restarting positions, document ids, next-token targets.

    The last token of every document has no target inside its document, so its loss mask is 0.
    """
    tokens, positions, docs, mask = [], [], [], []
    for d, n in enumerate(doc_lengths):
        tokens.append(torch.randint(0, vocab, (n,), generator=generator))
        positions.append(torch.arange(n))
        docs.append(torch.full((n,), d))
        m = torch.ones(n)
        m[-1] = 0.0
        mask.append(m)
    tokens = torch.cat(tokens)
    return {
        "tokens": tokens.unsqueeze(0),
        "positions": torch.cat(positions).unsqueeze(0),
        "document_ids": torch.cat(docs).unsqueeze(0),
        "targets": tokens.roll(-1).unsqueeze(0),  # wraps at document ends, where the mask is 0
        "mask": torch.cat(mask).unsqueeze(0),
        "advantages": torch.randn(1, len(tokens), generator=generator),
    }


class OneProcess:
    """The DistEnv of a single process without a process group: reductions return their input."""

    dp_rank, dp_size, world_size, rank = 0, 1, 1, 0
    dims = types.SimpleNamespace(tp=1)
    device = torch.device("cpu")
    is_main = True

    def all_reduce(self, values, op="sum", group="dp"):
        return list(values)


class GlooRanks(OneProcess):
    """The DistEnv of one rank of a run_ranks job, every rank a data-parallel one: reductions over all ranks
    (plain modules: a test sums the ranks' gradients itself)."""

    def __init__(self, rank, world_size):
        self.dp_rank, self.dp_size, self.world_size, self.rank = rank, world_size, world_size, rank
        self.is_main = rank == 0

    def all_reduce(self, values, op="sum", group="dp"):
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return tensor.tolist()
