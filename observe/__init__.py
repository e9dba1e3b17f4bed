"""Observability: what a run shows while it runs and leaves behind afterwards.

metrics_log.py  one JSONL line of metrics per step (run_dir/metrics.jsonl), optional TensorBoard
progress.py     progress display for long phases (tqdm on a terminal, plain lines in log files)
"""
