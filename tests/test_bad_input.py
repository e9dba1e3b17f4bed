"""Bad input to train.py and eval.py ends with one line naming the file and the problem and exit code 2, alike in
both commands: a damaged Hugging Face checkpoint (built with transformers' save_pretrained, then damaged), a
TOML file or a parquet string that is not UTF-8, a directory given as a data file. A bug is not bad input: it
keeps its traceback."""

import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import eval as eval_command
import train
from data.prompts import DataError, read_parquet_rows
from errors import CheckpointError
from model.tokenizer import IM_END, render_chat, train_bpe_tokenizer
from tasks.arithmetic import synthetic_arithmetic_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The demo recipe shrunk to one tiny step with no evaluation and no warm-up (nothing here gets that far).
SMALL = [
    "--training.steps=1",
    "--training.train_batch_size=2",
    "--training.mini_batch_size=2",
    "--training.sft_warmup_steps=0",
    "--rollout.n=2",
    "--data.max_prompt_length=256",
    "--data.synthetic_num_train=16",
    "--rollout.max_response_length=8",
    "--eval.max_response_length=8",
    "--algorithm.overlong_buffer=4",
    "--training.micro_batch_tokens=512",
    "--algorithm.dynamic_sampling=false",
    "--eval.interval=0",
    "--eval.at_start=false",
    "--eval.at_end=false",
    "--data.eval_path=",
    "--metrics.progress=false",
]


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny Qwen2 checkpoint written by transformers itself, with a tokenizer for its vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("hf") / "good"
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(str(folder))
    rows = synthetic_arithmetic_rows(40, split="train", seed=0)
    texts = [render_chat(r["prompt"]) + r["extra_info"]["solution"] + IM_END for r in rows]
    train_bpe_tokenizer(texts, 512).save(str(folder))
    return folder


def _edit_config(folder, change):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def _misshape(folder):
    from safetensors.torch import load_file, save_file

    path = str(folder / "model.safetensors")
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:32].clone()
    save_file(tensors, path, metadata={"format": "pt"})


def _nan_in_a_weight(folder):
    from safetensors.torch import load_file, save_file

    path = str(folder / "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.1.mlp.down_proj.weight"][-1, 5] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})


def _truncate(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _write_checksums(folder):
    import hashlib

    files = sorted(p for p in os.listdir(folder) if p != "SHA256SUMS")
    lines = [f"{hashlib.sha256((folder / p).read_bytes()).hexdigest()}  {p}\n" for p in files]
    (folder / "SHA256SUMS").write_text("".join(lines))


def _changed_under_its_checksums(folder):
    _write_checksums(folder)
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # one bit of the last weight: still a readable file of finite weights
    path.write_bytes(bytes(data))


def _listed_but_missing(folder):
    _write_checksums(folder)
    (folder / "generation_config.json").unlink()


def _weights_swapped_by_an_added_index(folder):
    """Beside the listed files, an index that maps every tensor to an added file: the loader reads the index."""
    from safetensors import safe_open

    _write_checksums(folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    (folder / "other.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(names, "other.safetensors")})
    )


def _template_added_after_its_checksums(folder):
    template = folder / "chat_template.jinja"  # transformers renders prompts with it
    text = template.read_text()
    template.unlink()
    _write_checksums(folder)
    template.write_text(text.replace("<|im_start|>", "<|im_start|> "))


def _checksums_replaced(make):
    def damage(folder):
        (folder / "SHA256SUMS").unlink(missing_ok=True)
        make(folder / "SHA256SUMS")

    return damage


# kind: (damage, the message after "checkpoint error: ", where {ckpt} is the damaged folder)
DAMAGE = {
    "no-hidden-size": (
        lambda f: _edit_config(f, lambda c: c.pop("hidden_size")),
        "{ckpt}/config.json lacks required keys: hidden_size",
    ),
    "size-as-text": (
        lambda f: _edit_config(f, lambda c: c.update(hidden_size="64")),
        "{ckpt}/config.json has hidden_size = '64'; it must be a positive integer",
    ),
    "invalid-json": (
        lambda f: (f / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 64,'),
        "{ckpt}/config.json is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 43",
    ),
    "other-model-type": (
        lambda f: _edit_config(f, lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"])),
        "{ckpt}/config.json has model_type 'llama'; expected 'qwen2'",
    ),
    "truncated-safetensors": (
        _truncate,
        "{ckpt}/model.safetensors is not a readable safetensors file (Error while deserializing header: "
        "incomplete metadata, file not fully covered): it is damaged or was not copied whole",
    ),
    "truncated-tokenizer": (
        lambda f: (f / "tokenizer.json").write_bytes((f / "tokenizer.json").read_bytes()[:100]),
        "{ckpt}/tokenizer.json is not a readable tokenizer (",
    ),
    "nan-in-a-weight": (
        _nan_in_a_weight,
        "{ckpt}/model.safetensors holds NaN or inf in model.layers.1.mlp.down_proj.weight: a policy with "
        "non-finite weights can be neither trained nor evaluated",
    ),
    "changed-under-its-checksums": (
        _changed_under_its_checksums,
        "{ckpt}/model.safetensors does not match its SHA-256 in {ckpt}/SHA256SUMS (",
    ),
    "listed-in-checksums-but-missing": (
        _listed_but_missing,
        "{ckpt}/generation_config.json is listed in {ckpt}/SHA256SUMS but missing",
    ),
    "unlisted-weight-index": (
        _weights_swapped_by_an_added_index,
        "{ckpt}/model.safetensors.index.json is not listed in {ckpt}/SHA256SUMS, so it would be loaded unchecked: "
        "remove it, or (if it belongs to the checkpoint) write the list again: `cd {ckpt} && sha256sum "
        "chat_template.jinja config.json generation_config.json model.safetensors model.safetensors.index.json "
        "other.safetensors tokenizer.json tokenizer_config.json > SHA256SUMS`",
    ),
    "unlisted-chat-template": (
        _template_added_after_its_checksums,
        "{ckpt}/chat_template.jinja is not listed in {ckpt}/SHA256SUMS",
    ),
    "empty-checksums": (_checksums_replaced(lambda p: p.write_text("\n")), "{ckpt}/SHA256SUMS lists no file: "),
    "checksums-a-folder": (_checksums_replaced(lambda p: p.mkdir()), "cannot read {ckpt}/SHA256SUMS: Is a directory"),
    "checksums-a-dangling-link": (
        _checksums_replaced(lambda p: p.symlink_to("SUMS")),
        "cannot read {ckpt}/SHA256SUMS: is a symbolic link to SUMS, which does not exist",
    ),
    "checksums-not-utf8": (
        _checksums_replaced(lambda p: p.write_bytes(b"\xff\xfe" + "0".encode("utf-16-le") * 64)),
        "{ckpt}/SHA256SUMS is not UTF-8 text (byte 0): write the list again",
    ),
    "misshaped-tensor": (
        _misshape,
        "checkpoint {ckpt} does not match the model: wrong shapes (1): model.norm.weight is (32,) but the "
        "model needs (64,)",
    ),
}


def _damaged(hf_checkpoint, tmp_path, kind):
    import shutil

    folder = tmp_path / kind
    shutil.copytree(hf_checkpoint, folder)
    damage, message = DAMAGE[kind]
    damage(folder)
    return folder, message.format(ckpt=folder)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_the_undamaged_checkpoint_is_accepted(hf_checkpoint, tmp_path):
    import shutil

    from model.hf import check_checksums, load_hf

    assert load_hf(str(hf_checkpoint)).args.hidden_size == 64  # the damage below is what each test refuses
    listed = tmp_path / "listed"
    shutil.copytree(hf_checkpoint, listed)
    _write_checksums(listed)
    check_checksums(str(listed))  # its own SHA256SUMS: accepted


@pytest.mark.parametrize("line", ["not a checksum line", "0" * 64 + "  ../model.safetensors", "0" * 63 + "  x"])
def test_a_checksums_file_that_does_not_read_as_sha256sum_output_is_one_named_error(hf_checkpoint, tmp_path, line):
    import shutil

    from model.hf import check_checksums

    folder = tmp_path / "odd"
    shutil.copytree(hf_checkpoint, folder)
    (folder / "SHA256SUMS").write_text(line + "\n")
    with pytest.raises(CheckpointError, match=r"SHA256SUMS, line 1, is not '<sha256>  <file name>' of a file"):
        check_checksums(str(folder))


@pytest.mark.parametrize("kind", DAMAGE)
def test_train_refuses_a_damaged_hf_checkpoint_in_one_line(kind, hf_checkpoint, tmp_path, capsys):
    folder, message = _damaged(hf_checkpoint, tmp_path, kind)
    argv = ["--config", "configs/demo_cpu.toml", "--model.preset=", f"--model.hf_path={folder}"]
    with pytest.raises(SystemExit) as info:
        train.run_cli([*argv, f"--job.run_dir={tmp_path / 'runs'}", *SMALL])
    assert info.value.code == 2
    assert _one_line(capsys).startswith(f"checkpoint error: {message}")
    assert not (tmp_path / "runs").exists()  # the run folder this refused launch made is gone, its parent too


@pytest.mark.parametrize("kind", DAMAGE)
def test_eval_refuses_a_damaged_hf_checkpoint_in_one_line(kind, hf_checkpoint, tmp_path, capsys):
    folder, message = _damaged(hf_checkpoint, tmp_path, kind)
    argv = ["--model", str(folder), "--data", "synthetic", "--data.synthetic_num_eval=2", "--metrics.progress=false"]
    with pytest.raises(SystemExit) as info:
        eval_command.run_cli(argv)
    assert info.value.code == 2
    assert _one_line(capsys).startswith(f"eval.py: checkpoint error: {message}")


def _run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_scripts_print_no_traceback_for_a_truncated_checkpoint(hf_checkpoint, tmp_path):
    folder, message = _damaged(hf_checkpoint, tmp_path, "truncated-safetensors")
    proc = _run(
        "train.py", "--config", "configs/demo_cpu.toml", "--model.preset=", f"--model.hf_path={folder}",
        f"--job.run_dir={tmp_path / 'runs'}", *SMALL,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"checkpoint error: {message}")
    proc = _run("eval.py", "--model", str(folder), "--data", "synthetic", "--metrics.progress=false")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"eval.py: checkpoint error: {message}")


def test_a_separate_tokenizer_folder_is_checked_whole_as_the_checkpoint_is(hf_checkpoint, tmp_path, capsys):
    import shutil

    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(hf_checkpoint, tokenizer, ignore=shutil.ignore_patterns("*.safetensors", "*config.json"))
    _write_checksums(tokenizer)
    swapped = json.loads((tokenizer / "tokenizer.json").read_text())
    vocab = swapped["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]  # two token ids swapped: a valid tokenizer, another model's
    (tokenizer / "tokenizer.json").write_text(json.dumps(swapped))
    message = f"checkpoint error: {tokenizer}/tokenizer.json does not match its SHA-256 in {tokenizer}/SHA256SUMS ("
    argv = ["--config", "configs/demo_cpu.toml", "--model.preset=", f"--model.hf_path={hf_checkpoint}"]
    with pytest.raises(SystemExit) as info:
        train.run_cli([*argv, f"--model.tokenizer_path={tokenizer}", f"--job.run_dir={tmp_path / 'runs'}", *SMALL])
    assert info.value.code == 2 and _one_line(capsys).startswith(message)
    with pytest.raises(SystemExit) as info:
        eval_command.run_cli(["--model", str(hf_checkpoint), "--tokenizer", str(tokenizer), "--data", "synthetic"])
    assert info.value.code == 2 and _one_line(capsys).startswith(f"eval.py: {message}")


def _reading_as_the_mode_bits_say():
    """Before exec in a child: root without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (dropped from the bounding
    set, as `setpriv --bounding-set=-dac_override,-dac_read_search` does) reads only what the mode bits let the
    owner read, so a mode-000 file is unreadable to it as to any user."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.parametrize(
    "unreadable, listed", [("SHA256SUMS", True), ("tokenizer.json", True), ("model.safetensors", False)]
)
def test_a_file_the_user_may_not_read_is_one_line(hf_checkpoint, tmp_path, unreadable, listed):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint, folder)
    if listed:
        _write_checksums(folder)
    os.chmod(folder / unreadable, 0)
    argv = ["train.py", "--config", "configs/demo_cpu.toml", "--model.preset=", f"--model.hf_path={folder}"]
    try:
        proc = subprocess.run(
            [sys.executable, *argv, f"--job.run_dir={tmp_path / 'runs'}", *SMALL],
            cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
            preexec_fn=_reading_as_the_mode_bits_say if os.geteuid() == 0 else None,
        )  # fmt: skip
    except subprocess.SubprocessError as exc:
        pytest.skip(f"root cannot give up its right to read every file here ({exc})")
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"checkpoint error: cannot read {folder}/{unreadable}: Permission denied"
            + (f"; write the list again: `cd {folder} && sha256sum" if unreadable == "SHA256SUMS" else "")
        )
    )


def test_a_tokenizer_folder_without_tokenizer_json_is_one_line_in_both_commands(hf_checkpoint, tmp_path, capsys):
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    argv = ["--config", "configs/demo_cpu.toml", "--model.preset=", f"--model.hf_path={hf_checkpoint}"]
    with pytest.raises(SystemExit) as info:
        train.run_cli([*argv, f"--model.tokenizer_path={empty}", f"--job.run_dir={tmp_path / 'runs'}", *SMALL])
    assert info.value.code == 2 and _one_line(capsys) == (
        f"configuration error: model.tokenizer_path = '{empty}' holds no tokenizer.json: set model.tokenizer_path "
        "to the folder that holds the checkpoint's tokenizer"
    )
    with pytest.raises(SystemExit) as info:
        eval_command.run_cli(["--model", str(hf_checkpoint), "--tokenizer", str(empty), "--data", "synthetic"])
    assert info.value.code == 2 and _one_line(capsys) == (
        f"eval.py: configuration error: --tokenizer {empty}: no tokenizer.json there; pass the folder that holds it"
    )


# ------------------------------------------------------------------------------------------ sizes no machine holds


def _run_limited(*args):
    """`_run` with 4 GB of address space: a size that is not refused fails fast instead of filling the machine."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, preexec_fn=limit
    )


# 1e12 sequences (or blocks of 16) x 512 bytes a token (k and v of 2 layers x 2 KV heads x 16 in float32); a train
# sequence holds 256 + 8 tokens (17 blocks), an eval.py one 64 + 8 (5 blocks). 1e12 samples x 4 problems x 12 bytes
# x 264 (train) or 72 (eval.py) tokens.
ENGINE = "the torch engine's KV cache cannot fit this machine: "
SAMPLES = "an evaluation's samples cannot fit this machine: eval.k = 1,000,000,000,000 samples of each of "
TOO_LARGE = {
    "max_batch_size": (
        "--rollout.max_batch_size=1000000000000",
        ENGINE + "rollout.max_batch_size = 1,000,000,000,000 sequences of up to 264 tokens take 139,264,000.0 GB",
        ENGINE + "rollout.max_batch_size = 1,000,000,000,000 sequences of up to 72 tokens take 40,960,000.0 GB",
    ),
    "kv_cache_blocks": pytest.param(
        "--rollout.kv_cache_blocks=1000000000000",
        ENGINE + "rollout.kv_cache_blocks = 1,000,000,000,000 blocks of 16 positions take 8,192,000.0 GB",
        ENGINE + "rollout.kv_cache_blocks = 1,000,000,000,000 blocks of 16 positions take 8,192,000.0 GB",
        marks=pytest.mark.slow,
    ),
    "eval.k": (
        "--eval.k=1000000000000",
        SAMPLES + "4 problems held at once, of up to 264 tokens, take at least 12,672,000.0 GB on this node",
        SAMPLES + "1 problem held at once, of up to 72 tokens, take at least 864,000.0 GB on this node",
    ),
}


@pytest.mark.parametrize("flag, train_line, eval_line", TOO_LARGE.values(), ids=TOO_LARGE)
def test_a_size_no_machine_holds_is_refused_in_one_line_before_any_work(
    flag, train_line, eval_line, hf_checkpoint, tmp_path
):
    evaluation = ["--data.eval_path=synthetic", "--data.synthetic_num_eval=4", "--eval.at_end=true"]
    proc = _run_limited(
        "train.py", "--config", "configs/demo_cpu.toml", "--model.preset=", f"--model.hf_path={hf_checkpoint}",
        f"--job.run_dir={tmp_path / 'runs'}", *SMALL, *evaluation, "--training.sft_warmup_steps=10", flag,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"configuration error: {train_line}")
    assert re.search(r"more than (its|the) [\d,]+\.\d GB of (this node's )?memory", proc.stderr), proc.stderr
    assert not (tmp_path / "runs").exists()  # before the run folder, the warm-up, anything
    proc = _run_limited(
        "eval.py", "--model", str(hf_checkpoint), "--data", "synthetic", "--data.synthetic_num_eval=4",
        "--eval.max_response_length=8", "--metrics.progress=false", flag,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"eval.py: configuration error: {eval_line}")


# ------------------------------------------------------------------------------------------ bugs keep tracebacks


def test_a_value_error_from_a_bug_keeps_its_traceback_in_both_commands(hf_checkpoint, tmp_path, monkeypatch):
    def bug(*args, **kwargs):
        raise ValueError("a bug, not bad input")

    monkeypatch.setattr(eval_command, "load_eval_set", bug)
    with pytest.raises(ValueError, match="a bug, not bad input"):  # propagates: exit 1 with its traceback
        eval_command.run_cli(["--model", str(hf_checkpoint), "--data", "synthetic", "--metrics.progress=false"])
    monkeypatch.setattr(train, "build", bug)
    argv = ["--config", "configs/demo_cpu.toml", "--model.preset=", f"--model.hf_path={hf_checkpoint}"]
    with pytest.raises(ValueError, match="a bug, not bad input"):
        train.run_cli([*argv, f"--job.run_dir={tmp_path / 'runs'}", *SMALL])


# ------------------------------------------------------------------------------------------ text that is not UTF-8


def test_a_toml_file_that_is_not_utf8_is_one_line_naming_file_and_line(tmp_path, capsys):
    path = tmp_path / "latin1.toml"
    path.write_bytes(
        b'base = "%s"\n[job]\n# caf\xe9\nname = "x"\n' % os.path.join(ROOT, "configs/demo_cpu.toml").encode()
    )
    expected = f"configuration error: {path}: not UTF-8 text (byte 0xe9 at line 3): save the file as UTF-8"
    with pytest.raises(SystemExit) as info:
        train.run_cli(["--config", str(path), "--dry-run"])
    assert info.value.code == 2 and _one_line(capsys) == expected
    with pytest.raises(SystemExit) as info:
        eval_command.run_cli(["--config", str(path), "--model", "x"])
    assert info.value.code == 2 and _one_line(capsys) == f"eval.py: {expected}"


def test_a_toml_file_with_a_utf8_byte_order_mark_reads_as_the_same_file_without_it(tmp_path):
    from config import load_config

    demo = os.path.join(ROOT, "configs/demo_cpu.toml")
    text = f'base = "{demo}"\n[job]\nname = "caf\u00e9"\n'
    (tmp_path / "plain.toml").write_text(text, encoding="utf-8")
    (tmp_path / "bom.toml").write_text(text, encoding="utf-8-sig")  # as Windows editors save UTF-8
    assert (tmp_path / "bom.toml").read_bytes().startswith(b"\xef\xbb\xbf")
    assert load_config(str(tmp_path / "bom.toml")) == load_config(str(tmp_path / "plain.toml"))
    assert load_config(str(tmp_path / "bom.toml")).job.name == "caf\u00e9"


def test_a_symbolic_link_loop_or_a_dangling_link_is_named_as_such(tmp_path, hf_checkpoint, capsys):
    loop, dangling = tmp_path / "loop", tmp_path / "dangling.parquet"
    loop.symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(loop)
    dangling.symlink_to(tmp_path / "moved-away.parquet")
    bases = tmp_path / "with-base.toml"
    bases.write_text('base = "loop"\n')
    model = ["--model.preset=", f"--model.hf_path={hf_checkpoint}", f"--job.run_dir={tmp_path / 'runs'}", *SMALL]
    refused = {
        ("--config", str(loop), "--dry-run"): f"configuration error: config file {loop} is a symbolic link loop",
        ("--config", str(bases), "--dry-run"): (
            f"configuration error: {bases}: base file 'loop' is a symbolic link loop (looked for {loop})"
        ),
        (*model, f"--data.train_path={loop}"): (
            f"configuration error: data.train_path = '{loop}' is a symbolic link loop: set data.train_path to a "
            "parquet file in the DAPO-Math-17k schema, or to 'synthetic'"
        ),
        (*model, f"--data.train_path={dangling}"): (
            f"configuration error: data.train_path = '{dangling}' is a symbolic link to {tmp_path}/moved-away.parquet, "
            "which does not exist: set data.train_path to a parquet file in the DAPO-Math-17k schema, or to 'synthetic'"
        ),
        (*model, f"--model.hf_path={loop}"): (
            f"configuration error: model.hf_path = '{loop}' is a symbolic link loop: set model.hf_path to a Qwen2.5 "
            "checkpoint directory"
        ),
        (*model, f"--model.tokenizer_path={loop}"): (
            f"configuration error: model.tokenizer_path = '{loop}' is a symbolic link loop: set it to the folder "
            "holding tokenizer.json, or leave it empty"
        ),
    }
    for argv, line in refused.items():
        with pytest.raises(SystemExit) as info:
            train.run_cli(list(argv))
        assert info.value.code == 2 and _one_line(capsys) == line
    checkpoint = ("--model", str(hf_checkpoint))
    refused = {
        ("--config", str(loop), *checkpoint): f"configuration error: config file {loop} is a symbolic link loop",
        ("--model", str(loop)): f"configuration error: --model {loop} is a symbolic link loop; pass an HF "
        "checkpoint directory or a run folder",
        (*checkpoint, "--data", str(loop)): f"data error: data file {loop} is a symbolic link loop",
    }
    for argv, line in refused.items():
        with pytest.raises(SystemExit) as info:
            eval_command.run_cli(list(argv))
        assert info.value.code == 2 and _one_line(capsys) == f"eval.py: {line}"
    assert not (tmp_path / "runs").exists()


def _prompt_file_with_undecodable_content(path, rows: int, bad_row: int):
    """A DAPO-schema parquet file whose prompt content in `bad_row` holds Latin-1 bytes in a string column."""
    contents = [f"What is {i} + 1?".encode() for i in range(rows)]
    contents[bad_row] = "Caf\u00e9 au lait: 3 + 1?".encode("latin-1")
    content = pa.array(contents, pa.binary()).view(pa.string())  # a string column, its bytes unchecked
    messages = pa.StructArray.from_arrays([pa.array(["user"] * rows), content], names=["role", "content"])
    prompt = pa.ListArray.from_arrays(pa.array(range(rows + 1), pa.int32()), messages)
    reward_model = pa.array([{"style": "rule", "ground_truth": str(i + 1)} for i in range(rows)])
    pq.write_table(pa.table({"data_source": ["s"] * rows, "prompt": prompt, "reward_model": reward_model}), str(path))


def test_a_parquet_string_that_is_not_utf8_names_the_file_column_and_row(tmp_path):
    path = tmp_path / "latin1.parquet"
    _prompt_file_with_undecodable_content(path, rows=1000, bad_row=637)
    with pytest.raises(DataError) as info:
        read_parquet_rows(str(path))
    assert str(info.value) == (
        f"{path}: column 'prompt', row 637 holds a string that is not UTF-8 (invalid continuation byte): parquet "
        "strings are UTF-8; write the file again with its text encoded as UTF-8"
    )


def test_both_commands_refuse_a_parquet_string_that_is_not_utf8_in_one_line(hf_checkpoint, tmp_path, capsys):
    path = tmp_path / "latin1.parquet"
    _prompt_file_with_undecodable_content(path, rows=4, bad_row=2)
    expected = f"data error: {path}: column 'prompt', row 2 holds a string that is not UTF-8"
    argv = ["--config", "configs/demo_cpu.toml", "--model.preset=", f"--model.hf_path={hf_checkpoint}"]
    with pytest.raises(SystemExit) as info:
        train.run_cli([*argv, f"--job.run_dir={tmp_path / 'runs'}", *SMALL, f"--data.train_path={path}"])
    assert info.value.code == 2 and _one_line(capsys).startswith(expected)
    with pytest.raises(SystemExit) as info:
        eval_command.run_cli(["--model", str(hf_checkpoint), "--data", str(path), "--metrics.progress=false"])
    assert info.value.code == 2 and _one_line(capsys).startswith(f"eval.py: {expected}")


# ------------------------------------------------------------------------------------------ a directory as a file


def test_a_directory_given_as_a_data_file_is_named_as_a_directory(hf_checkpoint, tmp_path, capsys):
    folder = tmp_path / "dapo-math-17k"
    folder.mkdir()
    argv = ["--config", "configs/demo_cpu.toml", "--model.preset=", f"--model.hf_path={hf_checkpoint}"]
    with pytest.raises(SystemExit) as info:
        train.run_cli([*argv, f"--job.run_dir={tmp_path / 'runs'}", *SMALL, f"--data.train_path={folder}"])
    assert info.value.code == 2 and _one_line(capsys) == (
        f"configuration error: data.train_path = '{folder}' is a directory, not a file: set data.train_path to a "
        "parquet file in the DAPO-Math-17k schema, or to 'synthetic'"
    )
    with pytest.raises(SystemExit) as info:
        eval_command.run_cli(["--model", str(hf_checkpoint), "--data", str(folder), "--metrics.progress=false"])
    assert info.value.code == 2 and _one_line(capsys) == (
        f"eval.py: data error: {folder} is a directory; a prompt set is one parquet file in the DAPO-Math-17k schema"
    )
