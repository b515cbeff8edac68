"""The side-by-side table printed after a run (plain text, no dependencies beyond pandas)."""

from __future__ import annotations

import pandas as pd

COLUMNS = [  # (summary key, header, format)
    ("completed", "done", "{:.0f}"), ("failed", "fail", "{:.0f}"), ("unfinished", "unfin", "{:.0f}"),
    ("median_ttft_ms", "TTFT p50 ms", "{:.1f}"), ("p99_ttft_ms", "TTFT p99", "{:.1f}"),
    ("median_tpot_ms", "TPOT p50 ms", "{:.2f}"), ("p99_tpot_ms", "TPOT p99", "{:.2f}"),
    ("median_itl_ms", "ITL p50 ms", "{:.2f}"), ("p99_itl_ms", "ITL p99", "{:.2f}"),
    ("median_e2el_ms", "E2E p50 s", "{:.2f}"), ("request_throughput", "req/s", "{:.2f}"),
    ("output_throughput", "out tok/s", "{:.0f}"), ("request_goodput", "goodput", "{:.2f}"),
    ("mean_kv_usage", "KV use", "{:.0%}"), ("prefix_cache_hit_rate", "prefix hit", "{:.0%}"),
    ("preemptions", "preempt", "{:.0f}"), ("cost_per_1m_output_tokens_usd", "$/1M out", "{:.3f}"),
]


def side_by_side(summaries: dict[str, dict]) -> pd.DataFrame:
    """Engines as rows, the headline metrics as formatted columns."""
    rows = {}
    for label, s in summaries.items():
        row = {}
        for key, header, fmt in COLUMNS:
            v = s.get(key)
            if key == "median_e2el_ms" and v is not None:
                v = v / 1e3
            row[header] = "-" if v is None else fmt.format(v)
            if key == "cost_per_1m_output_tokens_usd" and v is not None and s.get("overloaded"):
                row[header] += OVERLOADED_MARK
        rows[label] = row
    return pd.DataFrame.from_dict(rows, orient="index")


OVERLOADED_MARK = "!"


def format_table(summaries: dict[str, dict]) -> str:
    """The table, and under it what a marked cost means."""
    text = side_by_side(summaries).to_string()
    if any(s.get("overloaded") for s in summaries.values()):
        text += (f"\n{OVERLOADED_MARK} overloaded (finishes fell behind arrivals, a backlog was left at the drain, or "
                 "requests were refused): the cost is a saturated deployment's, not that of serving the offered "
                 "rate; `simengine capacity` finds the rate it can serve")
    return text
