"""An engine is hung when it stops producing, not when it is slower than a guess (run/guard.py GuardedEngine): on
the torch engine, in train.py, a slow engine that keeps producing finishes, and one that stops producing on one
rank stops every rank within rollout.call_timeout_s and a poll, with a checkpoint and exit code 1. (The same on the
strict SGLang model: tests/test_train_engine_process.py.)"""

import time

import pytest

import rl.reward
import train
from checkpoint.manager import CheckpointManager
from rollout.engine import EngineDied, Polled
from rollout.torch_engine import TorchEngine
from tests.dist_utils import run_ranks
from tests.planted_train import planted_score
from tests.test_train_e2e import overrides, read_rows


def test_a_slow_engine_that_keeps_producing_is_never_stopped(tmp_path, monkeypatch):
    """Every poll takes 0.5 s and produces a token a sample: a round (6 tokens a sample) and the evaluation take
    several times the progress window of 1 s, and finish."""
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    poll = TorchEngine.poll

    def slow(self):
        time.sleep(0.5)
        return poll(self)

    monkeypatch.setattr(TorchEngine, "poll", slow)
    monkeypatch.setattr(TorchEngine, "__init__", _with_poll_steps(TorchEngine.__init__, 1))
    argv = overrides(str(tmp_path), steps=1, **{"rollout.call_timeout_s": 1, "eval.at_end": True, "eval.k": 2})
    assert train.main(argv) == 0
    rows = read_rows(str(tmp_path))
    (row,) = [r for r in rows if "loss" in r]
    assert row["time/generate"] > 2 * 1 and "eval/avg_at_k" in rows[-1]


def _with_poll_steps(init, steps):
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs, poll_steps=steps)

    return patched


def _stalled_on_rank_1(rank, world_size, argv):
    """train.main on this rank; from the second step's rollout on, rank 1's engine answers its polls with nothing:
    (exit code, message, when it stopped, when the stall began)."""
    rl.reward.compute_score = planted_score
    poll, rounds, stalled = TorchEngine.poll, [], []
    submit = TorchEngine.submit

    def counting_submit(self, prompts, params):
        rounds.append(1)
        return submit(self, prompts, params)

    def stalling(self):
        if rank == 1 and len(rounds) >= 2:
            stalled.append(stalled[0] if stalled else time.time())
            return Polled([], 0, False)
        return poll(self)

    TorchEngine.submit, TorchEngine.poll = counting_submit, stalling
    try:
        train.main(argv)
    except EngineDied as exc:
        return exc.exit_code, str(exc), time.time(), stalled[0] if stalled else None
    return 0, "finished", time.time(), None


@pytest.mark.multiprocess
def test_an_engine_that_stops_producing_on_one_rank_stops_every_rank(tmp_path):
    window = 2
    argv = overrides(str(tmp_path), steps=3, **{"rollout.call_timeout_s": window, "checkpoint.interval": 100})
    ended = run_ranks(_stalled_on_rank_1, 2, argv, timeout=300)
    stalled_at = ended[1][3]
    for rank, (code, message, at, _) in enumerate(ended):  # exit code 1, step 1's checkpoint, within window + poll
        why = f"no request produced a token or finished for {window} s" if rank else "engine of another rank died"
        assert code == 1 and why in message, message
        assert message.endswith("Checkpoint of step 1 saved; rerun the same command to resume"), message
        assert window <= at - stalled_at < window + 20, at - stalled_at  # + a poll, + a loaded machine's slack
    assert CheckpointManager(str(tmp_path / "run" / "checkpoints")).complete_steps() == [1]
