"""train.py with the SGLang engine in its own process, where the strict model of sglang 0.5.21
(tests/sglang_model.py) stands for `sglang.Engine`, on a CPU.

    python tests/strict_engine_train.py ARGS...     # train.py's command line; options in STRICT_SGLANG

STRICT_SGLANG (JSON): the model's options (crash, delay, announce: see StrictSGLang) and "train_delay",
seconds each training phase lasts (announced as "train" in the same file). What differs from a GPU run:
the engine's CUDA IPC payloads are CPU stand-ins, the reward is the planted one of the end-to-end tests,
and the machine check lets SGLang run without CUDA (every other check still runs).
"""

import dataclasses
import functools
import json
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

from sglang_model import StrictSGLang, flatten_bucket, serialize  # noqa: E402

import rl.reward  # noqa: E402
import train  # noqa: E402
import trainer.update  # noqa: E402
from preflight.checks import check_runnable  # noqa: E402
from rollout.sglang_engine import SGLangEngine  # noqa: E402
from tests.planted_train import planted_score  # noqa: E402


def _check_runnable_on_this_cpu(cfg) -> None:
    """check_runnable as for the torch engine: SGLang's need for CUDA is what the strict model stands in for."""
    check_runnable(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="torch")))


def _flatten(self, bucket):
    return flatten_bucket(bucket)


def _serialize(self, payload):
    return serialize(payload)


def use_strict_model(setattr_, *, train_delay: float = 0.0, announce: str | None = None, **model_options) -> None:
    """Point train.py's SGLang engine at the strict model; setattr_: monkeypatch.setattr, or setattr."""
    setattr_(SGLangEngine, "engine_target", functools.partial(StrictSGLang, announce=announce, **model_options))
    setattr_(SGLangEngine, "_flatten_bucket", _flatten)
    setattr_(SGLangEngine, "_serialize", _serialize)
    setattr_(train, "check_runnable", _check_runnable_on_this_cpu)
    setattr_(rl.reward, "compute_score", planted_score)
    if train_delay:
        run = trainer.update.TrainPhase.run

        def slow_run(self, *args, **kwargs):
            if announce:
                with open(announce, "a") as f:
                    f.write("train\n")
            time.sleep(train_delay)
            return run(self, *args, **kwargs)

        setattr_(trainer.update.TrainPhase, "run", slow_run)


if __name__ == "__main__":
    use_strict_model(setattr, **json.loads(os.environ.get("STRICT_SGLANG", "{}")))
    sys.argv[0] = "train.py"
    train.run_cli(sys.argv[1:])
