"""Building blocks the families share: the linear family with tensor parallelism (`linear.py`),
norms, RoPE, the dense MLP, the MoE, the FP8 weight layouts and the weights' memory layout
(`layout.py`).
"""
