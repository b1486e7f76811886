"""Which rows of an extend/mixed batch the triton backend runs in its decode kernel instead of the extend kernel.

A mixed step is a prefill chunk beside decoding requests. The extend kernel's grid is (q heads, query blocks of
``BLOCK_M`` rows, requests): a decoding request there gets one program per q head (each reading its KV head's
prefix again, the GQA group not shared), ``BLOCK_M`` query rows of which one is real, and one program walks the
whole prefix (no split over the KV length). The decode kernel is made for these rows: one program per (request, KV
head, KV split) covers the group's q heads. So the backend gives an extend step's decode rows a decode step of their
own (``ExtendStep.decode``, prepared out of graph with the extend offsets) and launches both kernels, each writing
its rows of ``out`` (``backend.forward_extend``).

Which rows: the batch's *leading* block of requests that add one token to a cached prefix (extend length 1, prefix
> 0). The scheduler (``engine/requests/scheduler.py``) takes every decoding request first and prefill chunks after
them, so in a mixed step that block is all of its decode rows. Rows like these after the first prefill row stay on
the extend kernel: the extend kernel's rows are one contiguous range of the batch's offsets (``qo_indptr``), so the
split is a cut, not a gather. Verify steps (``TARGET_VERIFY``, whose rows verify drafts) and draft trees keep their
own paths, and a batch of decode rows only (no prefill part) stays one extend launch as before.

Sliding windows and logit caps need nothing here: the decode step has one token CSR per window (the window's last
``window`` keys, the extend kernel's rule for a query at the last position) and the decode kernel applies the cap.
"""

from __future__ import annotations

from compile_attn.batch import ForwardBatch

# Decode rows that make a split worth its cost. One row is enough: the split adds one decode launch per layer (a few
# microseconds, the kernel reading each row's KV once per KV head), while a decode row on the extend kernel costs
# one program per q head walking the row's whole prefix alone, which a long prefix makes the step's slowest program.
MIN_DECODE_ROWS = 1


def leading_decode_rows(fb: ForwardBatch) -> int:
    """How many of ``fb``'s first requests run in the decode kernel: its leading block of requests with extend
    length 1 over a cached prefix, when that block has at least ``MIN_DECODE_ROWS`` requests and a prefill part
    follows it; 0 for a verify step, draft trees, or anything else (every row on the extend kernel). Host lists
    only."""
    if fb.forward_mode.is_verify() or fb.forward_mode.is_decode() or fb.draft_parents is not None:
        return 0
    ext, prefix = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
    rows = 0
    for e, p in zip(ext, prefix):
        if e != 1 or p <= 0:
            break
        rows += 1
    return rows if MIN_DECODE_ROWS <= rows < len(ext) else 0
