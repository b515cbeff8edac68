"""Length tables of benchmark datasets, for `{dist: empirical, table: NAME, mean: M}` (docs/scenarios.md).

A table is a cumulative distribution of token counts, knots (tokens, fraction of requests at or below). Sampling
is by inverse CDF, log-linear between knots (lengths spread over orders of magnitude). `mean` rescales the table so
the clipped sample has that mean: a source states the means of its own sample (tokenizer, seed, prompt count),
and the table gives the shape those means do not.

ShareGPT as benchmark clients sample it (vLLM `benchmark_serving.py` / `vllm bench serve` and
`sglang.bench_serving`, 2024): the first turn of each conversation is the prompt and the second the completion;
pairs with fewer than 4 tokens on either side, a prompt over 1024 tokens or prompt + completion over 2048 are
dropped; with `ignore_eos` every request generates its completion's length. No source publishes percentiles of
that sample, so the shape comes from server-side length histograms of SGLang servers fed by that client
(sgl-project/sglang docs `production_metrics.md` example, gemma-2-9b-it, 2104 requests; PR #1853's Llama-3.2
histogram agrees on the prompt side within one point) - a secondary source. It is far from lognormal: a quarter
of the prompts have 20 tokens or fewer while a sixth exceed 500. Means stated by sources: 202 in / 179 out
(vLLM v0.6.0 performance blog, 500 prompts, seed 0, Llama-3 tokenizer); 194.3 out (SGLang
benchmark_vllm_060 README: output tok/s over req/s of its 5000-prompt runs); about 247 / 233 with the Llama-2
tokenizer (LMDeploy a100_fp16.md: token throughput over request throughput). The prompt and completion are
drawn independently, each clipped to the sampler's bounds (the joint 2048 rule removes the rare pairs where
both are long).
"""

from __future__ import annotations

import functools
import math

import numpy as np

# name -> ((tokens, cumulative fraction), ...), first knot at fraction 0, last at 1
TABLES: dict[str, tuple[tuple[float, float], ...]] = {
    "sharegpt_input": ((4, 0.0), (5, 0.010), (10, 0.091), (20, 0.243), (50, 0.392), (100, 0.474), (200, 0.562),
                       (500, 0.831), (1000, 0.999), (1024, 1.0)),
    "sharegpt_output": ((4, 0.0), (5, 0.023), (10, 0.096), (20, 0.213), (50, 0.387), (100, 0.465), (200, 0.602),
                        (500, 0.895), (1000, 0.996), (2044, 1.0)),
}
# The means the ShareGPT sampler gives with a Llama-3 tokenizer (vLLM v0.6.0 blog), used when a source states none.
SHAREGPT_MEANS = (202.0, 179.0)
SHAREGPT_BOUNDS = {"input": (4, 1024), "output": (4, 2044)}
_GRID = 4096   # quadrature points for the clipped mean


def check_table(name: str) -> tuple[tuple[float, float], ...]:
    """The knots of a named table (ValueError listing the names)."""
    if name not in TABLES:
        raise ValueError(f"unknown length table '{name}'; valid: {', '.join(sorted(TABLES))}")
    return TABLES[name]


def _inverse(knots: tuple[tuple[float, float], ...], u: np.ndarray) -> np.ndarray:
    """Inverse CDF at probabilities u, log-linear between knots."""
    xs = np.log([k[0] for k in knots])
    fs = np.array([k[1] for k in knots])
    return np.exp(np.interp(u, fs, xs))


@functools.lru_cache(maxsize=256)
def scale_for_mean(name: str, mean: float, lo: float, hi: float) -> float:
    """The factor s such that E[clip(s * X, lo, hi)] = mean for X from the table (bisection on a fine grid)."""
    u = (np.arange(_GRID) + 0.5) / _GRID
    x = _inverse(check_table(name), u)
    if not lo < mean < hi:
        raise ValueError(f"mean {mean:g} must lie strictly between min {lo:g} and max {hi:g}")
    a, b = 1e-3, 1e3
    for _ in range(80):
        s = math.sqrt(a * b)
        if float(np.clip(s * x, lo, hi).mean()) < mean:
            a = s
        else:
            b = s
    return math.sqrt(a * b)


def sample_table(name: str, rng: np.random.Generator, n: int | None, *, scale: float, lo: float,
                 hi: float) -> np.ndarray | float:
    """Draws from the table, multiplied by `scale` and clipped to [lo, hi]."""
    u = rng.random(n)
    x = np.clip(scale * _inverse(check_table(name), np.atleast_1d(u)), lo, hi)
    return x if n is not None else float(x[0])
