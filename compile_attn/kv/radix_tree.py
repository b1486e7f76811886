"""A radix tree over token ids whose nodes hold KV page ids: the index of the prefix cache.

Keys are matched a page at a time: a node's key is a whole number of pages (``page_size`` tokens each) and
two keys share a page only when all its tokens are equal, so a page is reusable only when full (page size 1
matches token by token). Reference counts pin the nodes running requests read (a pin holds the whole path
from the root); unpinned leaves are evicted least recently used first. The tree knows nothing of the
allocator: ``evict`` returns the pages it dropped and the caller frees them.
"""

from __future__ import annotations

import array
import heapq
import itertools

import numpy as np


class Node:
    """``key`` (int64 tokens, a whole number of pages) follows the parent's key; ``pages[i]`` holds the KV of
    ``key[i * page_size : (i + 1) * page_size]``. ``ref``: pins (requests reading it or a node below it)."""

    __slots__ = ("key", "pages", "parent", "children", "ref", "last_used")

    def __init__(self, key: np.ndarray, pages: array.array, parent: Node | None) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[bytes, Node] = {}  # by the tokens of the child's first page
        self.ref = 0
        self.last_used = 0

    def path_pages(self) -> array.array:
        """The pages from the root down to this node, in order."""
        parts = []
        node: Node | None = self
        while node is not None:
            parts.append(node.pages)
            node = node.parent
        out = array.array("q")
        for p in reversed(parts):
            out.extend(p)
        return out


def _common_tokens(a: np.ndarray, b: np.ndarray, page_size: int) -> int:
    """Tokens at the start of ``a`` and ``b`` that agree, rounded down to whole pages."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    k = int(diff[0]) if diff.size else m
    return k - k % page_size


class RadixTree:
    """Token-id prefixes to KV pages, with pins and LRU eviction of unpinned leaves."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = Node(np.empty(0, dtype=np.int64), array.array("q"), None)  # never pinned, never evicted
        self.evictable_pages = 0  # pages of unpinned nodes: what eviction can free
        self.num_pages = 0  # pages in the tree
        self._clock = itertools.count(1)

    def _first_page(self, key: np.ndarray, at: int = 0) -> bytes:
        return key[at:at + self.page_size].tobytes()

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node``'s key after ``k`` tokens (a whole number of pages > 0): a new node holds the first part
        and becomes ``node``'s parent, with ``node``'s pins and age."""
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < k < len(node.key) and k % ps == 0
        top = Node(node.key[:k], node.pages[:k // ps], parent)
        top.ref, top.last_used = node.ref, node.last_used
        parent.children[self._first_page(top.key)] = top
        node.key, node.pages, node.parent = node.key[k:], node.pages[k // ps:], top
        top.children[self._first_page(node.key)] = node
        return top

    def match(self, tokens: np.ndarray) -> tuple[Node, array.array]:
        """The longest cached prefix of ``tokens`` in whole pages: the node where it ends (a node is split so that
        one ends exactly there; the root when nothing matches) and its pages. Marks the path as used now."""
        node, pages, _ = self._walk(tokens)
        return node, pages

    def _walk(self, tokens: np.ndarray) -> tuple[Node, array.array, int]:
        ps = self.page_size
        end = len(tokens) - len(tokens) % ps
        now = next(self._clock)
        node, pages, pos = self.root, array.array("q"), 0
        while pos < end:
            child = node.children.get(self._first_page(tokens, pos))
            if child is None:
                break
            k = _common_tokens(child.key, tokens[pos:end], ps)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_used = now
            pages.extend(child.pages)
            node, pos = child, pos + k
        return node, pages, pos

    def insert(self, tokens: np.ndarray, pages: array.array) -> tuple[Node, array.array]:
        """Cache ``pages`` (``len(tokens) // page_size`` of them, one per whole page of ``tokens``) as the KV of
        ``tokens``. Where the tree already holds a prefix of ``tokens`` its own pages stay; the rest of ``pages``
        goes into a new leaf. Returns the node where ``tokens`` end and the tree's pages for all of them: where
        they differ from ``pages``, the caller's pages are duplicates it still owns."""
        ps = self.page_size
        n = len(tokens) - len(tokens) % ps
        node, have, pos = self._walk(tokens[:n])
        if pos < n:
            leaf = Node(tokens[pos:n].copy(), pages[pos // ps:n // ps], node)
            leaf.last_used = next(self._clock)
            node.children[self._first_page(leaf.key)] = leaf
            self.num_pages += len(leaf.pages)
            self.evictable_pages += len(leaf.pages)
            have.extend(leaf.pages)
            node = leaf
        return node, have

    def pin(self, node: Node) -> None:
        """Hold ``node`` and every node above it: none of them is evicted until ``unpin`` (the root: no-op)."""
        while node is not self.root:
            if node.ref == 0:
                self.evictable_pages -= len(node.pages)
            node.ref += 1
            node = node.parent

    def unpin(self, node: Node) -> None:
        while node is not self.root:
            node.ref -= 1
            assert node.ref >= 0, "a radix tree node was unpinned more often than pinned"
            if node.ref == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent

    def evict(self, num_pages: int) -> array.array:
        """Drop unpinned leaves, least recently used first, until ``num_pages`` pages are dropped or none is left;
        returns the dropped pages (a parent left childless and unpinned becomes a candidate in turn)."""
        out = array.array("q")
        if num_pages <= 0:
            return out
        heap = [(n.last_used, id(n), n) for n in self.nodes() if not n.children and n.ref == 0]
        heapq.heapify(heap)
        while heap and len(out) < num_pages:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._first_page(leaf.key)]
            out.extend(leaf.pages)
            self.num_pages -= len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return out

    def nodes(self) -> list[Node]:
        """Every node but the root."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
