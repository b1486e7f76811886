"""The torch_native backend (``backend.py``): the reference attention in plain torch ops over the paged pool, the
backend every other one is held to, and the one that runs anywhere. Imports no other backend.
"""
