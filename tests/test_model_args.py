import pytest

from model.args import PRESETS, ModelArgs, get_preset, num_params
from model.qwen2 import build_model

# Published total sizes (Qwen2.5 model cards), used to check the presets.
PUBLISHED_SIZES = {
    "qwen2.5-0.5b": 0.49e9,
    "qwen2.5-1.5b": 1.54e9,
    "qwen2.5-3b": 3.09e9,
    "qwen2.5-7b": 7.62e9,
    "qwen2.5-14b": 14.7e9,
    "qwen2.5-32b": 32.5e9,
    "qwen2.5-72b": 72.7e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_SIZES))
def test_preset_parameter_counts_match_published_sizes(name):
    count = num_params(PRESETS[name])
    assert abs(count / PUBLISHED_SIZES[name] - 1) <= 0.02, (name, count)


@pytest.mark.parametrize("name", ["tiny", "tiny-tied", "demo"])
def test_num_params_equals_module_parameter_count(name):
    model = build_model(get_preset(name), seed=0)
    assert num_params(model.args) == sum(p.numel() for p in model.parameters())


def test_official_values_that_differ_between_sizes():
    assert PRESETS["qwen2.5-0.5b"].tie_word_embeddings and not PRESETS["qwen2.5-7b"].tie_word_embeddings
    assert PRESETS["qwen2.5-3b"].vocab_size == 151936 and PRESETS["qwen2.5-32b"].vocab_size == 152064
    assert PRESETS["qwen2.5-32b"].rms_norm_eps == 1e-5 and PRESETS["qwen2.5-7b"].rms_norm_eps == 1e-6
    assert all(p.rope_theta == 1e6 for name, p in PRESETS.items() if not name.startswith("qwen2.5-math-"))
    # Qwen/Qwen2.5-Math-1.5B's and -7B's config.json: the base shapes with RoPE base 10,000 and 4,096 positions.
    for size in ("1.5b", "7b"):
        math = PRESETS[f"qwen2.5-{size}"].replace(rope_theta=10000.0, max_position_embeddings=4096)
        assert PRESETS[f"qwen2.5-math-{size}"] == math


def test_bad_args_are_refused_by_name():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelArgs(num_heads=14, num_kv_heads=3)
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        get_preset("nope")


def test_tied_model_has_no_separate_head_parameter():
    model = build_model(get_preset("tiny-tied"), seed=0)
    assert model.lm_head is None
    assert model.output_weight() is model.embed_tokens.weight
    assert not any(name.startswith("lm_head") for name, _ in model.named_parameters())


def test_training_flops_count_every_matmul_of_the_model():
    import torch

    from model.args import training_flops
    from model.qwen2 import build_model

    args = PRESETS["tiny"]
    model = build_model(args, seed=0)
    block_weights = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, torch.nn.Linear))
    docs, head = [[5, 3], [7]], 6
    keys = 5 * 6 // 2 + 3 * 4 // 2 + 7 * 8 // 2  # causal keys per document: n (n + 1) / 2
    expected = (
        6 * block_weights * 15
        + 6 * args.vocab_size * args.hidden_size * head
        + 2 * 3 * 2 * args.num_layers * args.hidden_size * keys
    )  # q.k and p.v, forward + backward
    assert training_flops(args, docs, head_tokens=head) == expected
    assert training_flops(args, docs) == expected + 6 * args.vocab_size * args.hidden_size * (15 - head)


def test_training_mfu_uses_the_configured_peak_and_all_devices():
    import types

    import torch

    from config import Config
    from data.prompts import PromptExample
    from model.args import training_flops
    from trainer.scoring import Sample
    from trainer.step_metrics import training_mfu

    cfg = Config()
    cfg.training.ppo_epochs = 2
    example = PromptExample(prompt_ids=[1, 2, 3], ground_truth="1", data_source="x", messages=[])
    groups = [types.SimpleNamespace(payload=[Sample(example, [4, 5], [0.0, 0.0], "stop", True, 1.0, None)] * 2)]
    dist_env = types.SimpleNamespace(device=torch.device("cpu"), world_size=4, all_reduce=lambda v: [2 * v[0]])
    no_peak = training_mfu(
        PRESETS["tiny"], groups, 2.0, dist_env, ppo_epochs=cfg.training.ppo_epochs, metrics=cfg.metrics
    )
    assert no_peak is None  # CPU: no known peak
    cfg.metrics.peak_tflops = 0.5
    flops = training_flops(PRESETS["tiny"], [[5, 5]], head_tokens=4) * (2 + 1 / 3) * 2  # two dp ranks
    mfu = training_mfu(PRESETS["tiny"], groups, 2.0, dist_env, ppo_epochs=cfg.training.ppo_epochs, metrics=cfg.metrics)
    assert mfu is not None and abs(mfu - flops / (2.0 * 4 * 0.5e12)) < 1e-15
