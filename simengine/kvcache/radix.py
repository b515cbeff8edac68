"""Token-granular radix prefix cache over a pool of KV token slots (SGLang RadixCache, TGI RadixAllocator).

The tree maps token sequences (numpy int32 edges, compared with numpy) to cached KV. The pool counts slots
three ways: held by the tree, held privately by requests, free; `free + tree + requests == capacity`. Tree
tokens under a node with `lock_ref > 0` are protected (a running request uses them); the rest are
evictable and count as available. Eviction pops the least recently used unlocked leaf from a heap keyed on
`last_access` (a logical clock), and pushes the parent when it becomes an unlocked leaf (SGLang
`radix_cache.py::evict`); TGI trims a leaf partially when it needs fewer tokens (`radix.rs::evict`).
A `match_prefix` that ends inside an edge splits it, so a lock covers exactly the matched tokens. With
`page_size > 1` matches and insertions are aligned down to whole pages (TGI blocks, SGLang pages).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


class RadixNode:
    """One edge of the tree: `key` tokens hanging under `parent`."""

    __slots__ = ("key", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: np.ndarray, parent: RadixNode | None, last_access: int):
        self.key = key
        self.children: dict = {}
        # the root's is None; walks stop at the root (`is not root`), so every other node's parent is a node
        self.parent: RadixNode = parent  # type: ignore[assignment]
        self.lock_ref = 0
        self.last_access = last_access

    def __repr__(self) -> str:
        return f"RadixNode(len={len(self.key)}, lock={self.lock_ref}, kids={len(self.children)})"


@dataclass(slots=True)
class RadixHold:
    """A request's claim on the pool: the locked node ending its cached prefix, and its private slots."""

    node: RadixNode
    cached: int = 0      # tokens of the request covered by the locked tree path
    private: int = 0     # slots the request owns outside the tree (computed-but-uncached, reserved)


def radix_tokens(req) -> np.ndarray:
    """The tokens a radix cache keys a request's KV by: its token ids, moved into an id range of the request's LoRA
    adapter when it names one, so KV computed under different adapters is never shared (SGLang's radix key carries
    the adapter: the request's extra key)."""
    if req.lora_id < 0:
        return req.token_ids
    return req.token_ids.astype(np.int64) + ((req.lora_id + 1) << 32)


class RadixCache:
    """Radix tree + slot pool of `capacity` tokens. Contract: lock refs never negative; parent lock >= sum of
    children's; `tree_tokens + req_tokens <= capacity`. Disabled, it matches nothing and caches nothing."""

    def __init__(self, capacity: int, *, page_size: int = 1, enabled: bool = True, partial_evict: bool = False):
        if capacity < 1 or page_size < 1:
            raise ValueError(f"capacity and page_size must be >= 1, got {capacity}, {page_size}")
        self.capacity, self.page, self.enabled, self.partial_evict = capacity, page_size, enabled, partial_evict
        self.root = RadixNode(np.empty(0, dtype=np.int32), None, 0)
        self.tree_tokens = 0          # slots held by tree nodes
        self.evictable_tokens = 0     # of which unlocked
        self.req_tokens = 0           # slots held privately by requests
        self.clock = 0                # logical time for LRU
        self.num_nodes = 0
        self.num_evicted_tokens = 0
        self.query_tokens = 0         # prefix lookups at admission and their hits, in tokens
        self.hit_tokens = 0
        self._heap: list[tuple[int, int, RadixNode]] = []   # (last_access, push seq, leaf); lazily validated
        self._seq = 0

    # ---- accounting ------------------------------------------------------------------------------------
    @property
    def free_tokens(self) -> int:
        return self.capacity - self.tree_tokens - self.req_tokens

    def available(self) -> int:
        """Slots an allocation could get: free plus evictable."""
        return self.capacity - self.tree_tokens - self.req_tokens + self.evictable_tokens

    def usage(self) -> float:
        """Fraction in use by requests (private + protected tree tokens); evictable cache counts as free."""
        return 1.0 - self.available() / self.capacity

    def _ckey(self, tokens: np.ndarray, pos: int):
        return int(tokens[pos]) if self.page == 1 else tokens[pos:pos + self.page].tobytes()

    def _common(self, key: np.ndarray, tokens: np.ndarray, pos: int, end: int) -> int:
        m = min(len(key), end - pos)
        d = key[:m] != tokens[pos:pos + m]
        i = int(d.argmax()) if m else 0
        n = i if m and d[i] else m
        return n - n % self.page

    def _push(self, node: RadixNode) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (node.last_access, self._seq, node))

    # ---- tree ------------------------------------------------------------------------------------------
    def match_prefix(self, tokens: np.ndarray, limit: int | None = None) -> tuple[int, RadixNode]:
        """(matched tokens, node ending the match) for the longest cached prefix of tokens[:limit]; refreshes
        the path's access time. No lock is taken."""
        if not self.enabled:
            return 0, self.root
        end = len(tokens) if limit is None else min(limit, len(tokens))
        end -= end % self.page
        self.clock += 1
        now, node, pos = self.clock, self.root, 0
        while pos < end:
            child = node.children.get(self._ckey(tokens, pos))
            if child is None:
                break
            n = self._common(child.key, tokens, pos, end)
            if n == 0:
                break
            child.last_access = now
            if n < len(child.key):
                child = self._split(child, n)
            node, pos = child, pos + n
        if node is not self.root and not node.children and node.lock_ref == 0:
            self._push(node)
        return pos, node

    def peek_prefix(self, tokens: np.ndarray) -> int:
        """Tokens of the longest cached prefix of `tokens`, whole pages, changing nothing (no access time, no
        split): what the cache would report in a KV event stream."""
        if not self.enabled:
            return 0
        end = len(tokens) - len(tokens) % self.page
        node, pos = self.root, 0
        while pos < end:
            child = node.children.get(self._ckey(tokens, pos))
            if child is None:
                break
            n = self._common(child.key, tokens, pos, end)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Cut `child` after n tokens; the new upper node keeps child's lock count and access time."""
        mid = RadixNode(child.key[:n], child.parent, child.last_access)
        mid.lock_ref = child.lock_ref
        child.parent.children[self._ckey(child.key, 0)] = mid
        child.key = child.key[n:]
        child.parent = mid
        mid.children[self._ckey(child.key, 0)] = child
        self.num_nodes += 1
        if not child.children and child.lock_ref == 0:
            self._push(child)  # its access time may have just changed
        return mid

    def insert(self, tokens: np.ndarray) -> int:
        """Cache tokens (page-aligned); returns how many were new. The caller must hold the slots of those
        tokens privately (they move from the requests' count to the tree); it frees the duplicates itself."""
        return self._insert(tokens)[0] if self.enabled else 0

    def _insert(self, tokens: np.ndarray) -> tuple[int, RadixNode]:
        end = len(tokens) - len(tokens) % self.page
        self.clock += 1
        now, node, pos = self.clock, self.root, 0
        while pos < end:
            ck = self._ckey(tokens, pos)
            child = node.children.get(ck)
            if child is None:
                new = RadixNode(tokens[pos:end], node, now)
                node.children[ck] = new
                added = end - pos
                self.num_nodes += 1
                self.tree_tokens += added
                self.evictable_tokens += added
                self.req_tokens -= added
                self._push(new)
                return added, new
            n = self._common(child.key, tokens, pos, end)
            child.last_access = now
            if n < len(child.key):
                child = self._split(child, n)
            node, pos = child, pos + n
        if node is not self.root and not node.children and node.lock_ref == 0:
            self._push(node)
        return 0, node

    def lock(self, node: RadixNode) -> None:
        """Protect the path root..node from eviction (one reference)."""
        root = self.root
        while node is not root:
            if node.lock_ref == 0:
                self.evictable_tokens -= len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Drop one reference on the path root..node; unlocked leaves become eviction candidates."""
        root = self.root
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref < 0:
                raise RuntimeError("radix lock_ref went negative")
            if node.lock_ref == 0:
                self.evictable_tokens += len(node.key)
                if not node.children:
                    self._push(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from LRU unlocked leaves (fewer if not enough are evictable)."""
        evicted, heap, root = 0, self._heap, self.root
        while evicted < num_tokens and heap:
            t, _, node = heapq.heappop(heap)
            if node.parent is None or node.children or node.lock_ref or node.last_access != t:
                continue  # stale entry: removed, grew children, locked or touched since
            size, need = len(node.key), num_tokens - evicted
            if self.partial_evict and size > need:
                cut = -(-need // self.page) * self.page
                if cut < size:
                    node.key = node.key[:size - cut]
                    self._drop(cut)
                    evicted += cut
                    self._push(node)
                    break
            parent = node.parent
            del parent.children[self._ckey(node.key, 0)]
            node.parent = None  # type: ignore[assignment]  # detached: its stale heap entries see it
            self.num_nodes -= 1
            self._drop(size)
            evicted += size
            if parent is not root and not parent.children and parent.lock_ref == 0:
                self._push(parent)
        self.num_evicted_tokens += evicted
        if len(heap) > 4 * self.num_nodes + 1024:
            self._rebuild_heap()
        return evicted

    def _drop(self, n: int) -> None:
        self.tree_tokens -= n
        self.evictable_tokens -= n

    def _rebuild_heap(self) -> None:
        self._heap = []
        for n in self._nodes():
            if not n.children and n.lock_ref == 0:
                self._seq += 1
                self._heap.append((n.last_access, self._seq, n))
        heapq.heapify(self._heap)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def dfs_weight_order(self, nodes: list[RadixNode]) -> list[int]:
        """Indices of `nodes` in SGLang dfs-weight order: DFS from the root, heavier subtrees (more waiting
        requests ending below) first (schedule_policy.py::_sort_by_dfs_weight)."""
        at: dict[RadixNode, list[int]] = {}
        for i, nd in enumerate(nodes):
            at.setdefault(nd, []).append(i)
        weight: dict[RadixNode, int] = {}
        root = self.root
        for nd, idx in at.items():
            while True:
                weight[nd] = weight.get(nd, 0) + len(idx)
                if nd is root:
                    break
                nd = nd.parent
        order: list[int] = []
        stack = [root]
        while stack:
            nd = stack.pop()
            order.extend(at.get(nd, ()))
            stack.extend(sorted((c for c in nd.children.values() if c in weight), key=weight.__getitem__))
        return order

    # ---- slots -----------------------------------------------------------------------------------------
    def alloc(self, n: int) -> bool:
        """Give n slots to a request, evicting LRU leaves if needed; False (nothing changed) if impossible."""
        short = n - self.free_tokens
        if short > 0:
            if short > self.evictable_tokens:
                return False
            self.evict(short)
        self.req_tokens += n
        return True

    def free(self, n: int) -> None:
        self.req_tokens -= n
        if self.req_tokens < 0:
            raise RuntimeError("radix pool: requests freed more slots than they held")

    # ---- per-request holds -----------------------------------------------------------------------------
    def acquire(self, tokens: np.ndarray, limit: int | None = None) -> RadixHold:
        """Match tokens[:limit] and lock the hit for a request."""
        matched, node = self.match_prefix(tokens, limit)
        self.lock(node)
        return RadixHold(node, matched, 0)

    def grow(self, hold: RadixHold, n: int) -> bool:
        if not self.alloc(n):
            return False
        hold.private += n
        return True

    def shrink(self, hold: RadixHold, n: int) -> None:
        """Give back `n` of the request's private slots (rejected speculative drafts)."""
        hold.private -= n
        self.free(n)

    def commit(self, hold: RadixHold, tokens: np.ndarray) -> int:
        """Cache the request's computed tokens (page-aligned), move the lock to the new end and free
        duplicates another request cached first. Returns the newly cached count."""
        end = len(tokens) - len(tokens) % self.page
        if not self.enabled or end <= hold.cached:
            return 0
        new, node = self._insert(tokens[:end])
        moved = end - hold.cached
        if moved > hold.private:
            raise RuntimeError("radix commit of tokens the request never allocated")
        self.req_tokens -= moved - new          # duplicates go back to the free pool
        hold.private -= moved
        self.lock(node)
        self.unlock(hold.node)
        hold.node, hold.cached = node, end
        return new

    def release(self, hold: RadixHold) -> None:
        """Unlock the request's prefix and free its private slots (what was committed stays cached)."""
        self.unlock(hold.node)
        self.free(hold.private)
        hold.node, hold.cached, hold.private = self.root, 0, 0

    def record_lookup(self, query: int, hit: int) -> None:
        self.query_tokens += query
        self.hit_tokens += hit

    # ---- checks ----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Recount the tree; raise AssertionError on any inconsistency."""
        assert self.free_tokens >= 0, f"pool over-committed: tree {self.tree_tokens} + req {self.req_tokens}"
        assert self.req_tokens >= 0
        total = evictable = count = 0
        stack = [self.root]
        while stack:
            nd = stack.pop()
            kids = nd.children.values()
            for c in kids:
                assert c.parent is nd and len(c.key) > 0 and len(c.key) % self.page == 0
                assert nd.children.get(self._ckey(c.key, 0)) is c, "child filed under the wrong key"
                assert c.lock_ref >= 0, "negative lock_ref"
                count += 1
                total += len(c.key)
                evictable += len(c.key) if c.lock_ref == 0 else 0
                stack.append(c)
            if nd is not self.root:
                assert nd.lock_ref >= sum(c.lock_ref for c in kids), "parent locked less than its children"
        assert count == self.num_nodes, f"node count {count} != {self.num_nodes}"
        assert total == self.tree_tokens, f"tree holds {total} tokens, accounted {self.tree_tokens}"
        assert evictable == self.evictable_tokens, f"evictable {evictable} != {self.evictable_tokens}"
