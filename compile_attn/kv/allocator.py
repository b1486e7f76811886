"""PageAllocator: the KV pool's free list of pages, all-or-nothing, with a vectorised check of every free.

Page 0 is the pool's scratch page and is never handed out. Pages go in and out as int64 ``array.array``s; this
module knows nothing of requests or slots (see ``cache.py``).
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np

from compile_attn.errors import KVCacheExhaustedError


class PageAllocator:
    """Free list of pages ``1..num_pages`` (page 0 is scratch). All-or-nothing ``alloc``.

    Pages go in and out as int64 ``array.array``s: a prefill of thousands of tokens allocates and frees
    thousands of pages per step, and the stack's slices, the request's page lists and the step's upload buffer
    are then memory copies, not per-int conversions. Which pages are allocated is a NumPy bool array, so
    checking a free (every page allocated, none twice) is vectorised too.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = array.array("q", range(num_pages, 0, -1))  # stack: low page ids are handed out first
        self._allocated = np.zeros(num_pages + 1, dtype=bool)  # by page id; always num_pages - available True

    @property
    def available(self) -> int:
        return len(self._free)

    def free_pages(self) -> np.ndarray:
        """The free pages (an int64 view of the free list: read it before the next ``alloc`` or ``free``)."""
        return np.frombuffer(self._free, dtype=np.int64) if self._free else np.empty(0, dtype=np.int64)

    def alloc(self, n: int) -> array.array:
        if n > len(self._free):
            raise KVCacheExhaustedError(
                f"KV cache full: asked for {n} pages, {len(self._free)} free of {self.num_pages}; "
                f"nothing was allocated. Free finished requests or create the cache with more tokens"
            )
        if n <= 0:
            return array.array("q")
        pages = self._free[-n:]
        pages.reverse()  # the top n of the stack, top first
        del self._free[-n:]
        self._allocated[np.asarray(pages, dtype=np.int64)] = True
        return pages

    def free(self, pages: Sequence[int] | array.array) -> None:
        """Return ``pages`` to the free list; ValueError (nothing freed) naming a page that is not allocated or
        appears twice."""
        p = np.asarray(pages, dtype=np.int64)
        if not p.size:
            return
        inside = (p >= 1) & (p <= self.num_pages)
        if not inside.all():
            raise ValueError(f"cannot free page {int(p[~inside][0])}: it is not an allocated page")
        held = self._allocated[p]
        if not held.all():
            raise ValueError(f"cannot free page {int(p[~held][0])}: it is not an allocated page")
        self._allocated[p] = False
        expected_left = self.num_pages - len(self._free) - p.size
        if int(np.count_nonzero(self._allocated)) != expected_left:  # a page appears twice: undo, and name it
            self._allocated[p] = True
            values, counts = np.unique(p, return_counts=True)
            raise ValueError(f"cannot free page {int(values[counts > 1][0])}: it is not an allocated page "
                             f"(it appears twice in one free)")
        self._free.frombytes(p.tobytes())
