"""Tests of the trace readers (simengine.workload.traces) on small hand-written files and the real traces."""

from __future__ import annotations

import csv
import json
import math
import sys
import time
import types
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simengine.errors import InputError
from simengine.workload.traces import (
    READERS,
    ReplayOptions,
    Trace,
    block_reuse_ratio,
    prompt_token_ids_from_hash_ids,
    read_azure,
    read_burstgpt,
    read_mooncake,
    read_sharegpt,
    read_trace,
)

TRACES = Path(__file__).resolve().parents[2].parent / "shared/data/traces"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"


def real(name: str) -> Path:
    p = TRACES / name
    if not p.is_file():
        pytest.skip(f"real trace {p} is not present")
    return p


def write(tmp_path: Path, name: str, text: str, newline: str = "\n") -> Path:
    p = tmp_path / name
    p.write_bytes(text.replace("\n", newline).encode("utf-8"))
    return p


def mooncake_line(ts, n_in, n_out, ids) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


def azure_seconds(stamps: list[str]) -> np.ndarray:
    """Seconds since the first stamp, computed with datetime (microseconds) plus the 7th fraction digit."""
    def parse(s: str) -> tuple[datetime, int]:
        date, frac = s.split(".")
        frac = frac.ljust(7, "0")
        return datetime.strptime(f"{date}.{frac[:6]}", "%Y-%m-%d %H:%M:%S.%f"), int(frac[6:7] or 0)

    d0, e0 = parse(stamps[0])
    out = []
    for s in stamps:
        d, e = parse(s)
        out.append((d - d0).total_seconds() + (e - e0) * 1e-7)
    return np.array(out)


# ---------------------------------------------------------------------------------------------- Azure


def test_azure_small_file_crlf_and_clamp(tmp_path):
    stamps = ["2023-11-16 18:15:46.6805900", "2023-11-16 18:15:50.9951690", "2023-11-16 18:15:50.9951691",
              "2023-11-16 23:59:59.9999999", "2023-11-17 00:00:01.0000000"]
    rows = [f"{s},{100 + i},{i}" for i, s in enumerate(stamps)]
    p = write(tmp_path, "az.csv", "\n".join([AZURE_HEADER, *rows]) + "\n", newline="\r\n")
    tr = read_azure(p, ReplayOptions())
    assert isinstance(tr, Trace) and len(tr) == 5
    assert tr.arrival_s.dtype == np.float64 and tr.input_tokens.dtype == np.int64
    np.testing.assert_allclose(tr.arrival_s, azure_seconds(stamps), rtol=0, atol=1e-9)
    assert tr.arrival_s[2] - tr.arrival_s[1] == pytest.approx(1e-7, abs=1e-12)
    assert tr.input_tokens.tolist() == [100, 101, 102, 103, 104]
    assert tr.output_tokens.tolist() == [1, 1, 2, 3, 4]          # 0 output clamped to 1
    assert tr.block_hash_ids is None and tr.hash_block_tokens == 0 and tr.source == str(p)
    assert not tr.arrival_s.flags.writeable


def test_azure_unsorted_rows_are_sorted_stably_and_formats(tmp_path):
    text = "\ufeff" + "\n".join([
        "timestamp , contexttokens,GeneratedTokens,Extra",
        "2024-05-10 00:00:02.5+00:00,3,30,x",
        "2024-05-10T00:00:00Z,1,10,y",
        "",
        "2024-05-10 02:00:02.5+02:00,2,20,z",      # = 00:00:02.5 UTC: ties with the first row
    ]) + "\n"
    tr = read_azure(write(tmp_path, "az.csv", text), ReplayOptions())
    assert tr.arrival_s.tolist() == [0.0, 2.5, 2.5]
    assert tr.input_tokens.tolist() == [1, 3, 2]


def test_azure_real_files_preserve_gaps():
    for name in ("AzureLLMInferenceTrace_code.csv", "AzureLLMInferenceTrace_conv.csv"):
        p = real(name)
        with open(p, newline="") as fh:
            rows = list(csv.reader(fh))[1:]
        tr = read_azure(p, ReplayOptions())
        assert len(tr) == len(rows)
        expected = azure_seconds([r[0] for r in rows])
        np.testing.assert_allclose(tr.arrival_s, expected, rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.diff(tr.arrival_s), np.diff(expected), rtol=0, atol=1e-6)
        assert tr.input_tokens.tolist() == [int(r[1]) for r in rows]
        assert tr.output_tokens.tolist() == [max(1, int(r[2])) for r in rows]


def test_azure_real_conv_reads_fast():
    p = real("AzureLLMInferenceTrace_conv.csv")
    read_azure(p, ReplayOptions())
    t = time.perf_counter()
    tr = read_azure(p, ReplayOptions())
    assert time.perf_counter() - t < 0.5
    assert len(tr) > 10_000


# ------------------------------------------------------------------------------------------- options


def small_azure(tmp_path, seconds=(0.0, 1.0, 2.0, 3.0, 5.0, 8.0)):
    base = datetime(2023, 11, 16, 18, 0, 0)
    rows = []
    for i, s in enumerate(seconds):
        whole = int(s)
        frac = round((s - whole) * 1e7)
        rows.append(f"{base.replace(second=whole):%Y-%m-%d %H:%M:%S}.{frac:07d},{10 + i},{20 + i}")
    return write(tmp_path, "az.csv", "\n".join([AZURE_HEADER, *rows]) + "\n")


def test_time_window(tmp_path):
    p = small_azure(tmp_path)
    tr = read_azure(p, ReplayOptions(start_s=1.0, end_s=5.0))
    assert tr.arrival_s.tolist() == [0.0, 1.0, 2.0]             # rows at 1, 2, 3 (5 is excluded)
    assert tr.input_tokens.tolist() == [11, 12, 13]
    tr = read_azure(p, ReplayOptions(start_s=2.5))
    assert tr.arrival_s.tolist() == [0.0, 2.0, 5.0]
    with pytest.raises(InputError, match="no requests") as err:
        read_azure(p, ReplayOptions(start_s=8.5))
    assert err.value.field == "start_s"


def test_time_scale_and_max_requests(tmp_path):
    p = small_azure(tmp_path)
    tr = read_azure(p, ReplayOptions(time_scale=2.0))
    assert tr.arrival_s.tolist() == [0.0, 0.5, 1.0, 1.5, 2.5, 4.0]
    tr = read_azure(p, ReplayOptions(time_scale=0.5, max_requests=3))
    assert tr.arrival_s.tolist() == [0.0, 2.0, 4.0]
    assert tr.output_tokens.tolist() == [20, 21, 22]
    tr = read_azure(p, ReplayOptions(start_s=3.0, time_scale=4.0, max_requests=100))
    assert tr.arrival_s.tolist() == [0.0, 0.5, 1.25]


def test_rate_scale_thinning_uses_rng(tmp_path):
    p = small_azure(tmp_path, seconds=tuple(0.25 * i for i in range(200)))
    full = read_azure(p, ReplayOptions())
    a = read_azure(p, ReplayOptions(rate_scale=0.5), np.random.default_rng(7))
    b = read_azure(p, ReplayOptions(rate_scale=0.5), np.random.default_rng(7))
    c = read_azure(p, ReplayOptions(rate_scale=0.5), np.random.default_rng(8))
    assert a.input_tokens.tolist() == b.input_tokens.tolist() != c.input_tokens.tolist()
    assert 60 < len(a) < 140
    kept = np.isin(full.input_tokens, a.input_tokens)
    np.testing.assert_allclose(a.arrival_s, full.arrival_s[kept] - full.arrival_s[kept][0])
    assert read_azure(p, ReplayOptions(rate_scale=0.5)).input_tokens.tolist() == \
        read_azure(p, ReplayOptions(rate_scale=0.5), None).input_tokens.tolist()


def test_rate_scale_replication_is_deterministic(tmp_path):
    p = small_azure(tmp_path)                                    # arrivals 0 1 2 3 5 8
    tr = read_azure(p, ReplayOptions(rate_scale=2.0))
    assert tr.arrival_s.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.5, 8.0, 8.0]
    assert tr.input_tokens.tolist() == [10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15]
    tr = read_azure(p, ReplayOptions(rate_scale=1.5))
    assert len(tr) == 9 and np.all(np.diff(tr.arrival_s) >= 0)
    tr = read_azure(p, ReplayOptions(rate_scale=3.0, max_requests=4))
    assert tr.arrival_s.tolist() == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])


@pytest.mark.parametrize("field,value", [
    ("start_s", -1.0), ("start_s", math.nan), ("start_s", math.inf), ("start_s", "0"), ("start_s", True),
    ("end_s", 0.0), ("end_s", -5.0), ("end_s", math.nan),
    ("time_scale", 0.0), ("time_scale", -2.0), ("time_scale", math.nan), ("time_scale", math.inf),
    ("rate_scale", 0.0), ("rate_scale", -0.5), ("rate_scale", math.nan), ("rate_scale", None),
    ("max_requests", 0), ("max_requests", -3), ("max_requests", 2.5), ("max_requests", True),
])
def test_options_are_validated(field, value):
    with pytest.raises(InputError) as err:
        ReplayOptions(**{field: value})
    assert err.value.field == field
    assert field in str(err.value)


def test_end_must_exceed_start():
    with pytest.raises(InputError, match="greater than start_s") as err:
        ReplayOptions(start_s=10.0, end_s=10.0)
    assert err.value.field == "end_s"
    ReplayOptions(start_s=1, end_s=math.inf, max_requests=np.int64(3))   # accepted


# ---------------------------------------------------------------------------------------- malformed


AZ_OK = "2023-11-16 18:15:46.6805900,374,44"


@pytest.mark.parametrize("text,line,field", [
    ("", 1, None),
    ("\n\n", 1, None),
    (AZURE_HEADER + "\n", 2, None),
    ("TIMESTAMP,ContextTokens\n" + "2023-11-16 18:15:46.6805900,374\n", 1, "GeneratedTokens"),
    (f"{AZURE_HEADER}\n{AZ_OK}\n2023-11-16 18:15:4x.1,1,1\n", 3, "TIMESTAMP"),
    (f"{AZURE_HEADER}\n{AZ_OK}\n2023-02-30 18:15:46.1,1,1\n", 3, "TIMESTAMP"),
    (f"{AZURE_HEADER}\n{AZ_OK}\n\n2023-11-16 25:15:46.1,1,1\n", 4, "TIMESTAMP"),
    (f"{AZURE_HEADER}\n{AZ_OK}\n{AZ_OK}\n2023-11-16 18:15:47.0,-5,1\n", 4, "ContextTokens"),
    (f"{AZURE_HEADER}\n{AZ_OK}\n2023-11-16 18:15:47.0,12,abc\n", 3, "GeneratedTokens"),
    (f"{AZURE_HEADER}\n{AZ_OK}\n2023-11-16 18:15:47.0,12,1.5\n", 3, "GeneratedTokens"),
    (f"{AZURE_HEADER}\n{AZ_OK}\n2023-11-16 18:15:47.0,12,\n", 3, "GeneratedTokens"),
    (f"{AZURE_HEADER}\n{AZ_OK}\n2023-11-16 18:15:47.0,12\n", 3, "GeneratedTokens"),
    (f"{AZURE_HEADER}\n{AZ_OK}\n2023-11-16 18:15:47.0,nan,3\n", 3, "ContextTokens"),
])
def test_azure_malformed(tmp_path, text, line, field):
    p = write(tmp_path, "bad.csv", text)
    with pytest.raises(InputError) as err:
        read_azure(p, ReplayOptions())
    assert err.value.source == f"{p}:{line}"
    assert err.value.field == field
    if field:
        assert field in str(err.value)


MC_OK = mooncake_line(0, 600, 10, [1, 2])


@pytest.mark.parametrize("text,line,field", [
    ("", 1, None),
    (f"{MC_OK}\n" + MC_OK[:-9] + "\n", 2, None),                                      # truncated line
    (f"{MC_OK}\n{MC_OK}\n\n" + MC_OK[:20], 4, None),                                  # truncated last line
    (f"{MC_OK}\n[1, 2]\n", 2, None),
    (f"{MC_OK}\n" + json.dumps({"timestamp": 1, "input_length": 5, "hash_ids": [1]}) + "\n", 2,
     "output_length"),
    (f"{MC_OK}\n{mooncake_line(5, 600, -1, [1, 2])}\n", 2, "output_length"),
    (f"{MC_OK}\n{mooncake_line(5, 0, 3, [])}\n", 2, "input_length"),
    (f"{MC_OK}\n{mooncake_line(5, '600', 3, [1, 2])}\n", 2, "input_length"),
    (f"{MC_OK}\n{mooncake_line(-5, 600, 3, [1, 2])}\n", 2, "timestamp"),
    (f"{MC_OK}\n{mooncake_line('x', 600, 3, [1, 2])}\n", 2, "timestamp"),
    (f"{MC_OK}\n{mooncake_line(5, 600, 3, [1])}\n", 2, "hash_ids"),                  # too few blocks
    (f"{MC_OK}\n{mooncake_line(5, 600, 3, [1, 2, 3])}\n", 2, "hash_ids"),            # too many blocks
    (f"{MC_OK}\n{MC_OK}\n{mooncake_line(5, 600, 3, [1, -2])}\n", 3, "hash_ids"),
    (f"{MC_OK}\n{MC_OK}\n{mooncake_line(5, 600, 3, [1, 2.5])}\n", 3, "hash_ids"),
    (f"{MC_OK}\n{mooncake_line(5, 600, 3, [1, 'a'])}\n{MC_OK}\n", 2, "hash_ids"),
    (f"{MC_OK}\n{mooncake_line(5, 600, 3, 7)}\n", 2, "hash_ids"),
])
def test_mooncake_malformed(tmp_path, text, line, field):
    p = write(tmp_path, "bad.jsonl", text)
    with pytest.raises(InputError) as err:
        read_mooncake(p, ReplayOptions())
    assert err.value.source == f"{p}:{line}"
    assert err.value.field == field


@pytest.mark.parametrize("text,line,field", [
    ("", 1, None),
    ("Timestamp,Model,Request tokens\n5,ChatGPT,12\n", 1, "Response tokens"),
    (f"{BURST_HEADER}\n5,ChatGPT,472,18,490,Conversation log\n6,ChatGPT,-1,18,17,API log\n", 3,
     "Request tokens"),
    (f"{BURST_HEADER}\n5,ChatGPT,472,18,490,Conversation log\nsoon,ChatGPT,1,18,19,API log\n", 3,
     "Timestamp"),
    (f"{BURST_HEADER}\n5,ChatGPT,472,18,490,Conversation log\n-4,ChatGPT,1,18,19,API log\n", 3, "Timestamp"),
    (f"{BURST_HEADER}\n5,ChatGPT,472,x,490,Conversation log\n", 2, "Response tokens"),
])
def test_burstgpt_malformed(tmp_path, text, line, field):
    p = write(tmp_path, "bad.csv", text)
    with pytest.raises(InputError) as err:
        read_burstgpt(p, ReplayOptions())
    assert err.value.source == f"{p}:{line}"
    assert err.value.field == field


def sharegpt_conv(cid, *turns):
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


@pytest.mark.parametrize("text,line,field", [
    ("", 1, None),
    ('[\n  {"id": "a", "conversations": []},\n  {"id": "b", "conv', 3, None),
    ('[\n  {"id": "a", "conversations": []},\n  {"id": "b"}\n]', 3, "conversations"),
    ('[\n  {"id": "a", "conversations": []}\n\n  {"id": "b"}\n]', 4, None),
    ('[{"id": "a", "conversations": []},\n {"id": "b", "conversations": [{"from": "robot", "value": "x"}]}]',
     2, "conversations[0].from"),
    ('[{"id": "a", "conversations": []},\n {"id": "b", "conversations": [{"from": "human", "value": 3}]}]',
     2, "conversations[0].value"),
    ('{"id": "a", "conversations": []}\n{"id": "b", "conversations": 5}\n', 2, "conversations"),
    ('"just a string"', 1, None),
])
def test_sharegpt_malformed(tmp_path, text, line, field):
    p = write(tmp_path, "bad.json", text)
    with pytest.raises(InputError) as err:
        read_sharegpt(p, ReplayOptions())
    assert err.value.source == f"{p}:{line}"
    assert err.value.field == field


@pytest.mark.parametrize("kind,text", [
    ("azure", AZURE_HEADER + "\n" + f"{AZ_OK}\n" * 2000 + "2023-11-16 18:15:47.0,1\xff2,3\n"),
    ("burstgpt", BURST_HEADER + "\n5,ChatGPT,472,18,490,Conversation log\n" * 2000 + "6,Chat\xffGPT,1,1,2,x\n"),
    ("mooncake", f"{MC_OK}\n" * 2000 + "{\"timestamp\": \xff}\n"),
    ("sharegpt", "[\n" + '{"conversations": []},\n' * 2000 + '{"conversations": "\xff"}]'),
], ids=["azure", "burstgpt", "mooncake", "sharegpt"])
def test_non_utf8_byte_names_its_line(tmp_path, kind, text):
    p = tmp_path / "bad.dat"
    p.write_bytes(text.encode("utf-8").replace("\xff".encode(), b"\xff"))
    with pytest.raises(InputError, match="not UTF-8") as err:
        read_trace(kind, p, ReplayOptions())
    assert err.value.source == f"{p}:{text.count(chr(10), 0, text.index(chr(255))) + 1}"


@pytest.mark.parametrize("kind", sorted(READERS))
def test_missing_file_names_default_location(tmp_path, kind):
    with pytest.raises(InputError) as err:
        read_trace(kind, tmp_path / "nope.dat", ReplayOptions())
    msg = str(err.value)
    assert "file not found" in msg and "nope.dat" in msg and "../shared/data/traces/" in msg
    assert "pass path:" in msg
    with pytest.raises(InputError, match="directory"):
        read_trace(kind, tmp_path, ReplayOptions())


def test_read_trace_unknown_kind_lists_valid():
    with pytest.raises(InputError) as err:
        read_trace("mooncak", "x", ReplayOptions())
    msg = str(err.value)
    assert "did you mean 'mooncake'" in msg
    assert "azure, burstgpt, mooncake, sharegpt" in msg


def test_read_trace_dispatches(tmp_path):
    p = small_azure(tmp_path)
    assert read_trace("Azure", p, None).input_tokens.tolist() == read_azure(p, ReplayOptions()).input_tokens.tolist()


# ------------------------------------------------------------------------------------------- Mooncake


def test_mooncake_small_file(tmp_path):
    lines = [mooncake_line(1000, 600, 10, [0, 1]), mooncake_line(3000, 1024, 0, [0, 1]),
             "", mooncake_line(2500, 513, 7, [5, 6])]
    p = write(tmp_path, "m.jsonl", "\n".join(lines) + "\n")
    tr = read_mooncake(p, ReplayOptions())
    assert tr.arrival_s.tolist() == [0.0, 1.5, 2.0]              # ms -> s, sorted
    assert tr.input_tokens.tolist() == [600, 513, 1024]
    assert tr.output_tokens.tolist() == [10, 7, 1]
    assert tr.hash_block_tokens == 512
    assert [h.tolist() for h in tr.block_hash_ids] == [[0, 1], [5, 6], [0, 1]]
    assert all(h.dtype == np.int64 for h in tr.block_hash_ids)
    # blocks: r0 (512 + 88) new; r1 (512 + 1) new; r2: both blocks seen before -> 1024 of 2137 tokens
    assert block_reuse_ratio(tr) == pytest.approx(1024 / (600 + 513 + 1024))
    assert tr == read_trace("mooncake", p, ReplayOptions()) and tr != read_mooncake(p, ReplayOptions(end_s=1.9))
    tr2 = read_mooncake(p, ReplayOptions(rate_scale=2.0))
    assert len(tr2) == 6 and block_reuse_ratio(tr2) > block_reuse_ratio(tr)


def test_block_reuse_ratio_needs_hash_ids(tmp_path):
    with pytest.raises(InputError, match="no block hash ids"):
        block_reuse_ratio(read_azure(small_azure(tmp_path), ReplayOptions()))


def independent_reuse_ratio(path: Path) -> float:
    seen: set[int] = set()
    reused = total = 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["timestamp"])                      # stable: ties keep file order
    for r in rows:
        n = r["input_length"]
        for i, h in enumerate(r["hash_ids"]):
            w = min(512, n - 512 * i)
            total += w
            if h in seen:
                reused += w
        seen.update(r["hash_ids"])
    return reused / total


@pytest.mark.parametrize("name", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def test_mooncake_real_reuse_ratio(name):
    p = real(name)
    tr = read_mooncake(p, ReplayOptions())
    assert len(tr) == sum(1 for line in p.read_text().splitlines() if line.strip())
    assert block_reuse_ratio(tr) == pytest.approx(independent_reuse_ratio(p), abs=1e-12)
    assert 0.0 < block_reuse_ratio(tr) < 1.0


def test_mooncake_real_prompt_tokens_match_hash_prefixes():
    tr = read_mooncake(real("conversation_trace.jsonl"), ReplayOptions(max_requests=200))
    toks = [prompt_token_ids_from_hash_ids(h, n, tr.hash_block_tokens)
            for h, n in zip(tr.block_hash_ids, tr.input_tokens)]
    assert [len(t) for t in toks] == tr.input_tokens.tolist()
    a, b = toks[0], toks[1]
    shared = 0
    while shared < min(len(tr.block_hash_ids[0]), len(tr.block_hash_ids[1])) and \
            tr.block_hash_ids[0][shared] == tr.block_hash_ids[1][shared]:
        shared += 1
    m = min(len(a), len(b))
    common = int(np.argmin(a[:m] == b[:m])) if not np.array_equal(a[:m], b[:m]) else m
    assert common == min(shared * 512, m)


# ----------------------------------------------------------------------------------- prompt token ids


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=6), st.lists(st.integers(0, 50), max_size=6),
       st.lists(st.integers(0, 50), max_size=6), st.integers(1, 16), st.data())
def test_prompt_token_prefix_property(shared, tail_a, tail_b, block, data):
    ha, hb = np.array(shared + tail_a, dtype=np.int64), np.array(shared + tail_b, dtype=np.int64)
    la = data.draw(st.integers(0, len(ha) * block))
    lb = data.draw(st.integers(0, len(hb) * block))
    ta = prompt_token_ids_from_hash_ids(ha, la, block)
    tb = prompt_token_ids_from_hash_ids(hb, lb, block)
    assert ta.dtype == np.int64 and len(ta) == la and len(tb) == lb
    lead = 0
    while lead < min(len(ha), len(hb)) and ha[lead] == hb[lead]:
        lead += 1
    assert common_prefix(ta, tb) == min(lead * block, la, lb)
    for i in range(-(-la // block)):                              # block i depends on hash_ids[i] only
        np.testing.assert_array_equal(ta[i * block:(i + 1) * block],
                                      (ha[i] * block + np.arange(block))[:la - i * block])


def test_prompt_token_ids_errors():
    h = np.array([3, 4], dtype=np.int64)
    assert prompt_token_ids_from_hash_ids(h, 5, 4).tolist() == [12, 13, 14, 15, 16]
    with pytest.raises(InputError, match="needs 3 blocks") as err:
        prompt_token_ids_from_hash_ids(h, 9, 4)
    assert err.value.field == "input_len"
    with pytest.raises(InputError):
        prompt_token_ids_from_hash_ids(np.array([-1]), 2, 4)
    with pytest.raises(InputError):
        prompt_token_ids_from_hash_ids(h, 4, 0)
    assert prompt_token_ids_from_hash_ids(np.array([]), 0, 4).tolist() == []


# ------------------------------------------------------------------------------------------- BurstGPT


def test_burstgpt_failed_rows_and_models(tmp_path):
    text = "\n".join([
        BURST_HEADER,
        "5,ChatGPT,472,0,472,Conversation log",            # failed: t0 still 5
        "45,ChatGPT,1087,230,1317,Conversation log",
        "118,GPT-4,417,276,693,Conversation log",
        "118.5,ChatGPT,0,12,12,API log",
    ]) + "\n"
    p = write(tmp_path, "b.csv", text)
    tr = read_burstgpt(p, ReplayOptions())
    assert tr.arrival_s.tolist() == [0.0, 73.0, 73.5]
    assert tr.input_tokens.tolist() == [1087, 417, 1]             # 0 request tokens clamped to 1
    assert tr.output_tokens.tolist() == [230, 276, 12]
    tr = read_burstgpt(p, ReplayOptions(), keep_failed=True)
    assert tr.output_tokens.tolist() == [1, 230, 276, 12] and tr.arrival_s[1] == 40.0
    tr = read_burstgpt(p, ReplayOptions(start_s=40.0, end_s=113.5))   # window is relative to row 1 (t0 = 5)
    assert tr.input_tokens.tolist() == [1087, 417]
    tr = read_trace("burstgpt", p, ReplayOptions(), models=["gpt-4"])
    assert tr.input_tokens.tolist() == [417]
    with pytest.raises(InputError, match="ChatGPT, GPT-4"):
        read_burstgpt(p, ReplayOptions(), models=["llama"])


def test_burstgpt_extra_columns(tmp_path):
    text = ("Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "1.0,abc,2.0,ChatGPT,10,20,30,Conversation log\n2.5,abc,1.0,ChatGPT,11,21,32,Conversation log\n")
    tr = read_burstgpt(write(tmp_path, "b3.csv", text), ReplayOptions())
    assert tr.arrival_s.tolist() == [0.0, 1.5] and tr.input_tokens.tolist() == [10, 11]


# ------------------------------------------------------------------------------------------- ShareGPT


def test_sharegpt_turns_become_requests(tmp_path):
    convs = [
        sharegpt_conv("a", ("human", "x" * 10), ("gpt", "y" * 7), ("human", "z" * 4), ("gpt", "")),
        sharegpt_conv("b", ("system", "s" * 8), ("human", "q" * 4), ("human", "r" * 5), ("gpt", "w" * 9),
                      ("human", "dangling")),
        sharegpt_conv("c", ("gpt", "hello"), ("human", "h" * 3)),
        {"id": "d", "conversations": []},
    ]
    p = write(tmp_path, "s.json", json.dumps(convs, indent=1))
    tr = read_sharegpt(p, ReplayOptions())
    # a: prompt 10 chars -> 3 tokens, reply 7 -> 2; then 3+2+1 = 6, reply '' -> 0 -> clamped 1
    # b: system 2 + q 1 + r 2 = 5, reply 9 chars -> 3
    assert tr.input_tokens.tolist() == [3, 6, 5]
    assert tr.output_tokens.tolist() == [2, 1, 3]
    assert tr.arrival_s.tolist() == [0.0, 0.0, 0.0]
    assert read_sharegpt(p, ReplayOptions(max_requests=2)).input_tokens.tolist() == [3, 6]
    assert read_sharegpt(p, ReplayOptions(), chars_per_token=1).input_tokens.tolist() == [10, 21, 17]
    jl = write(tmp_path, "s.jsonl", "\n".join(json.dumps(c) for c in convs))
    assert read_trace("sharegpt", jl, ReplayOptions()).input_tokens.tolist() == [3, 6, 5]
    with pytest.raises(InputError, match="no timestamps") as err:
        read_sharegpt(p, ReplayOptions(start_s=1.0))
    assert err.value.field == "start_s"


def test_sharegpt_tokenizer_fallback_and_local_only(tmp_path, monkeypatch):
    p = write(tmp_path, "s.json", json.dumps([sharegpt_conv("a", ("human", "one two three"), ("gpt", "four"))]))
    monkeypatch.setitem(sys.modules, "transformers", None)         # import fails
    with pytest.warns(UserWarning, match="not importable"):
        tr = read_sharegpt(p, ReplayOptions(), tokenizer="some/model")
    assert tr.input_tokens.tolist() == [4] and tr.output_tokens.tolist() == [1]

    calls = []

    class FakeTok:
        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return text.split()

    class AutoTokenizer:
        @staticmethod
        def from_pretrained(name, **kw):
            calls.append((name, kw))
            if name == "missing/model":
                raise OSError("not cached")
            return FakeTok()

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(AutoTokenizer=AutoTokenizer))
    tr = read_sharegpt(p, ReplayOptions(), tokenizer="fake/model")
    assert tr.input_tokens.tolist() == [3] and tr.output_tokens.tolist() == [1]
    with pytest.warns(UserWarning, match="not available locally"):
        tr = read_sharegpt(p, ReplayOptions(), tokenizer="missing/model")
    assert tr.input_tokens.tolist() == [4]
    assert calls == [("fake/model", {"local_files_only": True}), ("missing/model", {"local_files_only": True})]
    assert read_sharegpt(p, ReplayOptions()).input_tokens.tolist() == [4]  # no name: estimate, no call
    assert len(calls) == 2


def test_sharegpt_no_requests(tmp_path):
    p = write(tmp_path, "s.json", json.dumps([sharegpt_conv("a", ("gpt", "hi"))]))
    with pytest.raises(InputError, match="no requests"):
        read_sharegpt(p, ReplayOptions())
