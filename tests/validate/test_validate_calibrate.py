"""Calibration fits named terms only, recovers known terms from synthetic measurements, keeps priors where the rows
say nothing, and writes provenance."""

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

DEVICE = "mi300x"   # no measured kernel tables: the roofline prices its rows, so its terms are fitted


@pytest.fixture(autouse=True)
def no_calibrated_terms(tmp_path, monkeypatch):
    monkeypatch.setattr(terms, "ENGINE_TERMS_PATH", tmp_path / "engine_terms.yaml")


def profile_row(metric: str, tp: int, batch: int, prompt: int, model: str = "llama-2-70b") -> Measurement:
    return Measurement(id=f"p-{model}-{metric}-{tp}-{batch}-{prompt}", source="s", engine="unknown", model=model,
                       weight_dtype="fp16", kv_dtype="fp16", hardware=DEVICE, num_gpus=tp, tp=tp, pp=1,
                       input_len=prompt, output_len=128, num_requests=batch, arrival=Arrival(kind="batch", value=batch),
                       metric=metric, value=1.0)


@pytest.fixture(scope="module")
def generic_rows() -> list[Prediction]:
    rows = [profile_row(m, tp, b, p, model) for m in ("prefill_ms", "decode_step_ms")
            for model, tps in (("llama-2-70b", (2, 4, 8)), ("llama-2-7b", (1, 2))) for tp in tps
            for b, p in ((1, 128), (1, 2048), (8, 512), (32, 512))]   # two depths: per-layer and per-step terms part
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(terms, "ENGINE_TERMS_PATH", terms.ENGINE_TERMS_PATH.with_name("__absent__.yaml"))
        return [run_row(r) for r in rows]


def with_measured(preds: list[Prediction], values: np.ndarray) -> list[Prediction]:
    return [dataclasses.replace(p, row=dataclasses.replace(p.row, value=float(v)))
            for p, v in zip(preds, values, strict=True)]


def test_fit_recovers_known_terms_from_synthetic_measurements(generic_rows, monkeypatch):
    groups = calibrate.hardware_groups(generic_rows)
    assert groups == {DEVICE: f"hw:{DEVICE}"}
    data = FitData(generic_rows, groups)
    params = calibrate._device_params(data, groups) + calibrate._engine_params(generic_rows)
    names = {p.name for p in params}
    assert names == {"gemm_fraction.default", "memory_bandwidth_fraction", "kernel_floor_s", "scheduler_cpu_s",
                     "seq_cpu_s", "kernel_launch_s"}
    truth = {"gemm_fraction.default": 0.45, "memory_bandwidth_fraction": 0.7, "kernel_floor_s": 4e-6,
             "scheduler_cpu_s": 2e-3, "seq_cpu_s": 3e-4, "kernel_launch_s": 3e-6}
    measured = data.predict(params, np.array([truth[p.name] for p in params]))
    monkeypatch.setattr(calibrate, "PRIOR_SD_DEVICE", 1e6)   # no pull: the data alone must pin every term
    monkeypatch.setattr(calibrate, "PRIOR_SD_ENGINE", 1e6)
    res = calibrate.fit(with_measured(generic_rows, measured), groups)
    for p in res.params:
        if p.name == "kernel_launch_s":   # an eager step is max(GPU, launches): below the GPU time no row sees it
            continue
        rel = 0.25 if p.name == "kernel_floor_s" else 0.05
        assert res.values[p.key] == pytest.approx(truth[p.name], rel=rel, abs=2e-7), p.key
    assert np.max(np.abs(res.errors_pct())) < 0.5


def test_priors_hold_where_the_rows_say_nothing(generic_rows):
    """Measurements the priors already predict leave every term at its prior."""
    groups = calibrate.hardware_groups(generic_rows)
    data = FitData(generic_rows, groups)
    res = calibrate.fit(with_measured(generic_rows, data.predict([], np.array([]))), groups)
    for p in res.params:
        assert res.values[p.key] == pytest.approx(p.prior, rel=1e-3, abs=1e-9), p.key


def test_devices_priced_by_measured_kernels_are_not_fitted_and_few_rows_share_their_vendor(generic_rows):
    from simengine.cost.measured import data_root

    def row(hw, engine, model, wd, m):
        return Measurement(id=f"x-{hw}-{m}", source="s", engine=engine, model=model, weight_dtype=wd,
                           kv_dtype="fp16", hardware=hw, num_gpus=1, tp=1, pp=1,
                           input_len=512 if m == "prefill_tok_s" else 0,
                           output_len=0 if m == "prefill_tok_s" else 128, num_requests=None,
                           arrival=Arrival(kind="single"), metric=m, value=1.0)
    llama = [run_row(row(hw, "llamacpp", "llama-2-7b", "q4_0", m)) for hw in ("apple_m2_ultra", "apple_m4_pro")
             for m in ("prefill_tok_s", "decode_tok_s")]
    h100 = [run_row(row("h100_sxm", "vllm", "llama-3.1-8b", "bf16", m)) for m in ("prefill_tok_s", "decode_tok_s")]
    groups = calibrate.hardware_groups(generic_rows + llama + h100)
    expect = {DEVICE: f"hw:{DEVICE}", "apple_m2_ultra": "vendor:apple", "apple_m4_pro": "vendor:apple"}
    if data_root() is None:   # without the tables the roofline prices the H100 rows too
        expect["h100_sxm"] = "vendor:nvidia"
    assert groups == expect


def test_calibration_writes_only_named_terms_with_provenance(tmp_path):
    src = hardware_files()[DEVICE]
    path = tmp_path / src.name
    shutil.copy(src, path)
    before, text_before = load_hardware_file(path), path.read_text()
    values = {"gemm_fraction.default": 0.6123, "memory_bandwidth_fraction": 0.8812, "kernel_floor_s": 3.5e-6}
    write_hardware_calibration(path, values, {"source": "m.csv", "date": "2026-01-01", "rows": 24,
                                              "scope": "device", "median_abs_error_pct": 3.1,
                                              "prior_gemm_fraction.default": 0.54})
    after = load_hardware_file(path)
    assert after.calibration_priors == {"gemm_fraction.default": 0.54}   # a refit starts from the prior again
    changed = {f.name for f in dataclasses.fields(before) if getattr(before, f.name) != getattr(after, f.name)}
    assert changed == {"gemm_fractions", "memory_bandwidth_fraction", "kernel_floor_s", "calibration_priors"}
    assert after.gemm_fraction("bf16") == 0.6123 and after.memory_bandwidth_fraction == 0.8812
    assert after.kernel_floor_s == pytest.approx(3.5e-6)
    assert after.gemm_fractions.keys() == before.gemm_fractions.keys()

    def body(text: str) -> list[str]:   # the file without the edited lines and the provenance block
        return [ln for ln in text.split("\ncalibration:")[0].splitlines()
                if not any(k in ln for k in ("_fraction:", "default:", "kernel_floor_us:"))]

    assert body(path.read_text()) == body(text_before)   # every other line (comments included) kept, in place
    from simengine.config.hardware import HardwareYaml  # the strict loader accepts the provenance mapping
    from simengine.config.loader import from_dict, load_yaml
    y = from_dict(HardwareYaml, load_yaml(path), source=str(path))
    assert y.calibration["rows"] == 24 and y.calibration["scope"] == "device"
    write_hardware_calibration(path, values, {"rows": 25})   # re-calibrating replaces, never stacks
    text = path.read_text()
    assert text.count("calibration:") == 1 and text.count("before:") == len(values)


def test_engine_terms_yaml_round_trip_and_strict_names(tmp_path):
    p = tmp_path / "calibration.yaml"
    write_engine_terms({"generic": {"terms": {"scheduler_cpu_s": 0.000212, "seq_cpu_s": 0.00034}, "rows": 150,
                                    "date": "2026-01-01"}}, p)
    assert terms.read_engine_terms(p) == {"generic": {"scheduler_cpu_s": 0.000212, "seq_cpu_s": 0.00034}}
    p.write_text("engines:\n  vllm:\n    terms:\n      speedup: 1.3\n")
    with pytest.raises(InputError, match="unknown term"):
        terms.read_engine_terms(p)


def test_priors_only_puts_back_every_device_prior_an_earlier_write_replaced():
    """Calibration and leave-one-device-out start from published priors, never from a fit an earlier --write left
    in a YAML."""
    from simengine.config.hardware import load_hardware

    trial = calibrate.priors_only()
    assert trial["engines"] == {}
    for name in hardware_files():
        assert trial["devices"].get(name, {}) == load_hardware(name).calibration_priors
    for name, priors in trial["devices"].items():
        hw = terms.apply_device_terms(load_hardware(name), priors)
        for term, value in priors.items():
            got = hw.gemm_fractions[term.split(".", 1)[1]] if term.startswith("gemm_fraction.") else getattr(hw, term)
            assert got == value, (name, term)


def test_trial_terms_give_a_pooled_device_only_the_gemm_fractions_it_has():
    """A vendor pool fits an fp8 fraction for its FP8 members; a member without an fp8 entry priced its steps at
    `default`, so the trial terms (judge_on, fit_frontend) must not hand it one."""
    from simengine.config.hardware import load_hardware

    group = "vendor:nvidia"
    params = [calibrate.Param(group, "gemm_fraction.default", 0.1, 1.0, 0.5, 0.8),
              calibrate.Param(group, "gemm_fraction.fp8", 0.1, 1.0, 0.5, 0.6)]
    res = calibrate.FitResult(params, {p.key: 0.5 for p in params}, {"h100_sxm": group, "rtx_3090": group},
                              np.zeros(0), [])
    devices = calibrate.trial_terms(res)["devices"]
    assert "fp8" in load_hardware("h100_sxm").gemm_fractions and "fp8" not in load_hardware("rtx_3090").gemm_fractions
    assert set(devices["h100_sxm"]) == {"gemm_fraction.default", "gemm_fraction.fp8"}
    assert set(devices["rtx_3090"]) == {"gemm_fraction.default"}


def test_a_term_no_row_sees_is_reported_and_left_at_its_prior(generic_rows):
    """An eager step lasts max(GPU time, launches): where every step's GPU time exceeds its launches the launch
    term changes no row, so the fit leaves it at its prior, says so, and does not hand it on as fitted."""
    rows = [p for p in generic_rows if p.row.model == "llama-2-70b" and p.row.tp == 2]
    groups = calibrate.hardware_groups(rows)
    data = FitData(rows, groups)
    res = calibrate.fit(with_measured(rows, 1.2 * data.predict([], np.array([]))), groups)
    key = "generic.kernel_launch_s"
    prior = next(p.prior for p in res.params if p.key == key)
    assert res.unseen == {key}
    assert res.values[key] == prior
    terms = calibrate.engine_terms_of(res)["generic"]   # the terms the rows do see moved: the steps are 20 % longer
    assert "kernel_launch_s" not in terms
    assert terms["scheduler_cpu_s"] > next(p.prior for p in res.params if p.key == "generic.scheduler_cpu_s")
    line = next(ln for ln in calibrate.format_fit(res, None, len(rows)).splitlines() if ln.startswith(key))
    assert "no row sees it" in line


def test_a_term_the_fit_could_not_see_gets_the_device_prior_and_its_source_back(tmp_path):
    """A vendor pool averages its members' priors for a term; when no row sees that term the average is no
    measurement, so writing puts each device's own prior back, with the source comment an earlier write wrapped."""
    src = hardware_files()[DEVICE]
    path = tmp_path / src.name
    shutil.copy(src, path)
    before = load_hardware_file(path)
    prior = before.gemm_fraction("bf16")
    write_hardware_calibration(path, {"gemm_fraction.default": 0.5, "memory_bandwidth_fraction": 0.6},
                               {"date": "2026-01-01", "scope": "amd vendor pool: a b", "rows": 3})
    text = path.read_text()
    assert "calibrated 2026-01-01" in text and load_hardware_file(path).gemm_fraction("bf16") == 0.5
    write_hardware_calibration(path, {"memory_bandwidth_fraction": 0.61},
                               {"date": "2026-01-02", "scope": "device", "rows": 4},
                               priors={"gemm_fraction.default": prior})
    after = load_hardware_file(path)
    assert after.gemm_fraction("bf16") == prior and after.memory_bandwidth_fraction == 0.61
    line = next(ln for ln in path.read_text().splitlines() if ln.strip().startswith("default:"))
    original = next(ln for ln in src.read_text().splitlines() if ln.strip().startswith("default:"))
    assert line.split() == original.split()   # the device's own value and source comment, as shipped
