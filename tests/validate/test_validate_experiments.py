"""Row -> experiment mapping: engine, deployment, arrival, benchmark-tool knobs, and skips with reasons."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from simengine.validate.bench_tools import trtllm_bench_params
from simengine.validate.experiments import ENGINE_OF_ROW, Experiment, Skip, plan_row
from simengine.validate.measurements import Arrival, Measurement
from simengine.validate.run import run_row


def row(**kw) -> Measurement:
    base = dict(id="r", source="s", engine="unknown", model="llama-2-70b", weight_dtype="fp16", kv_dtype="fp16",
                hardware="a100_80g_sxm", num_gpus=4, tp=4, pp=1, input_len=512, output_len=128, num_requests=2,
                arrival=Arrival(kind="batch", value=2), metric="prefill_ms", value=250.0, notes="")
    base.update(kw)
    return Measurement(**base)


def test_unknown_engine_maps_to_generic_step_experiment():
    exp = plan_row(row())
    assert isinstance(exp, Experiment)
    assert exp.kind == "step" and exp.engine == "generic" and exp.batch == 2
    d = exp.scenario.deployment
    assert (d.hardware, d.model, d.tp, d.pp, d.replicas, d.kv_dtype) == ("a100_80g_sxm", "llama-2-70b", 4, 1, 1, "fp16")


def test_offline_throughput_row_with_data_parallel_replicas():
    exp = plan_row(row(engine="vllm", model="llama-3.1-8b", weight_dtype="bf16", hardware="h100_sxm", num_gpus=8,
                       tp=2, num_requests=1000, arrival=Arrival(kind="offline"), metric="output_throughput_tok_s"))
    assert exp.kind == "sim" and exp.engine == "vllm" and exp.full_requests == 1000
    assert exp.scenario.deployment.replicas == 4
    wl = exp.scenario.workload
    assert wl.arrival.process == "offline" and wl.input_tokens.value == 512 and wl.output_tokens.value == 128


@pytest.mark.parametrize("arrival, process", [(Arrival(kind="poisson", value=2.5), "poisson"),
                                              (Arrival(kind="concurrency", value=16), "closed_loop"),
                                              (Arrival(kind="single"), "closed_loop")])
def test_online_arrivals(arrival, process):
    exp = plan_row(row(engine="vllm", model="llama-3.1-8b", hardware="h100_sxm", num_gpus=1, tp=1, arrival=arrival,
                       metric="mean_ttft_ms", num_requests=50))
    assert exp.scenario.workload.arrival.process == process and exp.scenario.workload.num_requests == 50
    if process == "closed_loop":
        assert exp.scenario.workload.arrival.concurrency == (16 if arrival.kind == "concurrency" else 1)


@pytest.mark.parametrize("kw, reason", [
    (dict(engine="mlc-llm-x"), None),  # rejected by the reader's engine list; here: a registry miss
    (dict(tp=0), "tp/pp not stated"),
    (dict(num_gpus=6), "not a multiple of tp*pp"),
    (dict(input_len=None, notes="dataset=openorca (MLPerf)"), "input_len not stated (openorca: simengine bundles"),
    (dict(metric="decode_step_ms", arrival=Arrival(kind="offline")), "needs arrival single or batch"),
    (dict(hardware="tpu_v5"), "unknown hardware 'tpu_v5'"),
])
def test_rows_that_cannot_run_are_skipped_with_a_reason(kw, reason):
    r = row(**kw)
    res = run_row(r)
    assert isinstance(res, Skip)
    assert reason is None or reason in res.reason, res.reason


def test_unsupported_dtype_and_unfit_model_are_skipped():
    fp8 = run_row(row(weight_dtype="fp8"))        # no FP8 tensor cores on Ampere
    assert isinstance(fp8, Skip) and "fp8" in fp8.reason
    big = run_row(row(model="llama-3.1-405b", num_gpus=1, tp=1))
    assert isinstance(big, Skip) and "does not fit" in big.reason
    apple = run_row(row(engine="trtllm", hardware="apple_m2_ultra", model="llama-2-7b", num_gpus=1, tp=1))
    assert isinstance(apple, Skip)


def test_trtllm_bench_settings_follow_the_tool_heuristic():
    r = row(engine="trtllm", model="llama-3.1-8b", weight_dtype="fp8", kv_dtype="fp8", hardware="h100_sxm",
            num_gpus=1, tp=1, input_len=128, output_len=128, notes="trtllm-bench throughput")
    p = trtllm_bench_params(r)
    # 8B FP8 on 80 GB: ~4150 requests of 256 tokens fit -> capped at 4096, 256-aligned; tokens 4096*(1+1)
    assert p["max_batch_size"] == 4096 and p["max_num_tokens"] == 8192
    long = trtllm_bench_params(dataclasses.replace(r, input_len=20000, output_len=2000))
    assert long["max_num_tokens"] >= 20000 + long["max_batch_size"]   # chunking off: max ISL must fit
    exp = plan_row(dataclasses.replace(r, arrival=Arrival(kind="offline"), metric="output_throughput_tok_s",
                                       num_requests=3000))
    assert exp.params["max_batch_size"] == 4096 and "trtllm-bench settings" in exp.notes[0]


def test_sharegpt_rows_run_the_length_table_at_the_stated_or_tokenizer_means():
    from simengine.validate.experiments import row_lengths

    base = dict(input_len=None, output_len=None, model="llama-3.1-8b", metric="request_throughput",
                arrival=Arrival(kind="offline"))
    inp, out, note = row_lengths(row(**base, notes="dataset=sharegpt (500 prompts; avg input 202 / output 179)"))
    assert (inp["table"], inp["mean"], out["table"], out["mean"]) == ("sharegpt_input", 202, "sharegpt_output", 179)
    _, out2, note2 = row_lengths(row(**{**base, "model": "llama-2-7b"}, notes="dataset=sharegpt (3000 prompts)"))
    assert out2["mean"] == 233 and "32k-vocabulary" in note2
    inp3, out3, _ = row_lengths(row(**base, notes="dataset=sonnet-synthetic (500 prompts; ~462 input / 16 output)"))
    assert (inp3, out3) == ({"dist": "constant", "value": 462.0}, {"dist": "constant", "value": 16.0})
    assert "not stated" in row_lengths(row(**base, notes="dataset=openorca"))


def test_engine_flags_quoted_in_the_notes_become_params():
    from simengine.validate.bench_tools import engine_params

    r = row(engine="sglang", notes="SGLang (--disable-radix-cache --mem-frac 0.88 --enable-torch-compile "
                                   "--max-torch-compile-bs 16 --enable-nan-detection); bench=sglang.bench_serving "
                                   "--backend sglang --dataset-name sharegpt")
    params, note = engine_params(r, "sglang")
    assert params == {"disable_radix_cache": True, "mem_fraction_static": 0.88, "enable_torch_compile": True,
                      "torch_compile_max_bs": 16}
    assert "not modelled: --enable-nan-detection" in note and "--backend" not in note
    params, _ = engine_params(row(engine="vllm", notes="vLLM (--max_model_len 4096); max_num_seqs=512"), "vllm")
    assert params == {"max_model_len": 4096, "max_num_seqs": 512}
    params, _ = engine_params(row(engine="vllm", notes="vllm serve m --block-size 64 --enforce-eager"), "vllm")
    assert params == {"block_size": 64, "enforce_eager": True}   # a Literal knob takes its values' type
    served = "vllm serve m --no-enable-prefix-caching --gpu-memory-util=0.85; vllm bench serve --max-concurrency 8"
    params, note = engine_params(row(engine="vllm", notes=served), "vllm")
    assert params == {"enable_prefix_caching": False, "gpu_memory_utilization": 0.85}   # argparse's --no- and prefix
    assert "not modelled" not in note                                                   # the client's flags


OLD_VLLM_MEMORY = {"gpu_memory_utilization": 0.9, "memory_profiler_estimate_cudagraphs": False}


@pytest.mark.parametrize("engine, notes, expect", [
    ("vllm", "vLLM v0.6.0 --num-scheduler-steps 10",
     {"use_v1": False, "async_scheduling": False, "num_scheduler_steps": 10, **OLD_VLLM_MEMORY}),
    ("vllm", "vLLM v0.7.3", {"use_v1": False, "async_scheduling": False, **OLD_VLLM_MEMORY}),
    ("vllm", "vLLM v0.8.0", {"async_scheduling": False, **OLD_VLLM_MEMORY}),   # V1 the default from v0.8.0
    ("vllm", "vLLM v0.11.0", {"async_scheduling": False, **OLD_VLLM_MEMORY}),
    ("vllm", "vLLM v0.20.1", OLD_VLLM_MEMORY),   # PR #38284's CUDA-graph accounting and 0.92 first shipped in v0.21.0
    ("vllm", "vLLM v0.21.0", {}),
    ("vllm", "vLLM v0.33.0", {}),
    ("sglang", "SGLang v0.3.0 (--disable-radix-cache)",
     {"disable_overlap_schedule": True, "disable_radix_cache": True, "mem_fraction_static": 0.85}),   # TP4
    ("sglang", "SGLang v0.4.6.post5", {"mem_fraction_static": 0.85}),   # the TP ladder until PR #7054 (v0.4.7)
    ("sglang", "SGLang v0.5.5.post1", {}),
    ("sglang", "SGLang v0.4.7rc1", {}),   # a pre-release of 0.4.7 has PR #7054's rule
    ("sglang", "SGLang v0.3.0 --mem-frac 0.88 --tp 4", {"disable_overlap_schedule": True, "mem_fraction_static": 0.88}),
    ("tgi", "TGI 2.1 (ghcr.io/huggingface/text-generation-inference:2.1)",
     {"prefill_chunking": False, "prefix_caching": False}),
    ("trtllm", "TensorRT-LLM r24.07 (Triton trtllm backend v0.11)", {"disable_overlap_scheduler": True}),
    ("lmdeploy", "lmdeploy v0.6.0a0", {"async_": 0, "max_batch_size": 128}),   # a pre-release sorts before 0.6.0
    ("lmdeploy", "lmdeploy v0.6.0", {"async_": 0}),
    ("lmdeploy", "lmdeploy v0.1.0a1 TurboMind",
     {"async_": 0, "decode_attention_kernel": "decoder_multihead_attention", "prefill_passes": "separate"}),
    ("lmdeploy", "lmdeploy v0.11.2", {}),
    ("llamacpp", "llama-bench build d46dbc76 (2833) CUDA; -ngl 99", {"cuda_force_cublas": True}),
    ("llamacpp", "llama-bench build: a818f302 (3216)", {}),   # PR #8075: MMQ by default from b3216
    ("llamacpp", "llama-bench -ngl 99 pp512; build varies per row", {}),
    ("llamacpp", "llama-bench build 4426e298 (2824); defaults: -ub 512 and flash attention off (not printed)",
     {"cuda_force_cublas": True, "flash_attn": "off"}),
    ("llamacpp", "llama-bench -fa 0 -p 2048", {"flash_attn": "off"}),
    ("llamacpp", "llama-bench -fa 1 -p 2048", {}),
])
def test_an_engine_version_runs_with_the_mechanisms_it_had(engine, notes, expect):
    from simengine.validate.bench_tools import engine_params

    params, note = engine_params(row(engine=engine, notes=notes), engine)
    assert params == expect
    if expect and engine != "sglang":
        assert "(" in note   # says which version rule applied and its source


def test_sglang_s_tp_ladder_follows_its_release_and_leaves_larger_gpus_alone():
    from simengine.validate.bench_tools import engine_params

    def fraction(notes, **kw):
        return engine_params(row(engine="sglang", notes=notes, **kw), "sglang")[0].get("mem_fraction_static")

    assert fraction("SGLang v0.3.0", tp=8) == 0.83 and fraction("SGLang v0.4.6", tp=8) == 0.81
    assert fraction("SGLang v0.4.6", tp=1) == 0.88 and fraction("SGLang v0.4.6", tp=2) == 0.87
    assert fraction("SGLang v0.4.6", tp=8, hardware="h200_sxm") is None   # the 0.4 releases' own branch over 80 GB
    assert fraction("SGLang v0.3.0 --mem-fraction-static 0.9", tp=8) == 0.9   # a quoted flag wins


@pytest.mark.parametrize("engine, model, expect", [
    ("vllm", "llama-3-8b", {"max_num_seqs": 512, "gpu_memory_utilization": 0.9}),
    ("sglang", "llama-3-8b", {"disable_radix_cache": True, "enable_torch_compile": True}),
    ("sglang", "llama-3-70b", {"disable_radix_cache": True}),
    ("trtllm", "llama-3-70b", {"max_batch_size": 2048, "max_num_tokens": 16384, "max_seq_len": 6144,
                               "enable_block_reuse": False}),
    ("lmdeploy", "llama-3-8b", {}),
])
def test_vllm_v060_post_rows_run_the_suites_server_parameters(engine, model, expect):
    from simengine.validate.bench_tools import engine_params

    post = "vLLM blog (vllm-project/vllm-project.github.io _posts/2024-09-05-perf-update.md)"
    params, note = engine_params(row(engine=engine, model=model, source=post), engine)
    assert expect.items() <= params.items()
    assert ("nightly-tests.json" in note) == bool(expect)
    assert engine_params(row(engine=engine, model=model), engine)[0].keys().isdisjoint(expect)   # other sources


JUDGED = sorted((Path(__file__).parents[2] / "docs" / "judge").glob("*.csv"))


@pytest.mark.parametrize("path", JUDGED, ids=[p.stem for p in JUDGED])
def test_every_judged_file_reads_and_every_row_plans_an_experiment(path):
    """docs/judge/*.csv (judged only, never fitted) are in the schema, and every row maps to an experiment the
    simulator can run: none is skipped, so their error covers the whole file."""
    from simengine.validate.measurements import read_measurements
    rows = read_measurements(path)
    assert len(rows) >= 8 and len({r.id for r in rows}) == len(rows)
    plans = [plan_row(r) for r in rows]
    assert not [p.reason for p in plans if isinstance(p, Skip)]
    # no row runs another engine (a row whose stack is not stated runs the generic one)
    assert all(p.engine == ENGINE_OF_ROW.get(r.engine, r.engine) for p, r in zip(plans, rows, strict=True))


def test_the_judged_files_cover_devices_and_parallelism_the_calibration_files_do_not():
    from simengine.validate.measurements import read_measurements
    rows = [r for p in JUDGED for r in read_measurements(p)]
    devices = {"b200", "gb200", "h200_sxm", "l40s", "rtx_pro_6000_blackwell", "dgx_spark_gb10"}
    assert devices <= {r.hardware for r in rows}
    assert max(r.pp for r in rows) == 8 and max(r.tp for r in rows) == 8


PREFIX_NOTES = "shared_prefix_len=1024; question_len=128; prefix_groups=8; prompts_per_group=4"
STAGE_NOTES = "stage=1; num_stages=3; stage_duration_s=20; stage_rates=1/3/5"


def prefix_row(**kw) -> Measurement:
    return row(**{"engine": "vllm", "model": "llama-3.1-8b", "weight_dtype": "bf16", "hardware": "h100_sxm",
                  "num_gpus": 1, "tp": 1, "input_len": 1152, "output_len": 64, "num_requests": 60,
                  "arrival": Arrival(kind="poisson", value=3), "metric": "mean_ttft_ms", "value": 30.0,
                  "notes": f"{PREFIX_NOTES}; {STAGE_NOTES}", **kw})


def test_shared_prefix_and_stage_notes_run_inference_perfs_traffic():
    """README 'Machine-readable notes': the shared_prefix items make inference-perf's prompt pool (the question is
    input_len less the prefix where question_len is absent) and the stage items its load stages up to the measured
    one, found by the row's rate; the row reads its stage from a run of every stage."""
    exp = plan_row(prefix_row())
    wl = exp.scenario.workload
    assert (wl.prompt_groups.groups, wl.prompt_groups.prompts_per_group, wl.prompt_groups.prefix_tokens) == (8, 4, 1024)
    assert wl.input_tokens.value == 128 and wl.num_requests is None
    # the whole ladder runs; the row reads its stage's 60 requests, after the 20 of the stage before
    assert wl.arrival.process == "stages"
    assert [(s.rate, s.duration_s, s.process) for s in wl.arrival.stages] == [(1, 20, "poisson"), (3, 20, "poisson"),
                                                                               (5, 20, "poisson")]
    assert exp.stage_window == (20, 60)
    no_question = plan_row(prefix_row(notes=PREFIX_NOTES.replace("question_len=128; ", "")))
    assert no_question.scenario.workload.input_tokens.value == 1152 - 1024
    assert not wl.prompt_groups.multi_turn
    assert plan_row(prefix_row(notes=f"{PREFIX_NOTES}; multi_turn=yes")).scenario.workload.prompt_groups.multi_turn


@pytest.mark.parametrize("notes, reason", [
    ("shared_prefix_len=1024; prefix_groups=8", "needs shared_prefix_len, prefix_groups and prompts_per_group"),
    ("stage=7; stage_rates=1/2", "needs stage_rates and stage_duration_s"),
    ("stage=7; stage_rates=1/2; stage_duration_s=10", "which of the stages"),
])
def test_traffic_notes_that_cannot_run_as_stated_are_skipped(notes, reason):
    res = plan_row(prefix_row(notes=notes))
    assert isinstance(res, Skip) and reason in res.reason


def test_a_stage_row_measures_its_stage_and_the_prefix_cuts_its_ttft():
    staged = run_row(prefix_row())
    plain = run_row(prefix_row(notes=STAGE_NOTES))
    assert staged.info["simulated_requests"] and "stage 1 of 3 (60 requests)" in staged.info["notes"]
    # every prompt starts with one of 8 cached 1,024-token prefixes: most of each prefill is a hit
    assert staged.predicted < 0.6 * plain.predicted
    tput = run_row(prefix_row(metric="output_throughput_tok_s"))
    assert tput.predicted == pytest.approx(3 * 64, rel=0.25)   # the stage's rate x its output length


def test_gpu_kv_blocks_sets_vllms_pool_and_an_unsized_offload_is_reported():
    exp = plan_row(prefix_row(notes=f"{PREFIX_NOTES}; gpu_kv_blocks=5000; cpu_kv_offload=true"))
    assert exp.params["num_gpu_blocks_override"] == 5000
    assert "cpu_kv_offload=true not applied" in "; ".join(exp.notes)
    from simengine.sim.build import build_deployment, build_engine
    eng = build_engine(exp.entry, build_deployment(exp.scenario))
    assert eng.kv_capacity_tokens() == 5000 * 16


def test_a_stage_row_reads_itl_statistics_from_its_requests_token_times():
    """ITL of a stage pools the gaps between its requests' tokens (every request's token times are kept for such a
    row); the mean of those gaps is the stage's decode time over its gaps."""
    mean, median, p99 = (run_row(prefix_row(metric=m)).predicted for m in ("mean_itl_ms", "median_itl_ms",
                                                                               "p99_itl_ms"))
    assert 0 < median <= p99 and mean > 0
    exp = plan_row(prefix_row(metric="p99_itl_ms"))
    assert exp.scenario.output.detailed_requests >= 60
    # the same stage's TPOT (per request: decode time over its gaps) averages what the pooled mean ITL says
    tpot = run_row(prefix_row(metric="mean_tpot_ms")).predicted
    assert mean == pytest.approx(tpot, rel=0.05)


def test_the_stages_after_a_row_leave_its_stage_as_it_was():
    """A stage starts once every request before it finished, so a row reads the same stage from the whole ladder's
    run as from a run that stops at it: one run serves every row of a ladder."""
    for metric in ("mean_ttft_ms", "p90_ttft_ms", "output_throughput_tok_s"):
        whole = run_row(prefix_row(metric=metric)).predicted
        cut = run_row(prefix_row(metric=metric, notes=f"{PREFIX_NOTES}; stage=1; stage_duration_s=20; "
                                                      "stage_rates=1/3")).predicted
        assert whole == cut


def test_a_ladders_rows_share_one_run_and_read_what_each_alone_reads():
    from simengine.validate.run import row_tasks, run_rows
    rows = [prefix_row(metric=m) for m in ("mean_ttft_ms", "mean_itl_ms", "output_throughput_tok_s")]
    rows += [prefix_row(metric="mean_ttft_ms", arrival=Arrival(kind="poisson", value=5)),   # the ladder's stage 2
             prefix_row(notes=PREFIX_NOTES)]                                                 # no stages: its own run
    tasks = row_tasks(rows)
    assert sorted(map(sorted, tasks)) == [[0, 1, 2, 3], [4]]
    together = run_rows(rows, jobs=2)
    assert [p.predicted for p in together] == [run_row(r).predicted for r in rows]


def test_a_stages_mean_itl_is_its_decode_time_over_its_gaps():
    """The mean ITL of a stage, read without token times (each request's gaps telescope to its first-to-last token
    time), equals the mean of every gap between its requests' tokens."""
    from simengine.validate.run import _simulate, _stage_metric
    exp = plan_row(prefix_row(metric="p99_itl_ms"))          # a quantile: the run keeps every token's time
    _, frame, recorder, _ = _simulate(exp, exp.full_requests)
    first, count = exp.stage_window
    ids = frame.sort_values("request_id")["request_id"].iloc[first:first + count]
    gaps = np.concatenate([np.diff(recorder.token_times[i]) for i in ids])
    assert _stage_metric("mean_itl_ms", frame, recorder, exp.stage_window) == pytest.approx(1e3 * gaps.mean())


def test_constant_arrivals_and_a_named_router_reach_the_deployment():
    from simengine.validate.measurements import parse_arrival
    assert parse_arrival("constant:2.5") == Arrival(kind="constant", value=2.5)
    exp = plan_row(prefix_row(num_gpus=4, arrival=Arrival(kind="constant", value=3),
                              notes=f"{PREFIX_NOTES}; {STAGE_NOTES}; router=llm_d; "
                                    "router_params=prefix_mode:precise/queue_weight:2; router_state_delay_s=0.05"))
    dep = exp.scenario.deployment
    assert dep.replicas == 4 and dep.router == "llm_d" and dep.router_state_delay_s == 0.05
    assert dep.router_params == {"prefix_mode": "precise", "queue_weight": 2}
    assert {s.process for s in exp.scenario.workload.arrival.stages} == {"constant"}
    assert plan_row(prefix_row()).scenario.deployment.router == "least_loaded"   # none named: the default


def test_routers_measured_side_by_side_are_ranked_like_engines():
    """Rows of one run that differ only in the router their notes name form a side-by-side group: the validator
    reports whether the simulator orders the routers as measured (Kendall's tau)."""
    from simengine.validate.report import ranking_groups
    from simengine.validate.run import Prediction
    notes = ("router=random", "router=llm_d; router_params=prefix_mode:precise", "router=llm_d")
    rows = [prefix_row(id=f"r{i}", num_gpus=4, notes=n, value=v)
            for i, (n, v) in enumerate(zip(notes, (900, 150, 200), strict=True))]
    groups = ranking_groups([Prediction(r, "vllm", p) for r, p in zip(rows, (600.0, 40.0, 35.0), strict=True)])
    assert len(groups) == 1 and groups[0]["engines"] == 3
    assert groups[0]["tau"] == pytest.approx(1 / 3)   # two pairs in the measured order, one reversed
    assert groups[0]["measured"] == "vllm@llm_d[prefix_mode:precise] < vllm@llm_d < vllm@random"


def test_moe_layout_items_reach_the_deployment_and_its_flags_are_not_reported_as_unmodelled():
    """`expert_parallel=true` / `attention_dp=true` lay the MoE model out as the run did; the flags that say so
    (and --tp-size, --model-path) are the deployment's, so the engine's unmodelled-flag note leaves them out."""
    moe = dict(engine="sglang", model="qwen3-30b-a3b", weight_dtype="bf16", hardware="h100_sxm", num_gpus=2, tp=2,
               arrival=Arrival(kind="offline"), metric="output_throughput_tok_s", num_requests=100)
    cmd = "`python3 -m sglang.launch_server --model-path Qwen/Qwen3-30B-A3B --tp-size 2 --ep-size 2 " \
          "--enable-dp-attention --mem-fraction-static 0.8`"
    exp = plan_row(row(**moe, notes=f"serving command {cmd}; expert_parallel=true; attention_dp=true"))
    assert isinstance(exp, Experiment)
    dep = exp.scenario.deployment
    assert dep.expert_parallel and dep.attention_dp
    assert exp.params == {"mem_fraction_static": 0.8} and not any("not modelled" in n for n in exp.notes)
    # a flag quoted in double quotes ends at the quote; --dp and its kin are the deployment's too
    quoted = plan_row(row(**moe, notes=f'{cmd}; block "--mem-fraction-static 0.8"; --enable-dp-attention without --dp'))
    assert quoted.params == {"mem_fraction_static": 0.8} and not any("not modelled" in n for n in quoted.notes)
    plain = plan_row(row(**moe, notes=f"serving command {cmd}"))
    assert not plain.scenario.deployment.expert_parallel and not plain.scenario.deployment.attention_dp


@pytest.mark.parametrize("notes, token_ids", [
    ("trtllm-bench throughput v1.0 docs PyTorch backend", True),
    ("lmdeploy v0.1.0a1 TurboMind (profile_throughput.py; engine API not HTTP)", True),
    ("bench=benchmark/profile_generation.py via benchmark/benchmark_7b.sh", True),
    ("an engine API; prompt_token_ids=true", True),
    ("vLLM v0.11.0; benchmark vllm bench serve --backend openai-chat", False),
    ("SGLang v0.3.0; bench=python -m sglang.bench_serving --dataset-name sharegpt", False),
])
def test_a_client_that_sends_token_ids_has_nothing_tokenised(notes, token_ids):
    """A benchmark that sends token ids (trtllm-bench, LMDeploy's profile scripts, LoadGen, or the notes' item) runs
    with workload.prompt_token_ids, and its runner's frontend tokenises nothing; a text client pays 2 us a token."""
    from simengine.sim.runner import Runner
    exp = plan_row(row(engine="vllm", model="llama-3.1-8b", weight_dtype="bf16", hardware="h100_sxm", num_gpus=1,
                       tp=1, num_requests=8, arrival=Arrival(kind="poisson", value=2.0), metric="mean_ttft_ms",
                       value=50.0, notes=notes))
    assert isinstance(exp, Experiment)
    assert exp.scenario.workload.prompt_token_ids is token_ids
    assert Runner(exp.scenario, exp.entry).tokenize_s_per_token == (0.0 if token_ids else pytest.approx(2e-6))
