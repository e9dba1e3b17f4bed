"""The run folder's hf/ export, used from outside the project: transformers' Auto classes alone, in a fresh
process, must see the prompts training saw, generate greedily what the project's engine generates, and
stop at the same token; a checkpoint brought in with --model.hf_path keeps its own tokenizer and generation
settings."""

import json
import os
import subprocess
import sys

import pytest
import torch

import train
from model.hf import load_hf
from model.tokenizer import Tokenizer
from rollout.engine import SamplingParams
from rollout.torch_engine import TorchEngine
from tasks.arithmetic import synthetic_arithmetic_rows
from tests import chat_templates
from tests.engines import generate
from tests.test_tokenizer import CONVERSATIONS, _qwen_style_dir

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
DEMO_SCRATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_scratch.toml")  # no base policy
MAX_NEW = 24

# Run by a separate interpreter, outside the repository: nothing of the project is importable there.
TRANSFORMERS_ONLY = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path, max_new = sys.argv[1], int(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
results = []
for messages in json.load(sys.stdin):
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new)
    prompt = inputs["input_ids"][0].tolist()
    results.append({"prompt": prompt, "new": out[0, len(prompt):].tolist()})
print(json.dumps({"results": results, "eos": model.generation_config.eos_token_id,
                  "config_eos": model.config.eos_token_id, "config_bos": model.config.bos_token_id}))
"""


def _transformers_generate(path, conversations, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    done = subprocess.run(
        [sys.executable, "-c", TRANSFORMERS_ONLY, path, str(MAX_NEW)],
        input=json.dumps(conversations),
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _argv(run_dir, **extra):
    values = {
        "job.run_dir": run_dir,
        "job.name": "run",
        "data.synthetic_num_train": 2000,
        "data.synthetic_num_eval": 8,
        "rollout.n": 2,
        "rollout.max_response_length": MAX_NEW,
        "rollout.max_batch_size": 64,
        "algorithm.overlong_buffer": 4,
        "algorithm.max_num_gen_batches": 1,
        "training.steps": 1,
        "training.train_batch_size": 4,
        "training.mini_batch_size": 4,
        "training.micro_batch_tokens": 256,
        "training.sft_batch_size": 32,
        "eval.at_start": False,
        "eval.at_end": False,
        "eval.interval": 0,
        "checkpoint.enabled": False,
        "metrics.progress": False,
    }
    values.update(extra)
    return ["--config", DEMO_SCRATCH] + [f"--{k}={v}" for k, v in values.items()]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The demo setup trained briefly: a supervised warm-up long enough for the policy to end its answers
    with the stop token, one DAPO step, and the export."""
    run_dir = str(tmp_path_factory.mktemp("runs"))
    assert train.main(_argv(run_dir, **{"training.sft_warmup_steps": 60})) == 0
    return os.path.join(run_dir, "run")


def test_transformers_alone_generates_what_the_engine_generates(demo_run, tmp_path):
    hf_dir = os.path.join(demo_run, "hf")
    tokenizer = Tokenizer.from_dir(os.path.join(demo_run, "tokenizer"))  # the tokenizer training used
    rows = synthetic_arithmetic_rows(6, difficulty=2, split="eval", answer_line_share=0.5)
    conversations = [r["prompt"] for r in rows] + CONVERSATIONS[:3]

    engine = TorchEngine(load_hf(hf_dir), max_batch_size=len(conversations), max_seq_len=256, compile=False)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=tokenizer.stop_ids)
    prompts = [tokenizer.encode_chat(m) for m in conversations]
    ours = generate(engine, prompts, params)

    got = _transformers_generate(hf_dir, conversations, cwd=str(tmp_path))
    for prompt, completion, theirs in zip(prompts, ours, got["results"]):
        assert theirs["prompt"] == prompt
        assert theirs["new"] == completion.token_ids, tokenizer.decode(prompt)
    assert got["eos"] == tokenizer.stop_ids
    assert (got["config_eos"], got["config_bos"]) == (tokenizer.eos_id, tokenizer.bos_id)
    stopped = [c for c in ours if c.finish_reason == "stop"]
    assert len(stopped) >= len(rows) // 2, [c.finish_reason for c in ours]  # the stop behaviour is exercised
    for completion, theirs in zip(ours, got["results"]):
        if completion.finish_reason == "stop":
            assert len(theirs["new"]) < MAX_NEW and theirs["new"][-1] in tokenizer.stop_ids
        else:
            assert len(theirs["new"]) == MAX_NEW


def test_a_checkpoints_own_tokenizer_and_generation_settings_are_carried(tmp_path):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    source = tmp_path / "source"
    _qwen_style_dir(source, chat_templates.QWEN25)
    config = Qwen2Config(
        vocab_size=400,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(str(source))
    # A generation config of the source's own, with settings the export must keep.
    (source / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": [2, 0], "pad_token_id": 0, "repetition_penalty": 1.05}, indent=1)
    )
    generation_config = (source / "generation_config.json").read_bytes()

    argv = _argv(
        str(tmp_path / "runs"),
        **{
            "model.preset": "",
            "model.hf_path": str(source),
            "data.max_prompt_length": 256,
            "training.micro_batch_tokens": 512,
            "training.sft_warmup_steps": 0,
            "rollout.max_response_length": 4,
            "algorithm.overlong_buffer": 1,
        },
    )
    assert train.main(argv) == 0
    export = tmp_path / "runs" / "run" / "hf"
    assert (export / "generation_config.json").read_bytes() == generation_config
    # transformers alone loads the export's tokenizer as the source's: the same ids, the same rendered prompts.
    theirs, exported = AutoTokenizer.from_pretrained(str(source)), AutoTokenizer.from_pretrained(str(export))
    assert exported.get_chat_template() == chat_templates.QWEN25
    assert (exported.eos_token, exported.pad_token, exported.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    for messages in CONVERSATIONS:
        text = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert exported.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
        assert exported.encode(text) == theirs.encode(text)
    exported_config = json.loads((export / "config.json").read_text())
    assert (exported_config["bos_token_id"], exported_config["eos_token_id"]) == (0, 2)
