"""At a fixed KV memory budget, on an RL-like workload (n samples per prompt, long-tailed lengths ending at
a stop token), the paged cache keeps at least 4x as many sequences in flight as the fixed-slot cache."""

from bench.paged_capacity import capacity


def test_paged_cache_holds_4x_the_sequences_of_fixed_slots_at_equal_bytes():
    r = capacity(
        preset="tiny",
        prompts=16,
        samples=8,
        max_new_tokens=232,
        slots=4,
        block_size=16,
        stop_tokens=8,
        min_prompt=8,
        max_prompt=24,
    )
    fixed, paged = r["runs"]["fixed-slot"], r["runs"]["paged"]
    print(r)
    assert r["paged_blocks"] * r["block_size"] + r["block_size"] <= r["fixed_slots"] * r["max_seq_len"]
    assert fixed["in_flight_peak"] == 4 and fixed["in_flight_mean_saturated"] == 4.0
    assert paged["in_flight_mean_saturated"] >= 4 * fixed["in_flight_mean_saturated"]
    assert paged["in_flight_peak"] >= 4 * fixed["in_flight_peak"]
    assert paged["decode_steps"] * 2 < fixed["decode_steps"]  # more in flight: the same work in fewer steps
    lengths = paged["response_lengths"]  # long-tailed: most end early, some run long, all at a stop token
    assert paged["stopped"] == 128 and lengths[len(lengths) // 2] * 3 < lengths[-1]
