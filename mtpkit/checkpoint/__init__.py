"""Reading checkpoints: names -> directories (`hub.py`), weight specs (`weights.py`), the FP8
format (`fp8.py`), random weights from config.json (`dummy.py`) and the loader (`loader.py`).
"""
