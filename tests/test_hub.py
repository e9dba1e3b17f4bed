"""Models and prompt sets by hub id (model/hub.py, data/hub.py, preflight/hub_inputs.py), with no network: a hub
cache laid out as huggingface_hub lays one out (tests/hub_cache.py), read with HF_HUB_OFFLINE=1. The failures
only a hub can answer with (no such repository, gated, no such revision) are raised by huggingface_hub's own
`hf_raise_for_status` from the answer the hub sends, in a stubbed download, and reach train.py's exit as one line."""

import json
import os
import time
from dataclasses import replace

import httpx2
import huggingface_hub
import pytest
import torch
from huggingface_hub.utils import filter_repo_objects, hf_raise_for_status

import eval as eval_command
import train
from config import Config
from data.hub import fetch_dataset, read_dataset_rows
from data.prompt_row import DAPO_COLUMNS
from data.prompts import load_prompts, read_parquet_rows
from errors import ConfigError, DataError
from model.args import PRESETS
from model.hf import load_hf
from model.hub import MODEL_PATTERNS, HubName, hub_name, local_path
from model.tokenizer import IM_END, Tokenizer, render_chat, train_bpe_tokenizer
from preflight.hub_inputs import EVAL_INPUTS, cached_model, fetch_hub_inputs
from tasks.arithmetic import synthetic_arithmetic_rows
from tests.dist_utils import run_ranks
from tests.hub_cache import put_folder_in_hub_cache, put_in_hub_cache
from tests.parquet_rows import write_parquet_rows
from tests.qwen2_checkpoint import write_qwen2_checkpoint

MODEL_COMMIT, DATA_COMMIT, OLD_COMMIT = "1" * 40, "2" * 40, "3" * 40

# A one-step CPU run of the demo recipe that stops before training (what these tests check comes before it).
SMALL = [
    "--config=configs/demo_cpu.toml",
    "--model.preset=",
    "--training.steps=1",
    "--training.train_batch_size=2",
    "--training.mini_batch_size=2",
    "--rollout.n=2",
    "--data.max_prompt_length=256",
    "--rollout.max_response_length=8",
    "--algorithm.overlong_buffer=4",
    "--training.micro_batch_tokens=512",
    "--eval.at_start=false",
    "--metrics.progress=false",
]


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    """An empty hub cache, offline. The environment for child processes; huggingface_hub's constants, which it
    read from the environment when first imported, for this one."""
    import datasets
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    return home / "hub"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2 written by transformers' save_pretrained in two shards with an index, and its tokenizer."""
    folder = tmp_path_factory.mktemp("hf") / "tiny"
    write_qwen2_checkpoint(str(folder), PRESETS["tiny"].replace(vocab_size=512), dtype=torch.float32,
                           max_shard_size="100KB")  # fmt: skip
    rows = synthetic_arithmetic_rows(40, split="train", seed=0)
    train_bpe_tokenizer([render_chat(r["prompt"]) + r["extra_info"]["solution"] + IM_END for r in rows], 512).save(
        str(folder)
    )
    return folder


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    """Two DAPO-schema parquet files: a training set and a held-out set."""
    folder = tmp_path_factory.mktemp("sets")
    write_parquet_rows(synthetic_arithmetic_rows(24, split="train", seed=0), str(folder / "train.parquet"))
    write_parquet_rows(synthetic_arithmetic_rows(6, split="eval", seed=0), str(folder / "eval.parquet"))
    return folder


def _cfg(**model_and_data) -> Config:
    cfg = Config()
    model = {k: v for k, v in model_and_data.items() if k in ("hf_path", "tokenizer_path")}
    data = {k: v for k, v in model_and_data.items() if k in ("train_path", "eval_path")}
    return replace(cfg, model=replace(cfg.model, **model), data=replace(cfg.data, **data))


# ------------------------------------------------------------------------------------------ names and paths


def test_an_id_is_told_from_a_path(tmp_path, monkeypatch):
    assert hub_name("Qwen/Qwen2.5-32B") == HubName("Qwen/Qwen2.5-32B")
    assert hub_name("Qwen/Qwen2.5-32B@refs/pr/1") == HubName("Qwen/Qwen2.5-32B", "refs/pr/1")
    assert hub_name("BytedTsinghua-SIA/AIME-2024@v1:test", splits=True) == HubName(
        "BytedTsinghua-SIA/AIME-2024", "v1", "test"
    )
    assert hub_name("BytedTsinghua-SIA/AIME-2024:test") is None  # a model takes no split
    # Paths: what exists (it always wins over an id), what starts as a path or ends as a data file, what no hub
    # id can be (not two parts, or a part huggingface_hub's validate_repo_id refuses).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen" / "Qwen2.5-32B").mkdir(parents=True)
    for value in ("Qwen/Qwen2.5-32B", "./org/name", "/ckpt/Qwen", "~/ckpt/Qwen", "data/dapo.parquet", "d/a.jsonl",
                  "synthetic", "", "a/b/c", "org/bad--name", "org/..name"):  # fmt: skip
        assert hub_name(value, splits=True) is None, value


def test_a_value_is_a_path_where_any_base_holds_its_first_part(tmp_path):
    """local_path, which makes the command line's and a TOML file's paths absolute (config/cli.py)."""
    repo, cwd = tmp_path / "repo", tmp_path / "cwd"
    (repo / "bases" / "demo").mkdir(parents=True)
    (cwd / "Qwen").mkdir(parents=True)
    both = (str(cwd), str(repo))
    assert local_path("bases/demo", both) == str(repo / "bases" / "demo")  # not in the first base: the second's
    assert local_path("bases/dmeo", both) == str(repo / "bases" / "dmeo")  # a typo is a missing path, not an id
    assert local_path("Qwen/Qwen2.5-32B", both) == str(cwd / "Qwen" / "Qwen2.5-32B")  # a local folder wins
    assert local_path("./runs/x", both) == str(cwd / "runs" / "x") and local_path("runs/x", both) == "runs/x"
    assert local_path("/abs/x", both) == "/abs/x" and local_path("~/x", both) == os.path.expanduser("~/x")
    assert local_path("Qwen/Qwen2.5-7B@main", (str(repo),)) == "Qwen/Qwen2.5-7B@main"
    assert local_path("org/set:train", both, splits=True) == "org/set:train"
    assert [local_path(v, both) for v in ("", "synthetic")] == ["", "synthetic"]


def test_only_the_files_the_loader_reads_are_fetched():
    """The patterns against the file list of Qwen/Qwen2.5-32B's repository (its shards, index, configs and
    tokenizer, beside its licence and card), plus files other Qwen2 repositories carry."""
    qwen_32b = [".gitattributes", "LICENSE", "README.md", "config.json", "generation_config.json", "merges.txt",
                "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "vocab.json"]  # fmt: skip
    qwen_32b += [f"model-{i:05d}-of-00017.safetensors" for i in range(1, 18)]
    others = ["pytorch_model.bin", "original/consolidated.00.pth", "chat_template.jinja", "model.gguf"]
    fetched = set(filter_repo_objects(qwen_32b + others, allow_patterns=MODEL_PATTERNS))
    assert fetched == set(qwen_32b + ["chat_template.jinja"]) - {".gitattributes", "LICENSE", "README.md"}


# ------------------------------------------------------------------------------------------ resolved from the cache


def test_a_model_id_resolves_offline_to_the_checkpoint_its_directory_holds(hub, checkpoint):
    snapshot = put_folder_in_hub_cache(hub, "model", "org/tiny", checkpoint, commit=MODEL_COMMIT)
    for name in ("org/tiny", "org/tiny@main", f"org/tiny@{MODEL_COMMIT}"):
        cfg = fetch_hub_inputs(_cfg(hf_path=name, tokenizer_path=name))
        assert cfg.model.hf_path == cfg.model.tokenizer_path == str(snapshot)
    from_hub, from_dir = load_hf(cfg.model.hf_path).state_dict(), load_hf(str(checkpoint)).state_dict()
    assert from_hub.keys() == from_dir.keys() and all(torch.equal(from_hub[k], from_dir[k]) for k in from_dir)
    text = render_chat([{"role": "user", "content": "What is 12 + 30?"}])
    assert Tokenizer.from_dir(cfg.model.tokenizer_path).encode(text) == Tokenizer.from_dir(str(checkpoint)).encode(text)
    assert fetch_hub_inputs(_cfg(hf_path=str(checkpoint))).model.hf_path == str(checkpoint)  # a path stays


def test_a_rerun_with_the_hub_answering_downloads_nothing_the_cache_holds(hub, checkpoint, monkeypatch):
    """Online, the hub resolves main to the cached commit and lists the checkpoint's files: none is requested
    again (every download starts with huggingface_hub's metadata request, stubbed to fail), but one the cache
    lacks is."""
    from types import SimpleNamespace

    from huggingface_hub import HfApi, constants, file_download
    from huggingface_hub.hf_api import RepoFile

    import model.hub

    snapshot = put_folder_in_hub_cache(hub, "model", "org/tiny", checkpoint, commit=MODEL_COMMIT)
    files = {str(p.relative_to(checkpoint)): p for p in checkpoint.rglob("*") if p.is_file()}
    put_in_hub_cache(hub, "model", "org/partial", {k: v for k, v in files.items() if k != "config.json"},
                     commit=MODEL_COMMIT)  # fmt: skip
    listing = [RepoFile(path=name, size=p.stat().st_size, oid="0" * 40) for name, p in files.items()]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model.hub, "_unreachable", lambda endpoint: False)  # the stubs below are the hub
    monkeypatch.setattr(HfApi, "repo_info", lambda self, repo_id, **kw: SimpleNamespace(sha=MODEL_COMMIT))
    monkeypatch.setattr(HfApi, "list_repo_tree", lambda self, repo_id, **kw: iter(listing))

    def request(*args, repo_id, filename, **kwargs):
        raise AssertionError(f"{repo_id}/{filename} requested from the hub")

    monkeypatch.setattr(file_download, "_get_metadata_or_catch_error", request)
    assert fetch_hub_inputs(_cfg(hf_path="org/tiny")).model.hf_path == str(snapshot)
    with pytest.raises(AssertionError, match="org/partial/config.json requested from the hub"):
        fetch_hub_inputs(_cfg(hf_path="org/partial"))


def _dataset_repo(tmp_path, files: dict[str, list[dict]]):
    folder = tmp_path / "repo"
    for path, rows in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        write_parquet_rows(rows, str(folder / path))
    return folder


def test_a_dataset_id_reads_the_rows_of_its_parquet_file(hub, prompt_files, checkpoint, tmp_path):
    """One file, as DAPO-Math-17k's repository holds it (data/dapo-math-17k.parquet: the split 'train')."""
    local = str(prompt_files / "train.parquet")
    put_in_hub_cache(hub, "dataset", "org/math", {"data/dapo-math-17k.parquet": prompt_files / "train.parquet"},
                     commit=DATA_COMMIT)  # fmt: skip
    assert fetch_dataset(HubName("org/math"), "data.train_path") == f"org/math@{DATA_COMMIT}"
    expected = read_parquet_rows(local, DAPO_COLUMNS.required)
    for name in ("org/math", "org/math:train", f"org/math@{DATA_COMMIT}", "org/math@main:train"):
        assert read_dataset_rows(name, DAPO_COLUMNS.required) == expected, name
    tokenizer = Tokenizer.from_dir(str(checkpoint))
    assert load_prompts("org/math", tokenizer, max_prompt_length=256) == load_prompts(
        local, tokenizer, max_prompt_length=256
    )


def test_an_unreachable_hub_is_asked_once_and_a_cached_set_read_at_once(hub, prompt_files, monkeypatch, caplog):
    """HF_HUB_OFFLINE unset and nothing listening at the endpoint: one line says so, then the cache alone is read,
    with none of huggingface_hub's retries (five over ~23 s for each commit-pinned id, one line each)."""
    from huggingface_hub import constants

    import model.hub

    put_in_hub_cache(hub, "dataset", "org/math", {"data/train.parquet": prompt_files / "train.parquet"},
                     commit=DATA_COMMIT)  # fmt: skip
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing answers
    model.hub._unreachable.cache_clear()
    start = time.monotonic()
    with caplog.at_level("INFO"):
        pinned = fetch_dataset(HubName("org/math"), "data.train_path")
        rows = read_dataset_rows(pinned, DAPO_COLUMNS.required)
    assert time.monotonic() - start < 10 and rows == read_parquet_rows(str(prompt_files / "train.parquet"))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith("the hub (http://127.0.0.1:9) cannot be reached ("), warnings
    model.hub._unreachable.cache_clear()


def test_a_dataset_with_splits_reads_the_one_named(hub, tmp_path):
    """Splits as datasets names them from file names (data/<split>-*.parquet)."""
    train, test = synthetic_arithmetic_rows(8, split="train", seed=0), synthetic_arithmetic_rows(3, split="eval")
    files = {"data/train-00000-of-00001.parquet": train, "data/test-00000-of-00001.parquet": test}
    repo = _dataset_repo(tmp_path, files)
    put_folder_in_hub_cache(hub, "dataset", "org/two", repo, commit=DATA_COMMIT)
    for split, path in (("test", "data/test-00000-of-00001.parquet"), ("train", "data/train-00000-of-00001.parquet")):
        assert read_dataset_rows(f"org/two:{split}") == read_parquet_rows(str(repo / path))
    with pytest.raises(DataError, match=r"^org/two: several splits; its splits are (train, test|test, train): name"):
        read_dataset_rows("org/two")
    with pytest.raises(DataError, match=r"^org/two:dev: no split 'dev'; its splits are"):
        read_dataset_rows("org/two:dev")


GSM8K_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
  - split: test
    path: socratic/test-*
---
"""


def test_a_dataset_with_several_configs_reads_the_one_named_and_names_them_when_none_is(hub, tmp_path):
    """openai/gsm8k's layout: two configs (main, socratic) in its README's header, each with train and test."""
    rows = {f"{c}/{s}-00000-of-00001.parquet": [{"question": f"{c} {s}", "answer": "#### 1"}] for c in
            ("main", "socratic") for s in ("train", "test")}  # fmt: skip
    repo = _dataset_repo(tmp_path, rows)
    (repo / "README.md").write_text(GSM8K_README)
    put_folder_in_hub_cache(hub, "dataset", "openai/gsm8k", repo, commit=DATA_COMMIT)
    columns = ("question", "answer")
    assert read_dataset_rows("openai/gsm8k:main:test", columns) == [{"question": "main test", "answer": "#### 1"}]
    assert read_dataset_rows(f"openai/gsm8k@{DATA_COMMIT}:socratic:train")[0]["question"] == "socratic train"
    several = r"several configs; its configs are main, socratic: name one, as in openai/gsm8k:main \(and a split: "
    with pytest.raises(DataError, match=rf"^openai/gsm8k: {several}openai/gsm8k:main:<split>\)$"):
        read_dataset_rows("openai/gsm8k")
    with pytest.raises(DataError, match=r"^openai/gsm8k:train: no config 'train'; its configs are main, socratic"):
        read_dataset_rows("openai/gsm8k:train")
    with pytest.raises(DataError, match=r"^openai/gsm8k:main: several splits; .*: name one, as in openai/gsm8k:main:"):
        read_dataset_rows("openai/gsm8k:main")
    (repo / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files: [\n---\n")
    put_folder_in_hub_cache(hub, "dataset", "org/broken", repo, commit=DATA_COMMIT)
    with pytest.raises(DataError, match=r"^org/broken: its README.md header is not valid YAML \(while parsing"):
        read_dataset_rows("org/broken")


def test_a_dataset_id_gets_a_parquet_files_schema_checks(hub, tmp_path):
    rows = synthetic_arithmetic_rows(3, split="train")
    no_reward = [{k: v for k, v in r.items() if k != "reward_model"} for r in rows]
    put_folder_in_hub_cache(hub, "dataset", "org/no-reward", _dataset_repo(tmp_path / "a", {"d.parquet": no_reward}),
                            commit=DATA_COMMIT)  # fmt: skip
    with pytest.raises(DataError, match=r"^org/no-reward: no column 'reward_model' \(it has .*prompt.*\); a prompt "):
        read_dataset_rows("org/no-reward", DAPO_COLUMNS.required)
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "b").mkdir()
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), str(tmp_path / "b" / "d.parquet"))
    put_folder_in_hub_cache(hub, "dataset", "org/empty", tmp_path / "b", commit=DATA_COMMIT)
    with pytest.raises(DataError, match=r"^org/empty: d.parquet has no rows$"):
        read_dataset_rows("org/empty", DAPO_COLUMNS.required)


def test_a_jsonl_file_reads_as_the_same_rows(prompt_files, tmp_path):
    rows = read_parquet_rows(str(prompt_files / "train.parquet"))
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_dataset_rows(str(path), DAPO_COLUMNS.required) == rows
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"prompt": [}\n')
    with pytest.raises(DataError, match=r"empty.jsonl: the file is empty \(0 bytes\)$"):
        read_dataset_rows(str(tmp_path / "empty.jsonl"))
    with pytest.raises(DataError, match=r"bad.jsonl: cannot be read as a data set \(JSON parse error"):
        read_dataset_rows(str(tmp_path / "bad.jsonl"))


def test_the_rehearsal_reads_a_cached_model_and_otherwise_its_preset(hub, checkpoint):
    cfg = _cfg(hf_path="org/tiny")
    assert cached_model(cfg).model.hf_path == ""  # not in the cache: rehearse.preset's shapes, nothing fetched
    snapshot = put_folder_in_hub_cache(hub, "model", "org/tiny", checkpoint, commit=MODEL_COMMIT)
    assert cached_model(cfg).model.hf_path == str(snapshot)


# ------------------------------------------------------------------------------------------ the commands


def test_train_and_eval_take_hub_ids(hub, checkpoint, prompt_files, tmp_path, monkeypatch):
    """train.py fetches every id before it builds anything and checks what it fetched; eval.py runs end to end."""
    snapshot = put_folder_in_hub_cache(hub, "model", "org/tiny", checkpoint, commit=MODEL_COMMIT)
    put_in_hub_cache(hub, "dataset", "org/math", {"data/math.parquet": prompt_files / "train.parquet"},
                     commit=DATA_COMMIT)  # fmt: skip
    put_in_hub_cache(hub, "dataset", "org/aime", {"data/train-0.parquet": prompt_files / "eval.parquet"},
                     commit=OLD_COMMIT)  # fmt: skip
    built = {}

    class Built(Exception):
        pass

    def build(cfg, *args, **kwargs):
        built["cfg"] = cfg
        raise Built

    monkeypatch.setattr(train, "build", build)
    ids = ["--model.hf_path=org/tiny", "--data.train_path=org/math", "--data.eval_path=org/aime:train"]
    with pytest.raises(Built):
        train.run_cli([*SMALL, *ids, f"--job.run_dir={tmp_path / 'runs'}"])
    cfg = built["cfg"]
    assert cfg.model.hf_path == str(snapshot)
    assert (cfg.data.train_path, cfg.data.eval_path) == (f"org/math@{DATA_COMMIT}", f"org/aime@{OLD_COMMIT}:train")

    argv = ["--model", "org/tiny", "--data", "org/aime:train", "--eval.k=1", "--eval.max_response_length=4"]
    argv += ["--metrics.progress=false", "--data.max_prompt_length=1024", "--training.micro_batch_tokens=2048"]
    report = eval_command.main(argv)
    assert report["model"] == str(snapshot) and report["data"] == f"org/aime@{OLD_COMMIT}:train"
    assert report["overall"]["num_problems"] == len(read_parquet_rows(str(prompt_files / "eval.parquet")))


def _hub_answers(status: int, error_code: str):
    """A stand-in for snapshot_download that gets the hub's answer `status` / X-Error-Code and raises what
    huggingface_hub raises for it (its hf_raise_for_status)."""

    def download(repo_id, *, repo_type=None, revision=None, **kwargs):
        kind = "datasets" if repo_type == "dataset" else "models"
        request = httpx2.Request("GET", f"https://huggingface.co/api/{kind}/{repo_id}/revision/{revision or 'main'}")
        hf_raise_for_status(httpx2.Response(status, headers={"X-Error-Code": error_code}, request=request))
        raise AssertionError("the answer was not an error")

    return download


ERRORS = {  # key = value: (status, X-Error-Code or None for the real offline cache miss, the line after the key)
    "model.hf_path=org/missing": (
        401, "RepoNotFound",
        "no model org/missing on the hub (or a private one this login cannot read), and no such local path: check "
        "the name, or log in (`hf auth login`) or set HF_TOKEN",
    ),
    "model.hf_path=org/gated": (
        403, "GatedRepo",
        "org/gated is gated: accept its terms on https://huggingface.co/org/gated, then log in (`hf auth login`) "
        "or set HF_TOKEN",
    ),
    "model.hf_path=org/tiny@v9": (
        404, "RevisionNotFound", "org/tiny has no revision 'v9': name one of its branches, tags or commits"
    ),
    "data.train_path=org/no-such-set": (
        404, "RepoNotFound", "no dataset org/no-such-set on the hub (or a private one this login cannot read)",
    ),
    "data.eval_path=org/gated-set:test": (
        403, "GatedRepo", "org/gated-set is gated: accept its terms on https://huggingface.co/datasets/org/gated-set",
    ),
    "model.hf_path=org/absent": (
        None, None, "offline (HF_HUB_OFFLINE is set) and not in the cache: org/absent ({cache}), and no such "
        "local path: fetch it once with network, or give a local path",
    ),
}  # fmt: skip


@pytest.mark.parametrize("setting", ERRORS)
def test_a_name_the_hub_cannot_serve_is_one_line_and_exit_2(setting, hub, checkpoint, tmp_path, monkeypatch, capsys):
    status, code, message = ERRORS[setting]
    if status is not None:
        monkeypatch.setattr(huggingface_hub, "snapshot_download", _hub_answers(status, code))
    model = [] if setting.startswith("model.") else [f"--model.hf_path={checkpoint}"]
    with pytest.raises(SystemExit) as info:
        train.run_cli([*SMALL, *model, f"--{setting}", f"--job.run_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip()
    key, value = setting.split("=")
    assert info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"configuration error: {key} = {value!r}: {message.format(cache=hub)}"), err
    assert not (tmp_path / "runs").exists()  # refused before the run folder exists


@pytest.mark.parametrize("held_out", ["jsonl", "hub"])
def test_an_eval_k_no_machine_holds_is_refused_for_a_set_read_through_datasets(
    held_out, hub, checkpoint, prompt_files, tmp_path, capsys
):
    """Such a set's size is known once it is read: it holds at least one problem, and k samples of one are
    checked as a parquet set's are (they were not, and the evaluation ended in a MemoryError)."""
    value = "org/aime"
    put_in_hub_cache(hub, "dataset", value, {"data/test.parquet": prompt_files / "eval.parquet"}, commit=DATA_COMMIT)
    if held_out == "jsonl":
        value = str(tmp_path / "eval.jsonl")
        rows = read_parquet_rows(str(prompt_files / "eval.parquet"))
        (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [*SMALL, f"--model.hf_path={checkpoint}", f"--data.eval_path={value}", "--eval.k=1000000000000"]
    with pytest.raises(SystemExit) as info:
        train.run_cli([*argv, f"--job.run_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(
        "configuration error: an evaluation's samples cannot fit this machine: eval.k = 1,000,000,000,000 samples "
        "of each of 1 problem held at once"
    ), err


def test_eval_names_a_model_the_hub_cannot_serve_in_one_line(hub, capsys):
    with pytest.raises(SystemExit) as info:
        eval_command.run_cli(["--model", "org/absent", "--data", "synthetic"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"eval.py: configuration error: model.hf_path = 'org/absent': offline (HF_HUB_OFFLINE is set) and not in the "
        f"cache: org/absent ({hub}), and no such local path: fetch it once with network, or give a local path"
    )
    assert EVAL_INPUTS == ("model.hf_path", "model.tokenizer_path", "data.eval_path")  # never the training set


# ------------------------------------------------------------------------------------------ one download per node


def _node_first_rank(rank, world_size, ranks_per_node, folder, fail_on):
    from parallel.dims import ParallelDims
    from parallel.dist_env import DistEnv, new_control_group

    local_rank = rank % ranks_per_node
    dims = ParallelDims(dp_replicate=1, dp_shard=world_size, tp=1, world_size=world_size)
    env = DistEnv(rank, world_size, local_rank, torch.device("cpu"), dims, new_control_group(None, 60))
    node_file = os.path.join(folder, f"node-{rank // ranks_per_node}")

    def fetch():
        if rank == fail_on:
            raise ConfigError(f"rank {rank} cannot fetch")
        if local_rank == 0:
            time.sleep(0.5)  # a slow download: the node's other ranks must not start before it ends
            with open(node_file, "w") as f:
                f.write("complete")
            return "downloaded"
        with open(node_file) as f:
            return f"found {f.read()}"

    try:
        return env.node_first(fetch)
    except ConfigError as exc:
        return f"raised: {exc}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size, ranks_per_node", [(2, 2), (4, 2)])
def test_one_process_per_node_fetches_and_the_others_find_its_files(world_size, ranks_per_node, tmp_path):
    results = run_ranks(_node_first_rank, world_size, ranks_per_node, str(tmp_path), None)
    assert results == ["downloaded" if r % ranks_per_node == 0 else "found complete" for r in range(world_size)]
    assert sorted(os.listdir(tmp_path)) == [f"node-{n}" for n in range(world_size // ranks_per_node)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("fail_on", [0, 1])
def test_a_failed_fetch_on_any_rank_is_raised_on_every_rank(fail_on, tmp_path):
    """A first process's failure stops its node's others before they try; a later one's stops the first too."""
    results = run_ranks(_node_first_rank, 2, 2, str(tmp_path), fail_on)
    assert results == [f"raised: rank {fail_on} cannot fetch"] * 2


def _fetch_rank(rank, world_size, calls_file):
    from parallel.dims import ParallelDims
    from parallel.dist_env import DistEnv, new_control_group

    real = huggingface_hub.snapshot_download

    def recorded(repo_id, **kwargs):
        with open(calls_file, "a") as f:
            f.write(f"{rank} {repo_id} {kwargs['local_files_only']}\n")
        return real(repo_id, **kwargs)

    huggingface_hub.snapshot_download = recorded
    dims = ParallelDims(dp_replicate=1, dp_shard=world_size, tp=1, world_size=world_size)
    env = DistEnv(rank, world_size, rank, torch.device("cpu"), dims, new_control_group(None, 60))
    cfg = fetch_hub_inputs(_cfg(hf_path="org/tiny", train_path="org/math"), dist_env=env)
    return cfg.model.hf_path, cfg.data.train_path


@pytest.mark.multiprocess
def test_the_other_processes_of_a_node_read_the_cache_the_first_filled(hub, checkpoint, prompt_files, tmp_path):
    snapshot = put_folder_in_hub_cache(hub, "model", "org/tiny", checkpoint, commit=MODEL_COMMIT)
    put_in_hub_cache(hub, "dataset", "org/math", {"d.parquet": prompt_files / "train.parquet"}, commit=DATA_COMMIT)
    calls = tmp_path / "calls"
    results = run_ranks(_fetch_rank, 2, str(calls))  # forked: the offline hub above is theirs too
    assert results == [(str(snapshot), f"org/math@{DATA_COMMIT}")] * 2
    assert sorted(calls.read_text().splitlines()) == [
        "0 org/math False", "0 org/tiny False", "1 org/math True", "1 org/tiny True"
    ]  # fmt: skip
