"""Random ("dummy") weights for a model built from config.json alone: benchmarks and GPU
checks at real layer shapes without writing a multi-GB checkpoint. Deterministic in `seed`,
so two engines built with the same seed hold the same weights."""

import torch

from mtpkit.checkpoint.weights import CheckpointModel


@torch.no_grad()
def init_dummy_weights(model: CheckpointModel, dtype: torch.dtype, device: torch.device,
                       seed: int = 0, std: float = 0.02) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        # A family whose weights need other starting values (Gemma 4's plain-weight norms and
        # scales start at 1) says so per parameter; None keeps the rules below.
        if (value := model.dummy_value(name, tuple(p.shape))) is not None:
            value = value.to(device)
        elif "norm" in name and leaf == "weight":
            # zero-centred RMSNorms act as identity at 0; the GDN gated norm's weight is plain
            value = torch.ones(p.shape, device=device) if name.endswith("linear_attn.norm.weight") \
                else torch.zeros(p.shape, device=device)
        elif leaf == "A_log":
            value = torch.empty(p.shape, device=device).uniform_(1, 16, generator=gen).log()
        elif leaf == "dt_bias":
            value = torch.ones(p.shape, device=device)
        else:
            value = torch.randn(p.shape, device=device, generator=gen) * std
        p.data = value.to(dtype) if value.is_floating_point() else value   # integer tables keep their type
    for buf in model.buffers():  # RoPE frequencies stay fp32
        buf.data = buf.data.to(device)
