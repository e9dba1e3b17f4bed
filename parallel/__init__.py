"""Parallelism applied from outside the model, torchtitan style.

dims.py                  ParallelDims: dp_replicate x dp_shard x tp, validation, the device mesh
tensor_parallel.py       the TP (+ sequence parallel) plan for Qwen2, as data
logprob.py               vocabulary-parallel token log-prob / entropy (no gathered logits)
fsdp.py                  FSDP2 units, mixed precision, gradient SUM over dp ranks
activation_checkpoint.py none / full / selective (per op or every k-th block), in place
compile.py               torch.compile per block, in place
parallelize.py           parallelize_qwen2: TP -> AC -> compile -> FSDP
grad_clip.py             grad-norm clipping across FSDP/TP DTensor meshes
plain_names.py           parameter names without torch.compile / checkpoint_wrapper components

Checkpoints and Hugging Face I/O of the sharded policy are checkpoint/'s.
"""
