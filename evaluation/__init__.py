"""Evaluation: k samples per problem, scored as training scores them, reported as avg@k / pass@k / maj@k.

One library for both entry points: train.py evaluates its engine's current weights every `eval.interval`
steps (held_out.py: each data-parallel rank on its share of the problems, merged over the gloo control
group), and eval.py evaluates a checkpoint (evaluate.py). report.py turns the results into a table, flat
metrics and a JSON file.
"""
