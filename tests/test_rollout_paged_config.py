"""The torch engine's paged KV memory comes from the config (rollout.block_size, rollout.kv_cache_blocks)."""

import pytest

from config import Config, ConfigError, validate
from model.args import PRESETS
from model.qwen2 import build_model
from rollout.engine_spec import EngineSpec
from tests.dist_utils import OneProcess


def _cfg(**rollout):
    cfg = Config()
    cfg.rollout.max_response_length = 40
    cfg.algorithm.overlong_buffer = 8
    cfg.data.max_prompt_length = 24
    cfg.training.micro_batch_tokens = 64
    cfg.rollout.max_batch_size = 4
    cfg.rollout.dtype = "float32"
    cfg.rollout.compile = False
    for key, value in rollout.items():
        setattr(cfg.rollout, key, value)
    return cfg


def test_engine_takes_its_block_budget_from_the_config():
    policy = build_model(PRESETS["tiny"], seed=0)
    engine = EngineSpec.from_config(_cfg(block_size=8, kv_cache_blocks=20)).start_beside(policy, OneProcess())
    assert (engine.block_size, engine.kv_cache_blocks) == (8, 20)
    assert engine._cache.k[0].shape[1:3] == (21, 8)  # 20 blocks + the scratch block, 8 positions each
    auto = EngineSpec.from_config(_cfg(block_size=8)).start_beside(policy, OneProcess())
    assert auto.kv_cache_blocks == 4 * 8  # max_batch_size full-length (64-token) sequences


def test_a_block_budget_below_one_full_sequence_is_refused():
    validate(_cfg(block_size=8, kv_cache_blocks=8))
    with pytest.raises(
        ConfigError,
        match=r"rollout\.kv_cache_blocks = 7: must be 0 \(auto\) or hold one full-length "
        r"sequence: >= 8 blocks of rollout\.block_size = 8",
    ):
        validate(_cfg(block_size=8, kv_cache_blocks=7))
    with pytest.raises(ConfigError, match=r"rollout\.block_size = 0: must be >= 1"):
        validate(_cfg(block_size=0))
