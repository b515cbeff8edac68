"""KV tiers behind the GPU: host memory, and local disk behind it, full blocks by content hash, LRU each.

Blocks arrive by write-through (every block the GPU cache publishes is copied out: vLLM's OffloadingConnector,
SGLang HiCache's write_through) or when the GPU evicts them (TensorRT-LLM's secondary pool). A lookup continues a
GPU prefix hit block by block; what it finds is loaded back over the host link (the engine decides how: the request
waits for an asynchronous load, or the step carries the copy). The copies out use the link's other direction while
the GPU computes, so they cost no time here; the loads back do (sim/replica.py, cost/step.py). A third tier on local
disk (LMCache's local_disk) takes what the host tier evicts; a lookup continues there after the host tier, and what
it finds is read from disk before it crosses the host link.
"""

from __future__ import annotations

from collections import OrderedDict

from simengine.errors import InputError
from simengine.kvcache.hashing import block_hashes


class HostTier:
    """`capacity_blocks` blocks of host memory holding KV by block hash, least recently used evicted first."""

    def __init__(self, capacity_blocks: int, *, write_through: bool, prompt_only: bool = False):
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.write_through = write_through
        self.prompt_only = prompt_only   # write-through of prompt blocks only (LMCache without save_decode_cache)
        self.blocks: OrderedDict[int, None] = OrderedDict()   # block hash -> None, LRU first
        self.anonymous = 0       # blocks stored that no lookup can find (a request's private tokens): capacity only
        self.stored_blocks = 0   # blocks copied out
        self.hit_blocks = 0      # blocks found by lookups (loaded back)
        self.spill: HostTier | None = None   # the tier behind (disk): takes what this one evicts

    def __len__(self) -> int:
        return len(self.blocks) + self.anonymous

    def store(self, block_hash: int) -> None:
        blocks = self.blocks
        if block_hash in blocks:
            blocks.move_to_end(block_hash)
            return
        blocks[block_hash] = None
        self.stored_blocks += 1
        self._evict()

    def store_many(self, hashes) -> None:
        for h in hashes:
            self.store(h)

    def store_anonymous(self, n: int) -> None:
        """`n` blocks nobody can look up take host capacity (they push older blocks out, oldest anonymous first)."""
        if n > 0:
            self.anonymous += n
            self.stored_blocks += n
            self._evict()

    def _evict(self) -> None:
        over = len(self) - self.capacity_blocks
        if over <= 0:
            return
        drop = min(over, self.anonymous)   # anonymous blocks are as old as any: taken first (an approximation)
        self.anonymous -= drop
        blocks, spill = self.blocks, self.spill
        if spill is not None:
            spill.store_anonymous(drop)
        for _ in range(over - drop):
            h, _ = blocks.popitem(last=False)
            if spill is not None:
                spill.store(h)

    def match(self, hashes: list[int]) -> int:
        """How many of `hashes`, from the first, the tier holds in a row; those become the most recently used (a
        lookup touches them, as vLLM's get_num_new_matched_tokens does), so stores right after cannot evict them."""
        n = 0
        blocks = self.blocks
        for h in hashes:
            if h not in blocks:
                break
            blocks.move_to_end(h)
            n += 1
        return n

    def match_tiers(self, hashes: list[int]) -> tuple[int, int]:
        """(blocks found here, blocks found behind, on disk), in a row from the first of `hashes`."""
        here = self.match(hashes)
        behind = self.spill.match(hashes[here:]) if self.spill is not None and here < len(hashes) else 0
        return here, behind

    def stats(self, hit_tokens: int, block_bytes: float) -> dict:
        """The tier's figures for summary.json `kv_offload` (api.offload_section), with its disk tier's."""
        disk = self.spill
        return {"capacity_blocks": self.capacity_blocks, "blocks": len(self), "stored_blocks": self.stored_blocks,
                "loaded_blocks": self.hit_blocks, "hit_tokens": hit_tokens, "block_bytes": block_bytes,
                "disk_capacity_blocks": disk.capacity_blocks if disk else 0,
                "disk_loaded_blocks": disk.hit_blocks if disk else 0}

    def check_invariants(self) -> None:
        assert len(self) <= self.capacity_blocks, "host tier over capacity"
        assert self.anonymous >= 0
        if self.spill is not None:
            self.spill.check_invariants()


# ESTIMATE: a local NVMe SSD reads KV chunks at ~5 GB/s per GPU's share of the node's drives (a PCIe Gen4 x4 data-
# center drive reads 6.8-7 GB/s sequentially, e.g. Samsung PM9A3's datasheet; file-system and staging overheads) and
# ~100 us a read (NVMe read latency 70-100 us)
DISK_READ_BYTES_S = 5e9
DISK_READ_LATENCY_S = 100e-6


def host_tier(dep, bytes_per_device: float, block_size: int, *, write_through: bool, field: str,
              caching: bool = True, prompt_only: bool = False) -> HostTier:
    """An engine's host tier of `bytes_per_device` per device for blocks of `block_size` tokens of `dep`'s KV;
    InputError naming the engine's `field` when the device describes no host link, the prefix cache is off, or the
    tier holds no block."""
    hw = dep.hardware
    if not hw.host_link_bandwidth_bytes_s:
        raise InputError(f"KV offload needs {hw.name}'s link to host memory, which its YAML does not describe; add "
                         f"host_link: to hardware/{hw.vendor}/{hw.name}.yaml, or drop {field}", field=field)
    if not caching:
        raise InputError("KV offload keeps prefix-cache blocks: turn the prefix cache on, or drop it", field=field)
    blocks = int(bytes_per_device // (block_size * dep.kv_bytes_per_token_per_device))
    if blocks < 1:
        raise InputError(f"holds no {block_size}-token KV block of {dep.model.name}; give more memory", field=field)
    return HostTier(blocks, write_through=write_through, prompt_only=prompt_only)


class TokenHostTier:
    """A host tier behind a token radix cache (SGLang's HiCache, write-through): the tokens a request has in the
    tree are copied out in chunks of `chunk` tokens, keyed by the chained hash of the prefix through each chunk (a
    simulator granularity: SGLang's host pool pages are the device's), and a prompt continuing its device hit there
    loads the rest back unless under `threshold` tokens."""

    def __init__(self, tier: HostTier, chunk: int, threshold: int):
        self.tier, self.chunk, self.threshold = tier, chunk, threshold
        self.backed_up: dict[int, int] = {}   # request id -> its chunks copied out so far
        self.hit_tokens = 0

    def back_up(self, req, cached: int, *, done: bool = False) -> None:
        """The request has `cached` tokens in the tree: copy out the chunks not copied yet (`done`: it left)."""
        copied = self.backed_up.pop(req.request_id, 0) if done else self.backed_up.get(req.request_id, 0)
        upto = cached // self.chunk
        if upto > copied:
            self.tier.store_many(block_hashes(req, self.chunk)[copied:upto])
            if not done:
                self.backed_up[req.request_id] = upto

    def hit(self, req, cached: int) -> int:
        """Tokens past the device hit (`cached`) the tier holds, to one token short of the prompt; 0 under the
        threshold. A lookup: `loaded` records a load."""
        start, stop = cached // self.chunk, (req.num_tokens - 1) // self.chunk
        if stop <= start:
            return 0
        found = self.tier.match(block_hashes(req, self.chunk)[start:stop])
        tokens = (start + found) * self.chunk - cached if found else 0
        return tokens if tokens >= self.threshold else 0

    def loaded(self, tokens: int) -> None:
        self.hit_tokens += tokens
        self.tier.hit_blocks += -(-tokens // self.chunk)

    def stats(self, kv_bytes_per_token: float) -> dict:
        return self.tier.stats(self.hit_tokens, self.chunk * kv_bytes_per_token)
