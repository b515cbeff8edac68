"""The product brief's claims (listed in docs/engines.md, "The brief's claims"), reproduced by mechanism: each
asserts a direction and a broad band, never a tuned number. Workloads are small so the suite stays fast."""

import pytest

from simengine.api import run_engine
from simengine.config.scenario import EngineEntry
from simengine.sim.runner import Runner
from tests.conftest import make_scenario


def run(sc, engine, **params):
    return run_engine(sc, EngineEntry(engine=engine, params=params))


def mixed_offline(n=300, **kw):
    return make_scenario(workload={"arrival": {"process": "offline"}, "num_requests": n,
                                   "input_tokens": {"dist": "lognormal", "mean": 400, "sigma": 0.6, "max": 2000},
                                   "output_tokens": {"dist": "lognormal", "mean": 200, "sigma": 1.0, "max": 1500},
                                   "client_max_tokens": 1500, **kw}, horizon_s=0.0, drain_s=10_000.0)


def test_claim1_contiguous_preallocation_wastes_most_paged_uses_almost_all():
    """Brief: traditional contiguous max-length KV allocation wastes most reserved memory; PagedAttention keeps
    waste under ~4% (only the last block of each sequence is partly empty)."""
    sc = mixed_offline(120)
    static = Runner(sc, EngineEntry(engine="static", params={"batch_size": 16}))
    static.run()
    reserved, used = static.engines[0].kv_reserved_vs_used()
    assert used / reserved < 0.5
    paged = Runner(sc, EngineEntry(engine="vllm", params={"max_num_seqs": 16}))
    eng = paged.engines[0]
    held, slots = [], []
    orig = eng.update

    def spy(out, now):  # sample the paged pool after every step: tokens held vs block slots allocated
        res = orig(out, now)
        held.append(sum(r.num_computed_tokens for r in eng.running))
        slots.append(sum(eng.kv.num_blocks_of(r) for r in eng.running) * eng.kv.block_size)
        return res
    eng.update = spy
    paged.run()
    assert sum(held) / sum(slots) > 0.85


def test_claim2_continuous_batching_beats_static_by_2x():
    """Brief: continuous (iteration-level) batching gives several times the throughput of static batching on
    mixed output lengths, because a static batch waits for its longest member."""
    sc = mixed_offline(300)
    cont = run(sc, "vllm", max_num_seqs=64)
    stat = run(sc, "static", batch_size=64)
    assert cont.summary["output_throughput"] >= 2.0 * stat.summary["output_throughput"]


def test_claim3_shared_system_prompt_is_computed_once():
    """Brief: ten requests sharing a 1,000-token system prompt: prefix caching computes at most a fifth of the
    prompt tokens a non-caching run computes."""
    sc = make_scenario(workload={"arrival": {"process": "constant", "rate": 1.0}, "num_requests": 10,
                                 "shared_prefix_tokens": 1000,
                                 "input_tokens": {"dist": "constant", "value": 1030},
                                 "output_tokens": {"dist": "constant", "value": 20}})
    cached = run(sc, "vllm").steps["prefill_tokens"].sum()
    uncached = run(sc, "vllm", enable_prefix_caching=False).steps["prefill_tokens"].sum()
    assert uncached == 10 * 1030
    assert cached <= uncached / 5


@pytest.mark.parametrize("engine,off", [("vllm", {"enable_prefix_caching": False}),
                                        ("sglang", {"disable_radix_cache": True})])
def test_claim4_prefix_cache_cuts_multiturn_ttft(engine, off):
    """Brief: in multi-turn conversations the KV of earlier turns is reused, cutting time to first token."""
    sc = make_scenario(workload={"sessions": {"population": 16, "turns": {"dist": "constant", "value": 5},
                                              "think_time_s": {"dist": "constant", "value": 2.0},
                                              "user_tokens": {"dist": "constant", "value": 200}},
                                 "shared_prefix_tokens": 2000,
                                 "output_tokens": {"dist": "constant", "value": 150}}, horizon_s=40.0)
    on_ttft = run(sc, engine).summary["mean_ttft_ms"]
    off_ttft = run(sc, engine, **off).summary["mean_ttft_ms"]
    assert off_ttft >= 2.0 * on_ttft


def long_prompt_mix():
    """Chat decodes in flight while 10k-token prompts arrive about twice a second."""
    return make_scenario(workload={"arrival": {"process": "poisson", "rate": 6.0},
                                   "classes": [{"name": "chat", "weight": 0.67,
                                                "input_tokens": {"dist": "constant", "value": 300},
                                                "output_tokens": {"dist": "constant", "value": 200}},
                                               {"name": "doc", "weight": 0.33,
                                                "input_tokens": {"dist": "constant", "value": 10000},
                                                "output_tokens": {"dist": "constant", "value": 30}}]},
                         horizon_s=30.0)


def test_claim5_chunked_prefill_lowers_p99_itl():
    """Brief: chunked prefill splits long prompts so running decodes keep flowing (lower ITL tails)."""
    sc = long_prompt_mix()
    chunked = run(sc, "vllm", max_num_batched_tokens=2048)
    whole = run(sc, "vllm", max_num_batched_tokens=16384)  # every prompt fits one step: no chunking
    assert chunked.summary["p99_itl_ms"] < 0.7 * whole.summary["p99_itl_ms"]


def test_claim6a_sglang_prefill_only_steps_stall_decodes_more_than_vllm_mixed_steps():
    """engines.md §9.1: SGLang runs prefill-only steps, so decodes pause for every chunk of a long prompt in a
    row; vLLM mixes the decodes into every chunk's step. Both chunk at 8192 tokens on an H100 by default."""
    sc = make_scenario(workload={"arrival": {"process": "poisson", "rate": 3.0},
                                 "classes": [{"name": "chat", "weight": 0.9,
                                              "input_tokens": {"dist": "constant", "value": 300},
                                              "output_tokens": {"dist": "constant", "value": 200}},
                                             {"name": "doc", "weight": 0.1,
                                              "input_tokens": {"dist": "constant", "value": 24000},
                                              "output_tokens": {"dist": "constant", "value": 30}}]},
                       horizon_s=30.0)
    sglang, vllm = run(sc, "sglang"), run(sc, "vllm")
    assert sglang.itl_ms.max() > 1.8 * vllm.itl_ms.max()          # the longest decode stall
    assert sglang.summary["p99_itl_ms"] >= vllm.summary["p99_itl_ms"]


def test_claim6b_tgi_worst_case_reservation_runs_fewer_requests_than_vllm():
    """engines.md §9.2: TGI reserves prompt + min(max_tokens, 1024) up front; vLLM grows KV on demand. On the
    same KV token capacity TGI keeps fewer requests running."""
    sc = make_scenario(workload={"arrival": {"process": "offline"}, "num_requests": 300, "client_max_tokens": 1024,
                                 "input_tokens": {"dist": "lognormal", "mean": 500, "sigma": 0.5, "max": 2000},
                                 "output_tokens": {"dist": "lognormal", "mean": 150, "sigma": 0.6, "max": 1024}},
                       horizon_s=0.0, drain_s=10_000.0)
    tokens = 60_000
    tgi = run(sc, "tgi", max_batch_total_tokens=tokens).steps
    vllm = run(sc, "vllm", kv_cache_memory_bytes=tokens * 131072).steps
    # while requests are still queued, memory is the only limit on how many run at once
    busy_tgi, busy_vllm = tgi[tgi["num_waiting"] > 0], vllm[vllm["num_waiting"] > 0]
    assert busy_tgi["num_running"].mean() < 0.7 * busy_vllm["num_running"].mean()


# ---- second round (docs/recommend.md 'The brief's claims, second round') ------------------------------------------
def _decode_throughput(engine, weight_dtype, users):
    sc = make_scenario(deployment={"hardware": "a100_80g_sxm", "model": "llama-2-7b", "weight_dtype": weight_dtype},
                       workload={"arrival": {"process": "closed_loop", "concurrency": users}, "num_requests": 60,
                                 "input_tokens": {"dist": "constant", "value": 512},
                                 "output_tokens": {"dist": "constant", "value": 512}}, horizon_s=1e9, drain_s=1e9)
    return run(sc, engine).summary["output_throughput"]


def test_claim7_lmdeploy_4bit_weights_speed_up_decode_most_at_one_user():
    """002: "LMDeploy's 4-bit inference is 2.4x as fast as FP16". W4A16 reads a quarter of the weight bytes per
    decode step; at one user the step is bound by those reads, so 4-bit is much faster (we give 1.9x on an A100: the
    KV reads, the step's host time and the launch floor do not shrink). With 16 users the step moves toward the
    compute and the KV, and the gain falls. Reproduced in direction, below the claimed factor."""
    one = _decode_throughput("lmdeploy", "int4", 1) / _decode_throughput("lmdeploy", "fp16", 1)
    many = _decode_throughput("lmdeploy", "int4", 16) / _decode_throughput("lmdeploy", "fp16", 16)
    assert 1.5 < one < 3.0
    assert 1.0 < many < one


def _system_prompt_run(system_tokens, prefix_caching):
    """800 requests of 2,450 user tokens behind a system prompt, ~400 output tokens, offline, on an A100 40GB whose
    KV pool holds about 58 of them: memory, not max_num_seqs, caps the batch near the brief's 64."""
    sc = make_scenario(deployment={"hardware": "a100_40g_sxm", "model": "llama-3.1-8b"},
                       workload={"arrival": {"process": "offline"}, "num_requests": 800,
                                 "shared_prefix_tokens": system_tokens,
                                 "input_tokens": {"dist": "constant", "value": 2450 + system_tokens},
                                 "output_tokens": {"dist": "lognormal", "mean": 400, "sigma": 0.3, "max": 1200}},
                       horizon_s=0.0, drain_s=1e5)
    res = run(sc, "vllm", enable_prefix_caching=prefix_caching)
    busy = res.steps[res.steps["num_waiting"] > 0]
    running = float((busy["num_running"] * busy["step_s"]).sum() / busy["step_s"].sum())
    return running, res.summary["output_throughput"]


def test_claim8_a_shorter_system_prompt_admits_more_requests_only_without_prefix_caching():
    """003: compressing the system prompt from 150 to 20 tokens schedules 2-3 more requests at batch 64 and raises
    throughput 5-8%. Without prefix caching every request holds its own copy, so 130 tokens less each frees room
    for about 2.8 more requests and throughput rises about 5%: reproduced. With prefix caching (vLLM's default) the
    prompt's blocks are shared by all, so compressing it frees almost nothing: under 0.5 more requests."""
    r150, t150 = _system_prompt_run(150, False)
    r20, t20 = _system_prompt_run(20, False)
    assert 1.5 <= r20 - r150 <= 4.0
    assert 1.02 <= t20 / t150 <= 1.10
    c150, _ = _system_prompt_run(150, True)
    c20, _ = _system_prompt_run(20, True)
    assert abs(c20 - c150) < 0.5


def test_claim9_awq_4bit_70b_fits_one_a100_80gb_under_tgi():
    """003: AWQ/GPTQ compress a 70B model onto one A100 80GB under TGI. 4-bit weights with group-128 scales take
    about 36 GiB, which leaves TGI a KV pool of over 100k tokens; FP16 weights (131 GiB) do not fit at all."""
    from simengine.errors import InputError
    from simengine.sim.build import build_deployment, build_engine

    def engine(weight_dtype):
        sc = make_scenario(deployment={"hardware": "a100_80g_sxm", "model": "llama-3-70b",
                                       "weight_dtype": weight_dtype}, engines=["tgi"])
        return build_engine(sc.engines[0], build_deployment(sc))
    assert engine("int4").kv_capacity_tokens() > 100_000
    with pytest.raises(InputError, match="does not fit"):
        engine("fp16")


def test_claim10_brief_003_benchmark_trtllm_leads_tgi_and_ties_vllm():
    """003's setting (scenarios/brief_003_benchmark.yaml: Llama-3-70B FP16 on 4x A100 80GB, 64 clients, 512 in and
    256 out): "TensorRT-LLM leads vLLM and TGI in latency and throughput". It leads TGI in both and has the lowest
    TPOT (its C++ executor's shorter host time per step); against vLLM its throughput is a tie (within 3%: both run
    the same GEMMs at batch 64 and the step is GPU-bound), so that half is not reproduced."""
    from simengine.api import compare
    from simengine.config.scenario import load_scenario

    res = {k: v.summary for k, v in compare(load_scenario("brief_003_benchmark")).items()}
    trt, vllm, tgi = res["trtllm"], res["vllm"], res["tgi"]
    assert trt["output_throughput"] > 1.05 * tgi["output_throughput"]
    assert trt["median_tpot_ms"] < min(vllm["median_tpot_ms"], tgi["median_tpot_ms"])
    assert abs(trt["output_throughput"] / vllm["output_throughput"] - 1) < 0.03


def test_claim11_continuous_batching_keeps_slots_busy_static_does_not():
    """003: continuous batching lifts GPU utilisation from 40-60% (static batching) to over 85% when lengths vary.
    Measured as the share of batch slots doing work while requests wait: static batching keeps a finished
    request's slot until the whole batch ends (about 40% busy with lognormal outputs, sigma 0.6), vLLM refills
    it at the next step (over 95%). Reproduced."""
    sc = mixed_offline(n=640, output_tokens={"dist": "lognormal", "mean": 200, "sigma": 0.6, "max": 1500})

    def slot_use(res, slots):
        busy = res.steps[res.steps["num_waiting"] > 0]
        return float((busy["batch_size"] * busy["step_s"]).sum() / busy["step_s"].sum()) / slots
    static = slot_use(run(sc, "static", batch_size=32), 32)
    vllm = slot_use(run(sc, "vllm", max_num_seqs=32), 32)
    assert 0.3 <= static <= 0.65
    assert vllm > 0.95
