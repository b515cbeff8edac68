"""The measurements CSV reader: typed rows, and one-line errors that name the file line and the column."""

from pathlib import Path

import pytest

from simengine.errors import InputError
from simengine.validate.measurements import COLUMNS, read_measurements

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "validation" / "public_measurements.csv"
HEADER = ",".join(COLUMNS)
GOOD = ("splitwise-a100-l2_70b-tp8-p512-b4-t128-decode,src,unknown,llama-2-70b,fp16,fp16,a100_80g_sxm,8,8,1,512,128,4,"
        "batch:4,decode_step_ms,45.792,median of 5; SUSPECT: odd")
LLAMA = ("llamacpp-m2-pp2048-d32768,src,llamacpp,llama-2-7b,q4_0,fp16,apple_m2_ultra,1,1,1,2048,0,,single,"
         "prefill_tok_s,300,llama-bench pp2048 @ d32768; ctx_depth=32768")


def write(tmp_path, *lines: str) -> Path:
    p = tmp_path / "m.csv"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_rows_are_typed(tmp_path):
    rows = read_measurements(write(tmp_path, HEADER, GOOD, LLAMA))
    r, ll = rows
    assert (r.engine, r.tp, r.input_len, r.num_requests, r.metric, r.value) == ("unknown", 8, 512, 4, "decode_step_ms",
                                                                                 45.792)
    assert r.arrival.kind == "batch" and r.arrival.value == 4 and str(r.arrival) == "batch:4"
    assert "SUSPECT" in r.flags and r.line == 2
    assert ll.num_requests is None and ll.output_len == 0 and ll.ctx_depth == 32768 and ll.line == 3


@pytest.mark.parametrize("mutate, needle", [
    (lambda f: f[:16], "has 16 fields"),
    (lambda f: f[:8] + ["eight"] + f[9:], "tp: 'eight' is not an integer"),
    (lambda f: f[:14] + ["latency_ms"] + f[15:], "metric: 'latency_ms' is not one of"),
    (lambda f: f[:13] + ["poisson"] + f[14:], "arrival: 'poisson': poisson needs a number"),
    (lambda f: f[:13] + ["batch:2.5"] + f[14:], "positive integer"),
    (lambda f: f[:15] + ["-3"] + f[16:], "value: must be a finite number > 0"),
    (lambda f: ["Bad Id"] + f[1:], "id: 'Bad Id' must match"),
    (lambda f: f[:2] + ["deepspeed"] + f[3:], "engine: 'deepspeed' is not one of"),
    (lambda f: f[:7] + ["0"] + f[8:], "num_gpus: must be >= 1"),
])
def test_bad_row_names_line_and_column(tmp_path, mutate, needle):
    bad = ",".join(mutate(GOOD.split(",")))
    with pytest.raises(InputError) as err:
        read_measurements(write(tmp_path, HEADER, LLAMA, bad))
    msg = str(err.value)
    assert ":3:" in msg and needle in msg and "\n" not in msg


def test_header_duplicates_and_empty(tmp_path):
    with pytest.raises(InputError, match=r":1: header must be exactly id,source"):
        read_measurements(write(tmp_path, HEADER.replace("notes", "note"), GOOD))
    with pytest.raises(InputError, match=r":3: id: duplicate id .* \(first on line 2\)"):
        read_measurements(write(tmp_path, HEADER, GOOD, GOOD))
    with pytest.raises(InputError, match="no rows"):
        read_measurements(write(tmp_path, HEADER))
    with pytest.raises(InputError, match="file not found"):
        read_measurements(tmp_path / "missing.csv")


@pytest.mark.skipif(not SHARED.exists(), reason="shared calibration set not present")
def test_shared_calibration_set_parses():
    rows = read_measurements(SHARED)
    assert len(rows) == 212 and len({r.id for r in rows}) == 212


def test_serving_metrics_and_machine_readable_notes(tmp_path):
    line = ("s-a100-l3_8b-vllm,src,vllm,llama-3-8b,bf16,fp16,a100_80g_sxm,1,1,1,,,500,poisson:4,p90_itl_ms,16.6,"
            "vLLM (--max_model_len 4096); dataset=sharegpt (500 prompts; avg input 202 / output 179 tokens); "
            "max_num_seqs=512; bench=python -m sglang.bench_serving --dataset-name sharegpt")
    (r,) = read_measurements(write(tmp_path, HEADER, line))
    assert r.metric == "p90_itl_ms" and r.input_len is None and r.dataset == "sharegpt"
    assert r.note_items["max_num_seqs"] == "512" and r.note_int("max_num_seqs") == 512 and r.ctx_depth == 0
    flagged = r.__class__(**{**r.__dict__, "notes": "bench --dataset-name sonnet"})
    assert flagged.dataset == "sonnet"


def test_a_run_measured_as_output_and_request_throughput_implies_its_sample_mean_output(tmp_path):
    """Output over request throughput of one run is its sample's mean output tokens; every row of that source,
    dataset and model without stated means takes it (runs that disagree, or a stated mean, leave rows alone)."""
    def row(rid, engine, arrival, metric, value, model="llama-3.1-8b", notes="bench --dataset-name sharegpt"):
        return f"{rid},srcA,{engine},{model},bf16,fp16,a100_80g_sxm,1,1,1,,,1000,{arrival},{metric},{value},{notes}"
    lines = [row("a-req", "vllm", "offline", "request_throughput", 20.0),
             row("a-out", "vllm", "offline", "output_throughput_tok_s", 3880.0),
             row("b-req", "sglang", "offline", "request_throughput", 22.0),
             row("b-out", "sglang", "offline", "output_throughput_tok_s", 22.0 * 196.0),
             row("c-ttft", "vllm", "poisson:4", "median_ttft_ms", 50.0),
             row("d-ttft", "vllm", "poisson:4", "median_ttft_ms", 50.0,
                 notes="dataset=sharegpt (avg input 202 / output 179 tokens)"),
             row("e-ttft", "vllm", "poisson:4", "median_ttft_ms", 50.0, model="llama-3.1-70b")]
    by_id = {r.id: r for r in read_measurements(write(tmp_path, HEADER, *lines))}
    assert by_id["c-ttft"].implied_output_mean == pytest.approx((194.0 + 196.0) / 2)
    assert by_id["a-req"].implied_output_mean == by_id["c-ttft"].implied_output_mean
    assert by_id["e-ttft"].implied_output_mean is None          # another model: another tokenizer's sample
    from simengine.validate.experiments import row_lengths
    _, out, note = row_lengths(by_id["c-ttft"])
    assert out["mean"] == pytest.approx(195.0) and "implies" in note
    _, out, _ = row_lengths(by_id["d-ttft"])                    # stated means win
    assert out["mean"] == 179.0
    lines[3] = row("b-out", "sglang", "offline", "output_throughput_tok_s", 22.0 * 250.0)   # runs disagree
    assert all(r.implied_output_mean is None for r in read_measurements(write(tmp_path, HEADER, *lines)))
