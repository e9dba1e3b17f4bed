import pytest

from model.args import PRESETS, PUBLISHED_SIZES, ModelArgs, get_preset, num_params
from model.qwen2 import build_model


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
    assert all(p.rope_theta == 1e6 for p in PRESETS.values())


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
