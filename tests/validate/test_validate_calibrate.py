"""Calibration fits named terms only, recovers known terms from synthetic measurements, and writes provenance."""

import dataclasses
import shutil

import numpy as np
import pytest

from simengine.config.hardware import hardware_files, load_hardware_file
from simengine.cost import calibrated as terms
from simengine.errors import InputError
from simengine.validate import calibrate
from simengine.validate.calibration_io import write_engine_terms, write_hardware_calibration
from simengine.validate.fit import FitData
from simengine.validate.measurements import Arrival, Measurement
from simengine.validate.run import Prediction, run_row


@pytest.fixture(autouse=True)
def no_calibrated_terms(tmp_path, monkeypatch):
    monkeypatch.setattr(terms, "ENGINE_TERMS_PATH", tmp_path / "engine_terms.yaml")


def splitwise(metric: str, tp: int, batch: int, prompt: int) -> Measurement:
    return Measurement(id=f"sw-{metric}-{tp}-{batch}-{prompt}", source="s", engine="unknown", model="llama-2-70b",
                       weight_dtype="fp16", kv_dtype="fp16", hardware="a100_80g_sxm", num_gpus=tp, tp=tp, pp=1,
                       input_len=prompt, output_len=128, num_requests=batch, arrival=Arrival(kind="batch", value=batch),
                       metric=metric, value=1.0)


@pytest.fixture(scope="module")
def generic_rows() -> list[Prediction]:
    rows = [splitwise(m, tp, b, p) for m in ("prefill_ms", "decode_step_ms") for tp in (2, 4, 8)
            for b, p in ((1, 128), (1, 2048), (8, 512), (32, 512))]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(terms, "ENGINE_TERMS_PATH", terms.ENGINE_TERMS_PATH.with_name("__absent__.yaml"))
        return [run_row(r) for r in rows]


def with_measured(preds: list[Prediction], values: np.ndarray) -> list[Prediction]:
    return [dataclasses.replace(p, row=dataclasses.replace(p.row, value=float(v)))
            for p, v in zip(preds, values, strict=True)]


def test_fit_recovers_known_terms_from_synthetic_measurements(generic_rows):
    truth = {"layer_latency_s": 2e-4, "allreduce_hop_latency_s": 6e-6, "allreduce_bandwidth_fraction": 0.3,
             "seq_cpu_s": 3e-4}
    groups = {"a100_80g_sxm": "hw:a100_80g_sxm"}
    data = FitData(generic_rows, groups, {})
    measured = data.predict(np.array([0.6]), np.array([0.88]), {k: {0: v} for k, v in truth.items()})
    res = calibrate.fit(with_measured(generic_rows, measured), groups)
    assert res.values["hw:a100_80g_sxm.gemm_fraction"] == pytest.approx(0.6, rel=0.02)
    assert res.values["hw:a100_80g_sxm.memory_bandwidth_fraction"] == pytest.approx(0.88, rel=0.02)
    for k, v in truth.items():
        assert res.values[f"generic.{k}"] == pytest.approx(v, rel=0.1, abs=2e-7)
    assert np.max(np.abs(res.errors_pct())) < 0.5
    # only named terms exist: two fractions per hardware group, the engine's listed overhead terms
    assert {p.name for p in res.params} == {"gemm_fraction", "memory_bandwidth_fraction", *truth}


def test_calibration_writes_only_named_terms_with_provenance(tmp_path, generic_rows):
    src = hardware_files()["a100_80g_sxm"]
    path = tmp_path / src.name
    shutil.copy(src, path)
    before, text_before = load_hardware_file(path), path.read_text()
    write_hardware_calibration(path, 0.6123, 0.8812, {"source": "m.csv", "date": "2026-01-01", "rows": 24,
                                                      "scope": "device", "median_abs_error_pct": 3.1})
    after = load_hardware_file(path)
    changed = {f.name for f in dataclasses.fields(before) if getattr(before, f.name) != getattr(after, f.name)}
    assert changed == {"gemm_fraction", "memory_bandwidth_fraction"}
    assert (after.gemm_fraction, after.memory_bandwidth_fraction) == (0.6123, 0.8812)
    def body(text: str) -> list[str]:   # the file without the two efficiency lines and the provenance block
        return [ln for ln in text.split("\ncalibration:")[0].splitlines() if "_fraction:" not in ln]

    assert body(path.read_text()) == body(text_before)   # every other line (comments included) kept, in place
    assert path.read_text().count("\ncalibration:") == 1
    from simengine.config.hardware import HardwareYaml  # the strict loader accepts the provenance mapping
    from simengine.config.loader import from_dict, load_yaml
    y = from_dict(HardwareYaml, load_yaml(path), source=str(path))
    assert y.calibration["rows"] == 24 and y.calibration["scope"] == "device"
    write_hardware_calibration(path, 0.6, 0.88, {"rows": 25})   # re-calibrating replaces, never stacks
    text = path.read_text()
    assert text.count("calibration:") == 1 and text.count("before: 0.70") == 1


def test_engine_terms_yaml_round_trip_and_strict_names(tmp_path):
    p = tmp_path / "calibration.yaml"
    write_engine_terms({"generic": {"terms": {"layer_latency_s": 0.000212, "seq_cpu_s": 0.00034}, "rows": 150,
                                    "date": "2026-01-01"}}, p)
    assert terms.read_engine_terms(p) == {"generic": {"layer_latency_s": 0.000212, "seq_cpu_s": 0.00034}}
    p.write_text("engines:\n  vllm:\n    terms:\n      speedup: 1.3\n")
    with pytest.raises(InputError, match="unknown term"):
        terms.read_engine_terms(p)


def test_devices_with_few_rows_share_their_vendor(generic_rows):
    llama = [run_row(Measurement(id=f"ll-{hw}-{m}", source="s", engine="llamacpp", model="llama-2-7b",
                                 weight_dtype="q4_0", kv_dtype="fp16", hardware=hw, num_gpus=1, tp=1, pp=1,
                                 input_len=512 if m == "prefill_tok_s" else 0,
                                 output_len=0 if m == "prefill_tok_s" else 128, num_requests=None,
                                 arrival=Arrival(kind="single"), metric=m, value=1.0))
             for hw in ("apple_m2_ultra", "apple_m4_pro") for m in ("prefill_tok_s", "decode_tok_s")]
    groups = calibrate.hardware_groups(generic_rows + llama)
    assert groups == {"a100_80g_sxm": "hw:a100_80g_sxm", "apple_m2_ultra": "vendor:apple",
                      "apple_m4_pro": "vendor:apple"}
