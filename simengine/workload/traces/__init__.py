"""Readers that turn real request traces (Azure, Mooncake, BurstGPT, ShareGPT) into a common `Trace`.

    trace = read_trace("azure", "../shared/data/traces/AzureLLMInferenceTrace_conv.csv",
                       ReplayOptions(end_s=600, time_scale=2.0), rng=np.random.default_rng(0))

See docs/traces.md for each reader's column mapping and the replay options.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from simengine.errors import unknown_name
from simengine.workload.traces.azure import read_azure
from simengine.workload.traces.base import ReplayOptions, Trace, prompt_token_ids_from_hash_ids
from simengine.workload.traces.burstgpt import read_burstgpt
from simengine.workload.traces.mooncake import MOONCAKE_BLOCK_TOKENS, block_reuse_ratio, read_mooncake
from simengine.workload.traces.sharegpt import read_sharegpt

READERS: dict[str, Callable[..., Trace]] = {
    "azure": read_azure,
    "mooncake": read_mooncake,
    "burstgpt": read_burstgpt,
    "sharegpt": read_sharegpt,
}


def read_trace(kind: str, path: str | Path, options: ReplayOptions | None = None,
               rng: np.random.Generator | None = None, **reader_kwargs) -> Trace:
    """Read trace `path` with the reader for `kind` (one of READERS); extra keywords go to that reader
    (burstgpt: keep_failed, models; sharegpt: tokenizer, chars_per_token; mooncake: block_tokens)."""
    key = kind.strip().lower() if isinstance(kind, str) else kind
    if key not in READERS:
        raise unknown_name("trace kind", str(kind), READERS, field="kind")
    return READERS[key](path, options if options is not None else ReplayOptions(), rng, **reader_kwargs)


__all__ = [
    "MOONCAKE_BLOCK_TOKENS", "READERS", "ReplayOptions", "Trace", "block_reuse_ratio",
    "prompt_token_ids_from_hash_ids", "read_azure", "read_burstgpt", "read_mooncake", "read_sharegpt",
    "read_trace",
]
