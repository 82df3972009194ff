"""What a request asks of the sampler (`params.py`), the target distribution and the
position-keyed draws (`sampler.py`), and the one rejection function (`rejection.py`).
"""
