"""The data of one engine step, crossing engine -> model -> drafter: metadata (`metadata.py`),
the caches a model declares (`cache_spec.py`) and the tensors that hold them (`cache.py`), and
the drafter's run-time interface (`draft.py`). The bottom floor above `shapes.py`: it imports
nothing of mtpkit's but shapes and errors.
"""
