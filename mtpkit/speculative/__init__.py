"""Speculative decoding: drafter set-up from config files (`setup.py`: `setup_drafter`; what a
drafter declares: `drafter.py`) and the drafters (`mtp.py`: the Qwen3-Next MTP head;
`draft_model.py`: a small model of a supported family; `gemma4_assistant.py`: Gemma 4's
assistant, which reads the target's KV). Their run-time interface is step data
(`mtpkit/step/draft.py`); verification is `mtpkit/sampling/rejection.py`.
"""
