"""One step's batch: ``ForwardBatch`` (host and device views, built and checked here) and its vocabulary
(``ForwardMode``, the scratch row and slot, shared-prefix groups).

The lowest layer beside the other base modules: it imports nothing of the KV cache (what a batch asks of one is
``BatchCache``) and nothing above. ``mode.py`` holds the vocabulary, ``forward_batch.py`` the batch.
"""

from compile_attn.batch.forward_batch import BatchCache, ForwardBatch
from compile_attn.batch.mode import PAD_REQUEST, PAD_SLOT, ForwardMode, SharedPrefixGroup

__all__ = ["PAD_REQUEST", "PAD_SLOT", "BatchCache", "ForwardBatch", "ForwardMode", "SharedPrefixGroup"]
