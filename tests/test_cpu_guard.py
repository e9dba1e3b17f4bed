"""Unusable data files end in one line naming the file and the problem, with exit code 2, before any work."""

import dataclasses
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

import eval as evaluation
import train
from model.args import get_preset
from model.hf import save_hf
from model.qwen2 import build_model
from model.tokenizer import IM_END, render_chat, train_bpe_tokenizer
from rl.data import synthetic_arithmetic_rows, write_parquet_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2.5-shaped checkpoint with its tokenizer, long enough for the recipes' sequences, and data."""
    folder = tmp_path_factory.mktemp("guard")
    rows = synthetic_arithmetic_rows(40, split="train", seed=0)
    args = dataclasses.replace(get_preset("demo"), max_position_embeddings=32768)
    save_hf(build_model(args, seed=0), str(folder / "ckpt"))
    texts = [render_chat(r["prompt"]) + r["extra_info"]["solution"] + IM_END for r in rows]
    train_bpe_tokenizer(texts, args.vocab_size, split_words=False).save(str(folder / "ckpt"))
    write_parquet_rows(rows, str(folder / "train.parquet"))
    return folder


def run(script, *args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


# ------------------------------------------------------------------------------------------ bad data files


def _bad_files(folder):
    """One file per way a prompt file can be unusable, with the message that must name it."""
    folder.mkdir(exist_ok=True)
    empty, text, no_rows, other = (folder / n for n in ("empty.parquet", "text.parquet", "no_rows.parquet",
                                                        "other.parquet"))
    empty.write_bytes(b"")
    text.write_text("question,answer\nWhat is 1 + 1?,2\n")
    write_parquet_rows(synthetic_arithmetic_rows(2), str(no_rows))
    pq.write_table(pq.read_table(str(no_rows)).slice(0, 0), str(no_rows))
    write_parquet_rows([{"question": "What is 1 + 1?", "answer": "2"}], str(other))
    return {
        "empty": (empty, f"{empty}: the file is empty (0 bytes), not a parquet file"),
        "not-parquet": (text, f"{text}: cannot be read as parquet (Parquet magic bytes not found"),
        "no-rows": (no_rows, f"{no_rows}: the parquet file has no rows (columns: data_source, prompt, ability, "
                             "reward_model, extra_info)"),
        "missing-columns": (other, f"{other}: no column 'prompt', 'reward_model' (it has question, answer)"),
        "missing": (folder / "missing.parquet", f"data file not found: {folder / 'missing.parquet'}"),
    }


KINDS = ["empty", "not-parquet", "no-rows", "missing-columns"]


@pytest.mark.parametrize("kind", KINDS)
def test_train_refuses_an_unusable_data_file_in_one_line_before_any_work(kind, checkpoint, tmp_path, capsys):
    path, message = _bad_files(tmp_path / "data")[kind]
    capsys.readouterr()  # the parquet writer's progress bars
    argv = ["--config", os.path.join(ROOT, "configs/demo_cpu.toml"), "--model.preset=",
            f"--model.hf_path={checkpoint / 'ckpt'}", f"--data.{'eval' if kind == 'no-rows' else 'train'}_path={path}",
            f"--job.run_dir={tmp_path / 'runs'}"]
    with pytest.raises(SystemExit) as info:
        train.run_cli(argv)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err.startswith(f"data error: {message}") and len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()  # refused before the run folder is made


@pytest.mark.parametrize("kind", KINDS + ["missing"])
def test_eval_refuses_an_unusable_data_file_in_one_line(kind, checkpoint, tmp_path, capsys):
    path, message = _bad_files(tmp_path / "data")[kind]
    capsys.readouterr()  # the parquet writer's progress bars
    with pytest.raises(SystemExit) as info:
        evaluation.run_cli(["--model", str(checkpoint / "ckpt"), "--data", str(path), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err.startswith(f"eval.py: data error: {message}") and len(err.splitlines()) == 1


def test_the_scripts_end_a_data_problem_with_one_line_and_exit_code_2(checkpoint, tmp_path):
    path, message = _bad_files(tmp_path / "data")["no-rows"]
    proc = run("train.py", "--config", "configs/demo_cpu.toml", "--model.preset=",
               f"--model.hf_path={checkpoint / 'ckpt'}", f"--data.train_path={path}", f"--job.run_dir={tmp_path}")
    assert (proc.returncode, proc.stderr.strip()) == (2, f"data error: {message}")
    proc = run("eval.py", "--model", str(checkpoint / "ckpt"), "--data", str(path), "--no-progress")
    assert (proc.returncode, proc.stderr.strip()) == (2, f"eval.py: data error: {message}")
