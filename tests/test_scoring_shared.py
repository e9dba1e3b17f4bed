"""One response-to-text function and one completion check: a completion gets the same reward in training
(trainer/scoring.py score_groups) as in evaluation (evaluation/evaluate.py score_completions)."""

import dataclasses

import pytest
from engines import ByGenerate, generate

from config import Config
from data.prompts import PromptExample
from evaluation.evaluate import score_completions
from model.tokenizer import ENDOFTEXT, IM_END, IM_START, train_bpe_tokenizer
from rl.reward import compute_score, response_text
from rollout.engine import Completion, EngineFailure, SamplingParams
from trainer.scoring import score_groups


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["Adding the numbers gives 42.\nAnswer: 42", "Answer: 7 and 17 and 427", "so the result is 5"] * 20
    return train_bpe_tokenizer(texts, vocab_size=300)


def _ids(tokenizer, *parts):
    """Token ids of text pieces and special tokens (written as their names)."""
    ids = []
    for part in parts:
        special = tokenizer.token_to_id(part) if part in (ENDOFTEXT, IM_START, IM_END) else None
        ids += [special] if special is not None else tokenizer.encode(part)
    return ids


def test_response_text_skips_special_tokens_and_a_final_stop_id(tokenizer):
    im_end, seven = tokenizer.token_to_id(IM_END), tokenizer.encode("7")[-1]
    assert response_text(tokenizer, _ids(tokenizer, "Answer: 42", IM_END), tokenizer.stop_ids) == "Answer: 42"
    assert response_text(tokenizer, _ids(tokenizer, "Answer: 4", IM_START, "2", IM_END)) == "Answer: 42"
    assert response_text(tokenizer, _ids(tokenizer, "Answer: 42", ENDOFTEXT)) == "Answer: 42"
    # A stop id that is an ordinary token ends the response without becoming part of the answer.
    assert response_text(tokenizer, _ids(tokenizer, "Answer: 42", "7"), {seven, im_end}) == "Answer: 42"
    assert response_text(tokenizer, _ids(tokenizer, "Answer: 42", "7"), {im_end}) == "Answer: 427"
    assert response_text(tokenizer, [], tokenizer.stop_ids) == ""


def test_the_same_completions_score_the_same_in_training_and_in_evaluation(tokenizer):
    stop_ids = set(tokenizer.stop_ids)
    responses = [  # (pieces, finish reason, expected accuracy)
        (("Adding the numbers gives 42.\nAnswer: 42", IM_END), "stop", True),
        (("Answer: 4", IM_START, "2", IM_END), "stop", True),  # a special token inside the answer
        (("Answer: 42", ENDOFTEXT), "stop", True),  # the other stop id
        (("Answer: 42", IM_END, "7"), "length", False),  # truncated after a special token: the answer is 427
        (("Adding the numbers gives 42.\nAnswer: 4",), "length", False),  # truncated inside the answer
        (("so the result is 5", IM_END), "stop", False),
    ]
    example = PromptExample(prompt_ids=[5, 6], ground_truth="42", data_source="test", messages=[])
    completions = [
        Completion(0, i, _ids(tokenizer, *pieces), [-0.5] * len(_ids(tokenizer, *pieces)), finish)
        for i, (pieces, finish, _) in enumerate(responses)
    ]
    n = len(responses)
    cfg = Config()
    cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, overlong_penalty=False))
    trained = score_groups([example], completions, tokenizer, cfg)[0].payload
    evaluated = score_completions([example], completions, tokenizer, n, stop_ids=tuple(stop_ids))[0]
    expected = [acc for _, _, acc in responses]
    assert [s.acc for s in trained] == evaluated.acc == expected
    assert [s.pred for s in trained] == evaluated.pred
    assert [s.score for s in trained] == [1.0 if acc else -1.0 for acc in expected]
    assert evaluated.pred[3] == "427" and evaluated.truncated == [False, False, False, True, True, False]
    # Both read response_text: the reward of each completion is compute_score of that text.
    for sample, completion in zip(trained, completions):
        text = response_text(tokenizer, completion.token_ids, stop_ids)
        assert sample.pred == compute_score(text, "42")["pred"]


def test_one_completion_check_for_training_and_evaluation():
    """What the engine returned is checked once, by the generate both training and evaluation call (run/guard.py):
    n completions per prompt, none aborted, grouped by prompt."""
    ok = [Completion(0, 0, [3], [0.0], "stop"), Completion(0, 1, [3], [0.0], "stop")]
    bad = {
        "returned 1 completions for 1 prompts x 2 samples": ok[:1],
        "aborted 1 of 2 requests": [ok[0], Completion(0, 1, [], [], "abort")],
        "not grouped by prompt": [ok[0], Completion(1, 1, [3], [0.0], "stop")],
    }

    class Returns(ByGenerate):
        def generate(self, prompts, params):
            return list(self.completions)

    for message, completions in bad.items():
        engine = Returns()
        engine.completions = completions
        with pytest.raises(EngineFailure, match=message):
            generate(engine, [[5, 6]], SamplingParams(max_new_tokens=2, n=2))
