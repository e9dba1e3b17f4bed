"""A user's reward function in worker processes (rewards/pool.py, rewards/scorer.py): named by file path or module
path, called with the batch and the prompt set's other columns; every way it can fail is one line naming it and
what happened, with every worker killed; recycling bounds a leak; nothing outlives the pool or its trainer."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from config.cli import absolute_spec
from data.prompts import PromptExample
from errors import RewardError
from rewards.pool import WorkerPool
from rewards.scorer import Scorer, Verdict
from rl.reward import compute_score

FUNCTIONS = '''
import math, os, signal, sys, time

def echo(responses, ground_truths, **columns):
    """score: the response's length; a metric per column that the batch carried."""
    return [{"score": float(len(r)), "acc": r == t, "pred": r, "pid": os.getpid(), "n_columns": len(columns),
             "source": float(len(s))} for r, t, s in zip(responses, ground_truths, columns["data_source"])]

def numbers(responses, ground_truths, **columns):
    return [1.0 if r == t else 0.0 for r, t in zip(responses, ground_truths)]

def chatty(responses, ground_truths, **columns):
    print("a print to stdout does not reach the pool's socket", flush=True)
    return [0.5] * len(responses)

def leaky(responses, ground_truths, **columns):
    global KEPT
    KEPT = bytearray(64 << 20)  # 64 MB resident once touched
    KEPT[::4096] = b"x" * len(KEPT[::4096])
    return [float(os.getpid())] * len(responses)

def takes_one(responses):
    return [0.0] * len(responses)

def raises(responses, ground_truths, **columns):
    raise ValueError("no answer in " + repr(responses[0]))

def hangs(responses, ground_truths, **columns):
    time.sleep(3600)

def killed(responses, ground_truths, **columns):
    os.kill(os.getpid(), signal.SIGKILL)

def exits(responses, ground_truths, **columns):
    os._exit(3)

def short(responses, ground_truths, **columns):
    return [1.0] * (len(responses) - 1)

def nan(responses, ground_truths, **columns):
    return [math.nan] * len(responses)

def text(responses, ground_truths, **columns):
    return ["1.0"] * len(responses)

def no_score(responses, ground_truths, **columns):
    return [{"acc": True}] * len(responses)

def inf_metric(responses, ground_truths, **columns):
    return [{"score": 1.0, "length": math.inf}] * len(responses)

def not_a_list(responses, ground_truths, **columns):
    return 1.0

def unpicklable(responses, ground_truths, **columns):
    return [(x for x in r) for r in responses]
'''


@pytest.fixture(scope="module")
def functions(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "planted_rewards.py"
    path.write_text(textwrap.dedent(FUNCTIONS))
    return str(path)


def _examples(n):
    return [
        PromptExample([1], str(i), "src", [], index=i, extra={"data_source": "src" * (i + 1), "id": i})
        for i in range(n)
    ]


def _children():
    """The live processes whose parent is this one (Linux's /proc)."""
    found = []
    for stat in os.listdir("/proc"):
        try:
            with open(f"/proc/{stat}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if stat.isdigit() and int(fields[1]) == os.getpid():
            found.append(int(stat))
    return found


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_function_by_file_path_gets_each_response_with_its_ground_truth_and_columns(functions):
    scorer = Scorer(f"{functions}:echo", workers=3)
    try:
        examples, responses = _examples(7), ["0", "x", "2", "3", "y", "5", "6"]
        verdicts = scorer.score(responses, examples)
        assert [v.score for v in verdicts] == [1.0] * 7
        assert [v.acc for v in verdicts] == [r == e.ground_truth for r, e in zip(responses, examples)]
        assert [v.pred for v in verdicts] == responses  # in order, though split over 3 workers
        assert {v.metrics["echo/n_columns"] for v in verdicts} == {2.0}  # data_source and id: the other columns
        assert [v.metrics["echo/source"] for v in verdicts] == [3.0 * (i + 1) for i in range(7)]
        assert len({v.metrics["echo/pid"] for v in verdicts}) == 3
        assert {w.process.pid for w in scorer.pool.workers} <= set(_children())  # what the failures' check reads
    finally:
        scorer.close()


def test_a_function_by_module_path_returning_numbers(functions, monkeypatch):
    monkeypatch.syspath_prepend(os.path.dirname(functions))  # the workers import from the trainer's sys.path
    scorer = Scorer("planted_rewards:numbers", workers=1)
    try:
        scorer.check(_examples(2))  # its ground truths as responses: it scores them 1
        verdicts = scorer.score(["0", "wrong"], _examples(2))
        assert verdicts == [Verdict(1.0, True), Verdict(0.0, False)]  # correct: a score above 0
        assert scorer.metric_names == ()
    finally:
        scorer.close()
    chatty = Scorer(f"{functions}:chatty", workers=1)  # its print goes to stdout, not into the pool's socket
    try:
        assert chatty.score(["a"], _examples(1)) == [Verdict(0.5, True)]
    finally:
        chatty.close()


def test_the_default_rule_reward_and_the_same_rule_in_a_worker_give_the_same_verdicts(tmp_path):
    """The default path is compute_score in this process; run as a user's function in a worker it scores alike."""
    (tmp_path / "rule.py").write_text(
        "from rl.reward import compute_score\n"
        "def rule(responses, ground_truths, **columns):\n"
        "    return [compute_score(r, t) for r, t in zip(responses, ground_truths)]\n"
    )
    responses = ["Answer: 42", "so 41\nAnswer: 41", "\\boxed{42}", "nothing", "Answer: \\frac{1}{2}", "Answer: 0.5"]
    examples = [PromptExample([1], truth, "src", []) for truth in ("42", "42", "42", "42", "\\frac12", "1/2")]
    expected = [Verdict(**compute_score(r, e.ground_truth)) for r, e in zip(responses, examples)]
    assert Scorer().score(responses, examples) == expected
    scorer = Scorer(f"{tmp_path / 'rule.py'}:rule", workers=2)
    try:
        assert scorer.score(responses, examples) == expected
    finally:
        scorer.close()


FAILURES = [
    ("no_such_module_xyz:f", 2.0, r"no_such_module_xyz:f cannot be imported: ModuleNotFoundError: No module named"),
    ("{file}:absent", 2.0, r"cannot be imported: LookupError: .*planted_rewards.py has no function 'absent'"),
    ("{dir}/missing.py:f", 2.0, r"missing.py:f cannot be imported: FileNotFoundError: \[Errno 2\] No such file"),
    (
        "{file}:takes_one",
        2.0,
        r"TypeError: takes_one\(\) got an unexpected keyword argument 'data_source' \(called as "
        r"f\(responses, ground_truths, data_source=\.\.\., id=\.\.\.\)\)$",
    ),  # fmt: skip
    ("{file}:raises", 2.0, r"planted_rewards.py:raises raised ValueError: no answer in '[02]'$"),
    ("{file}:hangs", 1.0, r":hangs took longer than reward.timeout_s = 1 s on a batch of 4 responses$"),
    ("{file}:killed", 2.0, r":killed stopped: its worker process was killed by SIGKILL$"),
    ("{file}:exits", 2.0, r":exits stopped: its worker process exited with code 3$"),
    ("{file}:short", 2.0, r":short returned \[1.0\] for 2 responses, not a list of one value each$"),
    ("{file}:nan", 2.0, r":nan returned nan for response 0: a reward is a finite number, or a dict of a finite 'sc"),
    ("{file}:text", 2.0, r":text returned '1.0' for response 0: a reward is a finite number"),
    ("{file}:no_score", 2.0, r":no_score returned \{'acc': True\} for response 0: a reward is"),
    ("{file}:inf_metric", 2.0, r":inf_metric returned \{'length': inf, 'score': 1.0\} for response 0: a reward is"),
    ("{file}:not_a_list", 2.0, r":not_a_list returned 1.0 for 2 responses, not a list of one value each$"),
    ("{file}:unpicklable", 2.0, r":unpicklable stopped: its worker process exited with code 1$"),  # can't pickle
]


@pytest.mark.parametrize("spec, timeout_s, line", FAILURES, ids=[f[0].split(":")[-1] for f in FAILURES])
def test_every_failure_is_one_line_naming_the_function_with_every_worker_killed(functions, spec, timeout_s, line):
    """An import that fails is named when the pool starts (before any training), the rest at the first batch."""
    spec = spec.format(file=functions, dir=os.path.dirname(functions))
    before, start, scorer = set(_children()), time.monotonic(), None
    with pytest.raises(RewardError) as info:
        scorer = Scorer(spec, workers=2, timeout_s=timeout_s)
        scorer.score(["0", "1", "2", "3"], _examples(4))
    assert len(info.value.line().splitlines()) == 1 and info.value.line().startswith("reward error: reward function ")
    assert __import__("re").search(line, str(info.value)), str(info.value)
    assert time.monotonic() - start < timeout_s + 10
    assert set(_children()) <= before  # every worker killed and reaped
    if scorer is not None:  # closed for good
        with pytest.raises(RewardError, match=r"was stopped by an earlier failure \(its worker pool is closed\)$"):
            scorer.score(["0"], _examples(1))


def test_a_worker_is_recycled_after_its_batches_or_past_its_memory_bound(functions):
    by_count = WorkerPool(f"{functions}:leaky", workers=1, recycle=(2, 0))
    by_memory = WorkerPool(f"{functions}:leaky", workers=1, recycle=(0, 32))  # the function holds 64 MB
    try:
        pids = [int(by_count.run(["a"], ["a"], {})[0]) for _ in range(5)]
        assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
        first = [int(by_memory.run(["a"], ["a"], {})[0]) for _ in range(2)]
        assert first[0] != first[1] and not _alive(pids[0]) and not _alive(first[0])
    finally:
        by_count.close()
        by_memory.close()


def test_workers_have_their_own_session_and_die_with_their_trainer(functions, tmp_path):
    """A Ctrl-C at the terminal reaches the trainer's process group, not the workers'; a trainer killed with
    SIGKILL takes its workers with it (Linux: PR_SET_PDEATHSIG), even one stuck in the function."""
    pool = WorkerPool(f"{functions}:numbers", workers=1)
    try:
        assert os.getpgid(pool.workers[0].process.pid) != os.getpgid(0)
    finally:
        pool.close()
    if sys.platform != "linux":
        return
    trainer = (
        "import sys, threading; sys.path.insert(0, sys.argv[1]); from rewards.pool import WorkerPool\n"
        f"pool = WorkerPool({functions + ':hangs'!r}, workers=2, timeout_s=600)\n"
        "print(' '.join(str(w.process.pid) for w in pool.workers), flush=True)\n"
        "threading.Thread(target=pool.run, args=(['a', 'b'], ['a', 'b'], {}), daemon=True).start()\n"
        "threading.Event().wait()\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    process = subprocess.Popen([sys.executable, "-c", trainer, root], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in process.stdout.readline().split()]
    time.sleep(0.5)  # the workers are inside the hanging function
    assert all(_alive(pid) for pid in pids)
    process.kill()
    process.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.parametrize(
    "spec, shown",
    [
        ("{dir}/missing.py:f", False),  # no such file
        ("no_such_module_xyz:f", False),  # no such module
        ("{file}:absent", False),  # no such function
        ("{file}:takes_one", False),  # a signature that cannot take the batch
        ("{file}:raises", True),  # the function raised
        ("{dir}/broken_at_import.py:f", True),  # the module raised while it was imported
    ],
)
def test_a_traceback_is_shown_only_where_the_users_code_raised(functions, spec, shown, capfd):
    """A wrong spec or signature is the one line alone (the issue's bad input); an exception of the user's code
    also has its traceback on stderr, which the worker shares with the trainer."""
    folder = os.path.dirname(functions)
    with open(os.path.join(folder, "broken_at_import.py"), "w") as f:
        f.write("import json\nraise RuntimeError('a setting is missing')\n")
    with pytest.raises(RewardError):
        scorer = Scorer(spec.format(file=functions, dir=folder), workers=1)
        scorer.score(["0", "1"], _examples(2))
    err = capfd.readouterr().err
    assert ("Traceback" in err) == shown, err
    if shown:
        assert err.rstrip().splitlines()[-1].startswith(("ValueError: no answer", "RuntimeError: a setting")), err


def test_a_file_path_is_made_absolute_and_a_module_path_left_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_spec("rewards/mine.py:score", os.getcwd()) == f"{tmp_path}/rewards/mine.py:score"
    assert absolute_spec("package.module:score", os.getcwd()) == "package.module:score"


def test_an_idle_worker_killed_between_batches_is_named_at_the_next(functions):
    pool = WorkerPool(f"{functions}:numbers", workers=1)
    pool.run(["a"], ["a"], {})
    os.kill(pool.workers[0].process.pid, signal.SIGKILL)
    with pytest.raises(RewardError, match=r"numbers stopped: its worker process was killed by SIGKILL"):
        pool.run(["a"], ["a"], {})
