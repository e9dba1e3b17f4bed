"""evaluation/evaluate.py: planted accuracies through a fake engine come back exactly; eval.py, the command over it,
takes train.py's configuration and runs end to end on CPU."""

import io
import itertools
import json
import os
import runpy
import subprocess
import sys
from fractions import Fraction

import pytest
import torch

import eval as eval_command
import evaluation.evaluate as evaluation
from config import ConfigError
from data.prompts import rows_to_examples
from evaluation.evaluate import evaluate
from evaluation.report import flat_metrics, format_table
from model.args import PRESETS
from model.hf import save_hf
from model.qwen2 import build_model
from model.tokenizer import train_bpe_tokenizer
from observe.progress import Progress
from rl.reward import compute_score
from rollout.engine import Completion, Engine, EngineFailure, SamplingParams
from rollout.torch_engine import TorchEngine
from run.guard import GuardedEngine
from tasks.arithmetic import synthetic_arithmetic_rows
from tests.engines import ByGenerate, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tokenizer():
    rows = synthetic_arithmetic_rows(60, split="train", seed=1)
    texts = [r["prompt"][0]["content"] for r in rows] + [r["extra_info"]["solution"] for r in rows]
    return train_bpe_tokenizer(texts, vocab_size=300)


def _examples(tokenizer, num, sources=None):
    rows = synthetic_arithmetic_rows(num, split="eval", seed=0)
    for i, source in enumerate(sources or []):
        rows[i]["data_source"] = source
    examples, _ = rows_to_examples(rows, tokenizer, max_prompt_length=1024)
    return examples


class FakeEngine(ByGenerate):
    """Implements the engine protocol; answers each prompt with planted response texts."""

    def __init__(self, tokenizer, responses: dict[tuple, list[str]], finish: str = "stop"):
        self.tokenizer, self.responses, self.finish = tokenizer, responses, finish
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        out = []
        for p, prompt in enumerate(prompts):
            texts = self.responses[tuple(prompt)]
            assert len(texts) == params.n
            for s, text in enumerate(texts):
                ids = self.tokenizer.encode(text) + [self.tokenizer.stop_ids[-1]]  # ends with <|im_end|>
                out.append(Completion(p, s, ids, [-0.1] * len(ids), self.finish))
        return out

    def update_weights(self, named_tensors):
        raise NotImplementedError

    def release_memory(self):
        pass

    def resume_memory(self):
        pass

    def shutdown(self):
        pass


def _answer(example, value):
    return f"Adding the numbers gives {value}.\nAnswer: {value}"


def _params(k):
    return SamplingParams(max_new_tokens=64, temperature=1.0, top_p=0.7, n=k)


# ------------------------------------------------------------------------------------------ planted numbers


def test_planted_per_sample_pattern_gives_exact_avg_pass_maj(tokenizer):
    ex = _examples(tokenizer, 6, sources=["a", "a", "a", "b", "b", "b"])
    gt = [e.ground_truth for e in ex]
    wrong = [str(int(g) + 1) for g in gt]
    other = [str(int(g) + 2) for g in gt]
    none = "I do not know."

    def answers(i, pattern):
        # "g": right, "w"/"o": two different wrong answers, "-": no answer, "b": right in \boxed{} only.
        table = {
            "g": _answer(ex[i], gt[i]),
            "w": _answer(ex[i], wrong[i]),
            "o": _answer(ex[i], other[i]),
            "-": none,
            "b": f"so it is \\boxed{{{gt[i]}}}",
        }
        return [table[x] for x in pattern]

    planted = ["gggg", "wgw-", "wogb", "wggw", "---g", "----"]
    engine = FakeEngine(
        tokenizer, {tuple(e.prompt_ids): answers(i, pattern) for i, (e, pattern) in enumerate(zip(ex, planted))}
    )
    assert isinstance(engine, Engine)
    report = evaluate(GuardedEngine(engine), ex, tokenizer, _params(4), pass_at=(1, 2, 4))
    a, b, overall = report["by_source"]["a"], report["by_source"]["b"], report["overall"]
    # Correct counts: a = 4, 1, 2 ("b" is right through the boxed fallback); b = 2, 1, 0.
    assert a["avg@4"] == pytest.approx((1 + 0.25 + 0.5) / 3, abs=1e-12)
    assert b["avg@4"] == pytest.approx((0.5 + 0.25 + 0) / 3, abs=1e-12)
    assert overall["avg@4"] == pytest.approx(2.5 / 6, abs=1e-12)
    assert overall["pass@1"] == pytest.approx(2.5 / 6, abs=1e-12)
    # pass@2 of c of 4: c=4 -> 1, c=1 -> 1/2, c=2 -> 5/6, c=0 -> 0.
    assert a["pass@2"] == pytest.approx((1 + 0.5 + 5 / 6) / 3, abs=1e-12)
    assert b["pass@2"] == pytest.approx((5 / 6 + 0.5) / 3, abs=1e-12)
    assert (a["pass@4"], b["pass@4"], overall["pass@4"]) == pytest.approx((1, 2 / 3, 5 / 6), abs=1e-12)
    # maj@4. a: right; wrong (2 votes of "w"); right ("g" and boxed "b" are one answer with 2 votes).
    # b: "w" and "g" tie with 2 votes, "w" comes first -> wrong; right beats non-answers; no answer -> wrong.
    assert (a["maj@4"], b["maj@4"], overall["maj@4"]) == pytest.approx((2 / 3, 1 / 3, 0.5), abs=1e-12)
    assert overall["truncated_share"] == 0.0
    assert report["sampling"]["top_p"] == 0.7 and report["k"] == 4


def test_planted_correct_counts_on_a_synthetic_set(tokenizer):
    """Problem i gets c_i = i % (k + 1) right answers at rotating positions and no answer elsewhere."""
    k, num = 4, 15
    ex = _examples(tokenizer, num)
    responses, layouts = {}, []
    for i, e in enumerate(ex):
        right = {(i + j) % k for j in range(i % (k + 1))}
        layouts.append([s in right for s in range(k)])
        responses[tuple(e.prompt_ids)] = [_answer(e, e.ground_truth) if s in right else "no idea" for s in range(k)]
    report = evaluate(GuardedEngine(FakeEngine(tokenizer, responses)), ex, tokenizer, _params(k), pass_at=(1, 2, 3, 4))
    overall = report["overall"]
    assert overall["avg@4"] == pytest.approx(sum(sum(x) / k for x in layouts) / num, abs=1e-12)
    for j in (1, 2, 3, 4):
        # Reference: over all j-subsets of each problem's planted samples, the share holding a right one.
        expected = (
            sum(
                Fraction(
                    sum(any(x[s] for s in subset) for subset in itertools.combinations(range(k), j)),
                    len(list(itertools.combinations(range(k), j))),
                )
                for x in layouts
            )
            / num
        )
        assert overall[f"pass@{j}"] == pytest.approx(float(expected), abs=1e-12)
    # Wrong samples give no answer, so the majority is right exactly when some sample is.
    assert overall["maj@4"] == pytest.approx(sum(any(x) for x in layouts) / num, abs=1e-12)
    assert overall["num_problems"] == num


def test_chunked_calls_advance_the_progress_display(tokenizer):
    ex = _examples(tokenizer, 5)
    engine = FakeEngine(tokenizer, {tuple(e.prompt_ids): [_answer(e, e.ground_truth)] * 2 for e in ex})
    out = io.StringIO()
    progress = Progress(total=5, desc="eval", unit="problems", file=out)
    report = evaluate(GuardedEngine(engine), ex, tokenizer, _params(2), progress=progress, prompts_per_call=2)
    progress.close()
    assert engine.calls == [2, 2, 1]
    assert progress.n == 5
    assert "eval: 5/5 problems" in out.getvalue()
    assert report["overall"]["num_problems"] == 5 and report["overall"]["avg@2"] == 1.0


def test_calls_draw_independent_seeds(tokenizer):
    ex = _examples(tokenizer, 5)
    engine = FakeEngine(tokenizer, {tuple(e.prompt_ids): [_answer(e, e.ground_truth)] * 2 for e in ex})
    seeds = []
    real_generate = engine.generate

    def recording_generate(prompts, params):
        seeds.append(params.seed)
        return real_generate(prompts, params)

    engine.generate = recording_generate
    with pytest.raises(ValueError, match="needs at least one example"):
        evaluate(GuardedEngine(engine), [], tokenizer, _params(2))
    # A fixed seed gives each call (chunk, or rank's share) its own stream, reproducibly.
    seeded = SamplingParams(max_new_tokens=64, temperature=1.0, top_p=0.7, n=2, seed=7)
    evaluate(GuardedEngine(engine), ex, tokenizer, seeded, prompts_per_call=2)
    evaluate(GuardedEngine(engine), ex, tokenizer, seeded, prompts_per_call=2)
    evaluate(GuardedEngine(engine), ex[1:], tokenizer, seeded)  # another rank's share
    assert len(set(seeds[:3])) == 3 and seeds[3:6] == seeds[:3] and seeds[6] not in seeds[:3]
    assert evaluation.evaluate(GuardedEngine(engine), ex, tokenizer, _params(2)) and seeds[-1] is None  # None stays


def _held_out_worker(rank, world, tokenizer, examples, run_path):
    from evaluation.held_out import run_held_out_eval
    from parallel.dist_env import init_distributed

    engine = FakeEngine(tokenizer, {tuple(e.prompt_ids): [_answer(e, e.ground_truth)] * 2 for e in examples})
    dist_env = init_distributed(1, -1, 1)
    metrics = run_held_out_eval(GuardedEngine(engine, dist_env), examples, tokenizer, _params(2), dist_env, run_path, 0)
    return engine.calls, metrics["eval/avg_at_k"]


@pytest.mark.multiprocess
def test_held_out_eval_with_more_ranks_than_problems(tokenizer, tmp_path):
    from dist_utils import run_ranks

    one_problem = _examples(tokenizer, 1)
    results = run_ranks(_held_out_worker, 2, tokenizer, one_problem, str(tmp_path))
    assert results == [([1], 1.0), ([], 1.0)]  # rank 1 has no problem: it takes part, with nothing to generate


def test_engine_failures_and_repeats_are_refused_with_counts(tokenizer):
    ex = _examples(tokenizer, 3)
    responses = {tuple(e.prompt_ids): ["x", "y"] for e in ex}
    with pytest.raises(EngineFailure, match="aborted 6 of 6 requests"):
        evaluate(GuardedEngine(FakeEngine(tokenizer, responses, finish="abort")), ex, tokenizer, _params(2))

    class Short(FakeEngine):
        def generate(self, prompts, params):
            return super().generate(prompts, params)[:-1]

    with pytest.raises(EngineFailure, match="returned 5 completions for 3 prompts x 2 samples"):
        evaluate(GuardedEngine(Short(tokenizer, responses)), ex, tokenizer, _params(2))
    with pytest.raises(ValueError, match="example 3 repeats example 0"):
        evaluate(GuardedEngine(FakeEngine(tokenizer, responses)), ex + ex[:1], tokenizer, _params(2))
    with pytest.raises(ValueError, match="pass@3 needs between 1 and k = 2"):
        evaluate(GuardedEngine(FakeEngine(tokenizer, responses)), ex, tokenizer, _params(2), pass_at=(1, 3))


def test_table_and_flat_metrics(tokenizer):
    ex = _examples(tokenizer, 4, sources=["aime", "aime"])
    engine = FakeEngine(tokenizer, {tuple(e.prompt_ids): [_answer(e, e.ground_truth), "?"] for e in ex})
    report = evaluate(GuardedEngine(engine), ex, tokenizer, _params(2))
    table = format_table(report).splitlines()
    assert table[0].split() == ["source", "problems", "avg@2", "pass@1", "pass@2", "maj@2", "mean", "len", "truncated"]
    rows = {line.split()[0]: line.split() for line in table if line[:1].isalnum()}
    assert rows["aime"][1:6] == ["2", "50.0%", "50.0%", "100.0%", "100.0%"]
    assert rows["overall"][1:6] == ["4", "50.0%", "50.0%", "100.0%", "100.0%"]
    flat = flat_metrics(report)
    assert flat["eval/avg_at_k"] == 0.5 and flat["eval/pass_at_k"] == 1.0 and flat["eval/maj_at_k"] == 1.0
    assert flat["eval/pass_at_1"] == 0.5 and flat["eval/aime/avg_at_k"] == 0.5
    assert set(flat) >= {"eval/response_length/mean", "eval/truncated_share", "eval/synthetic_arithmetic_l2/avg_at_k"}


# ------------------------------------------------------------------------------------------ real engine, CLI


@pytest.fixture(scope="module")
def checkpoint(tokenizer, tmp_path_factory):
    """A run folder whose hf/ export holds a tiny random Qwen2 and the tokenizer."""
    run = tmp_path_factory.mktemp("run")
    args = PRESETS["tiny"].replace(vocab_size=tokenizer.vocab_size, init_std=0.2)
    save_hf(build_model(args, seed=3), str(run / "hf"))
    tokenizer.save(str(run / "hf"))
    (run / "config.json").write_text(json.dumps({"job": {"name": run.name}}))  # the run's own configuration
    return run


@pytest.fixture()
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_evaluate_with_the_torch_engine_matches_direct_scoring(tokenizer, checkpoint, one_thread):
    from model.hf import load_hf

    ex = _examples(tokenizer, 3)
    params = SamplingParams(
        max_new_tokens=6, temperature=1.0, top_p=0.7, n=2, stop_token_ids=tuple(tokenizer.stop_ids), seed=11
    )

    def engine():
        return TorchEngine(load_hf(str(checkpoint / "hf")), max_batch_size=8, max_seq_len=512)

    report = evaluate(GuardedEngine(engine()), ex, tokenizer, params)
    # evaluate() seeds its one call from (seed, first problem): the same draw, made directly.
    completions = generate(engine(), [e.prompt_ids for e in ex], evaluation.call_params(params, ex, 0))
    lengths = [len(c.token_ids) for c in completions]
    acc = [
        compute_score(tokenizer.decode(c.token_ids, skip_special_tokens=True), ex[c.prompt_index].ground_truth)["acc"]
        for c in completions
    ]
    assert report["overall"]["response_length/mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert report["overall"]["avg@2"] == pytest.approx(sum(acc) / len(acc))
    assert report["overall"]["truncated_share"] == pytest.approx(
        sum(c.finish_reason == "length" for c in completions) / len(completions)
    )


# The demo recipe (eval.py's default --config) with prompts as long as the test tokenizer writes them (and, for
# the recipe's training rules, micro-batches that hold them).
LONG_PROMPTS = ["--data.max_prompt_length=1024", "--training.micro_batch_tokens=2048"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_an_output_that_cannot_be_written_fails_at_its_first_write_before_the_evaluation(
    checkpoint, monkeypatch, capsys
):
    """`eval.py ... > /dev/full`: the table's header is written before any work, and its write fails there, in one
    line with exit code 2 (the whole evaluation ran, then an OSError traceback)."""
    monkeypatch.setattr(eval_command, "evaluate", lambda *args, **kwargs: pytest.fail("evaluated with no output"))
    with open("/dev/full", "wb", buffering=0) as device:
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(device, write_through=True))
        with pytest.raises(SystemExit) as info:
            eval_command.run_cli(["--model", str(checkpoint), "--data", "synthetic", "--data.synthetic_num_eval=2",
                                  "--eval.k=2", "--metrics.progress=false", *LONG_PROMPTS])  # fmt: skip
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "eval.py: error: cannot write the standard output: No space left on device; make room or make its folder "
        "writable, then run the same command again"
    )


def test_cli_on_a_run_folder_prints_table_and_json(checkpoint, capsys, one_thread):
    argv = [
        "--model",
        str(checkpoint),
        "--data",
        "synthetic",
        "--data.synthetic_num_eval=4",
        "--eval.k=2",
        "--eval.top_p=0.7",
        "--eval.max_response_length=6",
        "--metrics.progress=false",
        "--rollout.max_batch_size=4",
        "--eval.pass_at=2",
        *LONG_PROMPTS,
    ]
    report = eval_command.main(argv)
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[0].split()[:3] == ["source", "problems", "avg@2"]
    assert printed[2].split()[:2] == ["synthetic_arithmetic_l2", "4"]
    assert printed[-2].split()[:2] == ["overall", "4"]
    assert json.loads(printed[-1]) == report  # the last line is the whole report: `| tail -n 1 > report.json`
    assert report["model"] == str(checkpoint / "hf")
    assert report["overall"]["num_problems"] == 4 and report["overall"]["num_samples"] == 2
    assert 1 <= report["overall"]["response_length/mean"] <= 6
    assert "pass@2" in report["overall"] and "pass@1" not in report["overall"]  # eval.pass_at
    assert report["sampling"] == {
        "n": 2,
        "temperature": 1.0,
        "top_p": 0.7,
        "top_k": -1,
        "max_new_tokens": 6,
        "strict_box": False,
    }


def test_cli_greedy_is_deterministic_and_bad_paths_are_named(checkpoint, tmp_path, capsys, one_thread):
    argv = [
        "--model",
        str(checkpoint / "hf"),
        "--data",
        "synthetic",
        "--data.synthetic_num_eval=3",
        "--eval.greedy=true",
        "--eval.k=1",
        "--eval.max_response_length=5",
        "--metrics.progress=false",
        *LONG_PROMPTS,
    ]
    first, second = eval_command.main(argv), eval_command.main(argv)
    for report in (first, second):
        report.pop("time_s")
    assert first == second and first["sampling"]["temperature"] == 0.0
    assert first["sampling"]["top_p"] == 1.0 and first["sampling"]["top_k"] == -1  # no filter shown that is unused
    with pytest.raises(ConfigError, match="nowhere"):
        eval_command.main(["--model", str(tmp_path / "nowhere"), "--data", "synthetic"])
    with pytest.raises(SystemExit) as exit_info:
        eval_command.run_cli(["--model", str(checkpoint), "--data", "synthetic", "--eval.greedy=true", "--eval.k=4"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "eval.k = 4 (command line): must be 1 with eval.greedy" in err


def test_an_unfinished_run_folder_is_named_as_such(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000003").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"job": {"name": "run"}}))  # the run's configuration, not a model's
    with pytest.raises(ConfigError) as refused:
        eval_command.main(["--model", str(run), "--data", "synthetic"])
    assert str(refused.value) == (
        f"--model {run} is a run folder without an HF export: its run has not finished (its newest checkpoint is "
        "step 3); the export is written when it finishes (run its train.py command again); or pass an HF checkpoint"
    )
    (run / "finished.json").write_text('{"step": 3}')
    with pytest.raises(ConfigError, match="without an HF export: its run finished with checkpoint.export_hf = false"):
        eval_command.main(["--model", str(run), "--data", "synthetic"])


EVAL_ARGS = ["--data", "synthetic", "--data.synthetic_num_eval=2", "--eval.k=2", "--eval.max_response_length=4"]


def test_ctrl_c_is_one_line_and_exit_130(checkpoint, tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_command, "evaluate", interrupted)
    with pytest.raises(SystemExit) as stopped:
        eval_command.run_cli(["--model", str(checkpoint), *EVAL_ARGS, *LONG_PROMPTS])
    printed = capsys.readouterr()
    assert stopped.value.code == 130 and printed.out.startswith("source ")  # the table's header, written first
    assert len(printed.out.splitlines()) == 2  # and no row, no report line
    assert printed.err.strip() == "eval.py: interrupted (Ctrl-C); no report was written"


def test_cli_subprocess(checkpoint):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "eval.py",
            "--model",
            str(checkpoint),
            "--data",
            "synthetic",
            "--data.synthetic_num_eval",
            "2",
            "--eval.k=2",
            "--eval.max_response_length=4",
            *LONG_PROMPTS,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    table, last = proc.stdout.strip().rsplit("\n", 1)  # what `| tail -n 1 > report.json` keeps: the whole report
    report = json.loads(last)
    assert report["model"] == str(checkpoint / "hf") and report["data"] == "synthetic"
    assert report["overall"]["num_problems"] == 2 and report["sampling"]["n"] == 2
    assert table.startswith("source ") and table.splitlines()[-1].split()[:2] == ["overall", "2"]
    assert "eval: 2/2 problems" in proc.stderr  # the progress display, as plain lines (stderr is a pipe)


def test_script_exits_with_one_line_on_bad_input(tmp_path, monkeypatch, capsys):
    # The script's __main__ block, in-process: bad input ends with a message naming it, no traceback, exit 2.
    monkeypatch.setattr(sys, "argv", ["eval.py", "--model", str(tmp_path / "missing"), "--data", "synthetic"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(os.path.join(ROOT, "eval.py"), run_name="__main__")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert str(tmp_path / "missing") in err and "hf/config.json" in err and len(err.strip().splitlines()) == 1


def test_json_is_an_unknown_argument(tmp_path, monkeypatch, capsys):
    # The report is the last line printed (`| tail -n 1 > report.json`); a --json flag is refused as any unknown
    # one, by argparse: its usage, one error line, exit 2, before anything runs.
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["eval.py", "--model", str(tmp_path), "--json", str(out)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(os.path.join(ROOT, "eval.py"), run_name="__main__")
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and not out.exists()
    assert err[0].startswith("usage: eval.py") and "Traceback" not in "\n".join(err)
    assert [line for line in err if "error" in line] == [f"eval.py: error: unrecognized arguments: --json {out}"]


def test_params_from_config_follow_the_eval_section():
    from config import Config, ConfigError, validate

    cfg = Config()
    params = evaluation.params_from_config(cfg, [0, 2], seed=5)
    assert (params.n, params.temperature, params.top_p, params.top_k) == (32, 1.0, 0.7, -1)
    assert params.max_new_tokens == 20480  # rollout.max_response_length
    assert params.stop_token_ids == (0, 2) and params.seed == 5
    cfg.eval.top_k = 20
    assert evaluation.params_from_config(cfg, [0]).top_k == 20
    cfg.eval.greedy, cfg.eval.k, cfg.eval.max_response_length = True, 1, 48
    validate(cfg)
    params = evaluation.params_from_config(cfg, [0])
    assert (params.n, params.temperature, params.top_p, params.top_k, params.max_new_tokens) == (1, 0.0, 1.0, -1, 48)
    cfg.eval.k = 4  # greedy decoding has one answer: the configuration refuses more samples
    with pytest.raises(ConfigError, match="eval.k = 4: must be 1 with eval.greedy"):
        validate(cfg)


def test_eval_and_train_read_one_configuration(tmp_path):
    import config

    demo = os.path.join(ROOT, "configs", "demo_cpu.toml")
    overrides = ["--eval.k=2", "--rollout.max_batch_size", "256", "--data.synthetic_num_eval=7"]
    cfg, _ = eval_command.parse_cli(["--config", demo, *overrides])
    assert cfg == config.parse_cli(["--config", demo, *overrides])[0]
    assert eval_command.parse_cli([])[0] == config.load_config(config.DEFAULT_CONFIG)  # the same default file
    assert eval_command.parse_cli([])[0].rollout.max_batch_size == 512  # the recipe's, not a second default
    # The short flags set one key each (--model also clears the recipe's random-init preset).
    cfg, _ = eval_command.parse_cli(["--model", "/runs/x", "--data", "/aime.parquet", "--tokenizer", "/tok"])
    assert (cfg.model.hf_path, cfg.model.preset, cfg.data.eval_path, cfg.model.tokenizer_path) == (
        "/runs/x",
        "",
        "/aime.parquet",
        "/tok",
    )
    with pytest.raises(config.ConfigError, match=r"unknown key 'eval\.kk' \(command line\); did you mean 'eval\.k'"):
        eval_command.parse_cli(["--eval.kk=3"])


def test_the_evaluation_library_does_not_import_the_command():
    import ast
    import glob

    for path in glob.glob(os.path.join(ROOT, "trainer", "*.py")):
        with open(path) as f:
            tree = ast.parse(f.read())
        modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert "eval" not in modules, path
