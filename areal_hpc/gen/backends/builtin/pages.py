"""Which page of the KV pool holds what: reference counts, and the prefix cache of finished rows' pages.

The pool is pages of ``PAGE`` token positions. A running row holds a list of pages (its block table); rows with
a common prefix (the n samples of a prompt, or a prompt that extends a cached sequence) hold the same pages of
it, counted by references. When a row ends, its full pages stay as a trie keyed by their tokens (a page's key
is its tokens under its parent's: SGLang's radix cache at page granularity), and a later row whose context
starts with those tokens takes them instead of prefilling them again. A cached page no row holds is idle and
is evicted, least recently used leaf first, when the pool needs the space. ``flush`` (new weights) forgets
every cached page: their keys and values were computed by the old weights. Page 0 is never handed out: free
rows of the block table point at it, so a decode step of a free slot writes there harmlessly.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from areal_hpc.gen.backends.builtin.paged_decode import PAGE


class Node:
    """One cached page: its tokens, under its parent's."""

    __slots__ = ("page", "key", "parent", "children", "used", "alive")

    def __init__(self, page: int, key: tuple[int, ...], parent: Node | None):
        self.page, self.key, self.parent = page, key, parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.used = 0
        self.alive = True


class Pages:
    """Reference counts of ``total`` pages and the trie of cached ones; only the engine thread uses it."""

    def __init__(self, total: int):
        if total < 2:
            raise ValueError(f"a KV pool needs at least 2 pages ({PAGE} positions each), got {total}")
        self.total = total
        self._free = list(range(total - 1, 0, -1))  # popped from the end: low pages first
        self._refs = [0] * total
        self._node: dict[int, Node] = {}  # cached pages
        self._root = Node(0, (), None)
        self._idle = 0  # cached pages no row holds
        self._leaves: list[tuple[int, int, Node]] = []  # idle leaves by last use (lazily checked)
        self._clock = itertools.count(1)
        self._tie = itertools.count()

    @property
    def free(self) -> int:
        """Pages ready to hand out without evicting anything."""
        return len(self._free)

    @property
    def available(self) -> int:
        """Pages ``take`` can hand out: free ones and idle cached ones."""
        return len(self._free) + self._idle

    @property
    def cached(self) -> int:
        return len(self._node)

    def take(self, n: int, evict: bool = True) -> list[int] | None:
        """``n`` pages, each held once, evicting idle cached pages as needed; None (and nothing taken) when
        the pool cannot."""
        if n > (self.available if evict else self.free):
            return None
        while len(self._free) < n:
            self._evict_one()
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def hold(self, pages: Sequence[int], times: int = 1) -> None:
        """One more holder (``times`` more) of pages already held or cached."""
        if times == 0:
            return
        for page in pages:
            if self._refs[page] == 1 and page in self._node:
                self._idle -= 1
            self._refs[page] += times

    def release(self, pages: Sequence[int]) -> None:
        """A holder lets go: pages held by nobody go back to the free list, or stay cached and idle."""
        for page in pages:
            self._refs[page] -= 1
            refs = self._refs[page]
            if refs == 0:
                self._free.append(page)
            elif refs == 1 and (node := self._node.get(page)) is not None:
                self._idle += 1
                self._push_leaf(node)

    # --- the prefix cache ----------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], limit: int) -> list[int]:
        """The cached pages of the longest cached prefix of ``tokens``, at most ``limit`` tokens of it, now held
        by the caller."""
        node, pages, stamp = self._root, [], next(self._clock)
        for start in range(0, limit - PAGE + 1, PAGE):
            node = node.children.get(tuple(tokens[start : start + PAGE]))
            if node is None:
                break
            node.used = stamp
            pages.append(node.page)
        self.hold(pages)
        return pages

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Cache the full pages of a row that ends: ``tokens`` are those whose keys and values its ``pages``
        hold. A page whose tokens are cached already under another page is left to the row's release."""
        node, stamp = self._root, next(self._clock)
        for i, page in enumerate(pages[: len(tokens) // PAGE]):
            key = tuple(tokens[i * PAGE : (i + 1) * PAGE])
            child = node.children.get(key)
            if child is None:
                if page in self._node:  # cached under another prefix: cannot happen, pages follow tokens
                    break
                child = node.children[key] = Node(page, key, node)
                self._node[page] = child
                self._refs[page] += 1
            elif child.page != page:
                node = child
                node.used = stamp
                continue
            node = child
            node.used = stamp

    def flush(self) -> int:
        """Forget every cached page (the weights changed); returns how many were cached."""
        count = len(self._node)
        nodes, self._node = list(self._node.values()), {}
        self._root, self._idle, self._leaves = Node(0, (), None), 0, []
        for node in nodes:
            node.alive = False
        self.release([node.page for node in nodes])
        return count

    def _push_leaf(self, node: Node) -> None:
        if not node.children:
            heapq.heappush(self._leaves, (node.used, next(self._tie), node))

    def _evict_one(self) -> None:
        while self._leaves:
            used, _, node = heapq.heappop(self._leaves)
            if node.alive and not node.children and self._refs[node.page] == 1 and used == node.used:
                break
        else:  # stale heap entries only: rebuild it from the idle leaves
            self._leaves = [
                (n.used, next(self._tie), n)
                for n in self._node.values()
                if not n.children and self._refs[n.page] == 1
            ]
            if not self._leaves:
                raise RuntimeError("KV pool bookkeeping: idle pages counted but no idle leaf to evict")
            heapq.heapify(self._leaves)
            return self._evict_one()
        node.alive = False
        del node.parent.children[node.key]
        del self._node[node.page]
        self._idle -= 1
        self._refs[node.page] = 0
        self._free.append(node.page)
        parent = node.parent
        if parent.alive and parent is not self._root and self._refs[parent.page] == 1:
            self._push_leaf(parent)
