"""Gemma 4 (text decoder) and its MTP assistant drafter's model.
"""
