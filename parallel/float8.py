"""Float8 training of the transformer's linear layers through torchao (a switch; CUDA GPUs with float8 tensor cores).

Each selected nn.Linear becomes a torchao Float8Linear: inputs, weights and output gradients are cast
to float8 with dynamic per-tensor scales for the three matmuls of forward and backward, the master
weights stay in their dtype. Not converted:
  - the output head (`lm_head`): its logits feed the log-probs of the policy ratio, which should not
    carry float8 rounding;
  - linears whose dimensions are not multiples of 16 (the float8 matmul kernels need that alignment).

Float8 with tensor parallelism would need torchao's float8-aware TP styles in place of the plan's; that
combination is refused rather than silently run with bf16 TP communication.
"""

from __future__ import annotations

import torch
from torch import nn


def float8_module_filter(module: nn.Module, fqn: str) -> bool:
    """Which linears to convert: block projections with 16-aligned shapes, never the output head."""
    if not isinstance(module, nn.Linear) or fqn == "lm_head" or fqn.endswith(".lm_head"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module, *, tp_enabled: bool = False, emulate: bool = False) -> nn.Module:
    """Swap the model's eligible linears for float8 ones in place.

    emulate: run the float8 casts in emulation (any device, no speed-up); for testing the conversion only.
    """
    device = next(model.parameters()).device
    if not emulate:
        if device.type != "cuda":
            raise ValueError(
                f"float8 training needs a CUDA GPU with float8 tensor cores (compute capability >= 8.9); "
                f"the model is on {device.type}. Turn the float8 switch off on this machine."
            )
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"float8 training needs compute capability >= 8.9 (Ada/Hopper); this GPU has {capability}")
    if tp_enabled:
        raise ValueError("float8 training with tensor parallelism is not supported here; use FSDP only (tp = 1)")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(emulate=emulate)
    convert_to_float8_training(model, module_filter_fn=float8_module_filter, config=config)
    return model
