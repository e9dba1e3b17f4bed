"""Which errors are the user's input, and how train.py and eval.py print them: one line, exit code 2.

An input error names the file or key at fault and what to do; it is printed as `<kind>: <message>` with no
traceback (one line; the machine check adds one line per setting it lists). Every other exception is a
failure of the program and keeps its traceback (exit code 1): a ValueError raised by a bug is not bad input,
so the commands list the input errors by class rather than catching a base class.
"""

from __future__ import annotations

from config import ConfigError
from model.hf_adapter import CheckpointError as HFCheckpointError
from parallel.safe_dcp import CheckpointError as RunCheckpointError
from rl.data import DataError
from trainer.run_folder import RunFolderError

# (error class, the kind printed before its message), most specific first.
INPUT_ERRORS: tuple[tuple[type[Exception], str], ...] = (
    (ConfigError, "configuration error"),
    (DataError, "data error"),
    (HFCheckpointError, "checkpoint error"),  # an HF checkpoint directory: config.json, safetensors
    (RunCheckpointError, "error"),  # a run's own checkpoint (checkpoints/step-N)
    (RunFolderError, "error"),
)

EXIT_BAD_INPUT = 2


def input_error_line(exc: BaseException) -> str | None:
    """`<kind>: <message>` for an input error, None for anything else."""
    for cls, kind in INPUT_ERRORS:
        if isinstance(exc, cls):
            return f"{kind}: {exc}"
    return None
