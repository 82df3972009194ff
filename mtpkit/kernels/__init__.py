"""Every kernel and the one selector that chooses them (`ops.py`: `Ops`, the torch references;
`triton_ops.py`: the Triton kernels). Each Triton kernel `triton_X.py` has its torch reference
`X.py` beside it, and is tested against it.
"""
