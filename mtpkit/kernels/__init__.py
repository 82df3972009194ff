"""Every kernel and the one selector that chooses them: `ops.Ops` (its docstring's table lists
every field with its torch reference and its Triton kernel), the torch backend `ops.TORCH` and
the Triton one `triton_ops.TRITON`. Each Triton module `triton_X.py` has its torch reference
`X.py` beside it (same function names and signatures) and is tested against it; every Triton
entry point falls back to its reference by the one rule of `triton_common.use_reference`.
"""
