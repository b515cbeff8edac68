"""Cache-aware routers: each keeps, per replica, an approximate index of the prompt prefixes it sent there (block
hashes of ROUTER_BLOCK_TOKENS tokens, least recently used dropped past a capacity), as the real routers do without
reading the engines' caches."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated

from simengine.config.loader import Checked, Range
from simengine.core.request import Request
from simengine.kvcache.hashing import hash_blocks
from simengine.routers.base import ROUTERS, ReplicaState, Router, least_loaded_of

ROUTER_BLOCK_TOKENS = 16   # the granularity of the routers' prefix match (vLLM's default block size)


class PrefixIndex:
    """Per replica: the prompt block hashes routed there, in LRU order, at most `capacity_blocks` each."""

    def __init__(self, num_replicas: int):
        self.blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    @staticmethod
    def hashes(req: Request, block_tokens: int = ROUTER_BLOCK_TOKENS) -> list[int]:
        return hash_blocks(req.token_ids[:req.prompt_len], block_tokens)

    def matched_blocks(self, replica: int, hashes: list[int]) -> int:
        """Leading blocks of the prompt this replica was sent (a chained hash: the first miss ends the prefix)."""
        index, n = self.blocks[replica], 0
        for h in hashes:
            if h not in index:
                break
            n += 1
        return n

    def insert(self, replica: int, hashes: list[int], capacity_blocks: int) -> None:
        index = self.blocks[replica]
        for h in hashes:
            index[h] = None
            index.move_to_end(h)
        while len(index) > capacity_blocks:
            index.popitem(last=False)


@dataclass(frozen=True, kw_only=True)
class PrefixAwareParams(Checked):
    """The SGLang router's cache_aware knobs, with its command-line defaults (sgl-model-gateway src/main.rs:
    --cache-threshold 0.3, --balance-abs-threshold 64, --balance-rel-threshold 1.5, --max-tree-size 2^26)."""

    cache_threshold: Annotated[float, Range(0, 1)] = 0.3
    balance_abs_threshold: Annotated[int, Range(0, 1_000_000)] = 64
    balance_rel_threshold: Annotated[float, Range(1, 1000)] = 1.5
    max_tree_size: Annotated[int, Range(1, 2**40, unit="tokens")] = 2**26


@ROUTERS.register("prefix_aware")
class PrefixAware(Router):
    """If the load is imbalanced (max - min > balance_abs_threshold and max > min * balance_rel_threshold), the
    least loaded replica. Otherwise the replica whose tree matches the largest share of the prompt if that share
    exceeds cache_threshold (one of equals at random), else the one with the smallest tree (the most room). The
    prompt joins the chosen tree."""

    Params = PrefixAwareParams
    source = "SGLang router (sgl-model-gateway) `--policy cache_aware`: policies/cache_aware.rs"

    def __init__(self, *args):
        super().__init__(*args)
        self.index = PrefixIndex(self.num_replicas)

    def choose(self, req: Request, replicas: list[ReplicaState]) -> int:
        p = self.params
        loads = [r.load for r in replicas]
        hashes = PrefixIndex.hashes(req)
        if max(loads) - min(loads) > p.balance_abs_threshold and max(loads) > min(loads) * p.balance_rel_threshold:
            pick = least_loaded_of(replicas)
        else:
            matched = [self.index.matched_blocks(r.index, hashes) for r in replicas]
            top = max(matched)
            share = top * ROUTER_BLOCK_TOKENS / max(req.prompt_len, 1)
            if share > p.cache_threshold:   # the longest match; equals (a shared system prompt) drawn at random
                best = [r.index for r, m in zip(replicas, matched) if m == top]
                pick = self.one_of(best)
            else:
                pick = min(replicas, key=lambda r: (len(self.index.blocks[r.index]), r.index)).index
        self.index.insert(pick, hashes, p.max_tree_size // ROUTER_BLOCK_TOKENS)
        return pick


@dataclass(frozen=True, kw_only=True)
class KvAwareParams(Checked):
    """Dynamo's KV router knob: `--kv-overlap-score-weight` (default 1; 0 ignores the cache)."""

    overlap_score_weight: Annotated[float, Range(0, 1000)] = 1.0


@ROUTERS.register("kv_aware")
class KvAware(Router):
    """The replica of least cost = overlap_score_weight x (prompt blocks it would have to compute) + (blocks its KV
    cache holds now), ties to the least loaded. The overlap comes from this router's index of the prompts it sent
    each replica, kept to that replica's KV capacity (least recently routed dropped first)."""

    Params = KvAwareParams
    source = ("NVIDIA Dynamo KV router (cost = overlap weight x prefill blocks + active decode blocks, temperature 0)"
              "; llm-d's prefix-cache scorer keeps the same kind of approximate per-pod index")

    def __init__(self, *args):
        super().__init__(*args)
        self.index = PrefixIndex(self.num_replicas)

    def choose(self, req: Request, replicas: list[ReplicaState]) -> int:
        hashes = PrefixIndex.hashes(req)
        prompt_blocks = -(-req.prompt_len // ROUTER_BLOCK_TOKENS)
        w = self.params.overlap_score_weight

        def cost(r: ReplicaState):
            active = r.kv_usage * r.kv_capacity_tokens / ROUTER_BLOCK_TOKENS
            return (w * (prompt_blocks - self.index.matched_blocks(r.index, hashes)) + active, r.load, r.index)

        pick = min(replicas, key=cost)
        self.index.insert(pick.index, hashes, max(1, pick.kv_capacity_tokens // ROUTER_BLOCK_TOKENS))
        return pick.index
