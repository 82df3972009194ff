"""Qwen3-Next: hybrid Gated DeltaNet + gated attention + MoE, with its MTP head.
"""
