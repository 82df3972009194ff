"""Text around the token ids: the tokenizer, incremental detokenizing, stop strings, chat
templates and a checkpoint's generation_config.json defaults.
"""
