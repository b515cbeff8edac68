"""llama-server's host-RAM prompt cache (--cache-ram; tools/server server_prompt_cache): prompt states of idle slots
saved as token arrays, the best match restored into a slot a new task takes. Used by engines/llamacpp.py.
"""

from __future__ import annotations

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:  # most cached prompts differ at once: skip the array comparison
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PromptRamCache:
    """Saved prompt states, oldest first, within `limit_tokens` (0: off; at least one entry is always kept)."""

    def __init__(self, limit_tokens: float):
        self.limit_tokens = limit_tokens
        self.entries: list[np.ndarray] = []
        self.heads: list[int] = []  # each entry's first token: only an entry sharing it can share a prefix
        self.num_tokens = 0         # tokens in all entries
        self.restored_tokens = 0

    def save(self, tokens: np.ndarray) -> None:
        """alloc(): skip a state already contained in an entry, drop entries the new state contains."""
        if not len(tokens):
            return
        head = int(tokens[0])
        if head in self.heads:  # else no entry shares a token with it: none contains it or is contained
            keep = []
            for e in self.entries:
                lcp = common_prefix(e, tokens)
                if lcp == len(tokens):
                    return
                if lcp < len(e):
                    keep.append(e)
            self.entries = keep
            self.heads = [int(e[0]) for e in keep]
            self.num_tokens = sum(len(e) for e in keep)
        self.entries.append(tokens)
        self.heads.append(head)
        self.num_tokens += len(tokens)

    def best(self, cached: np.ndarray, prompt: np.ndarray) -> int | None:
        """load(): the entry beating a slot's `cached` tokens on both kept fraction and similarity to `prompt`
        (>= 25% of it kept), or None."""
        lcp = common_prefix(cached, prompt)
        f_keep = lcp / len(cached) if len(cached) else -1.0
        sim = lcp / len(prompt)
        best = None
        for i, e in enumerate(self.entries if int(prompt[0]) in self.heads else ()):  # others share nothing
            lcp = common_prefix(e, prompt)
            fk, fs = lcp / len(e), lcp / len(prompt)
            if fk >= 0.25 and f_keep < fk and sim < fs:
                best, f_keep, sim = i, fk, fs
        return best

    def take(self, i: int) -> np.ndarray:
        """Entry `i` moves into a slot."""
        entry = self.entries.pop(i)
        del self.heads[i]
        self.restored_tokens += len(entry)
        self.num_tokens -= len(entry)
        return entry

    def evict(self) -> None:
        """update(): drop the oldest entries beyond the limit, always keeping one."""
        while len(self.entries) > 1 and self.num_tokens > self.limit_tokens:
            self.num_tokens -= len(self.entries.pop(0))
            self.heads.pop(0)

    def check_invariants(self) -> None:
        assert self.heads == [int(e[0]) for e in self.entries], "RAM cache heads out of step"
        assert self.num_tokens == sum(len(e) for e in self.entries), "RAM cache token count out of step"
        if len(self.entries) > 1:
            assert sum(len(e) for e in self.entries) <= self.limit_tokens, "RAM prompt cache over --cache-ram"
