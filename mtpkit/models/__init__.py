"""The model families: the interface every family provides and its records (`family.py`), the
registry of families and drafter kinds by model_type (`registry.py`), and one folder per
family (`qwen3_next/`, `gemma4/`).
"""
