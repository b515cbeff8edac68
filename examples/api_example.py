"""docs/api.md's example: two engines on the agent scenario side by side, then a scenario written in code (the test
suite runs this file)."""

import sys
import tempfile

import simengine

out = tempfile.mkdtemp() if len(sys.argv) < 2 else sys.argv[1]

sim = simengine.simulate("agent_multiturn", engines=["vllm", "sglang"],
                         overrides={"horizon_s": 30, "workload.sessions.population": 8})
print(sim.table())

vllm = sim["vllm"]
print("vLLM p99 TTFT (ms):", vllm.summary["p99_ttft_ms"])
print("vLLM requests:", len(vllm.requests), "steps:", len(vllm.steps))
print("slowest first tokens:")
print(vllm.requests.nlargest(3, "ttft_ms")[["request_id", "prompt_len", "num_cached_tokens", "ttft_ms"]])

# a scenario written in code: the same schema as a YAML file
mine = simengine.simulate({
    "name": "two_loads", "horizon_s": 20,
    "deployment": {"hardware": "l40s", "model": "llama-3.1-8b"},
    "workload": {"arrival": {"process": "poisson", "rate": 2},
                 "input_tokens": {"dist": "lognormal", "mean": 800, "sigma": 0.6, "max": 4000},
                 "output_tokens": {"dist": "lognormal", "mean": 200, "sigma": 0.6, "max": 1000}},
    "engines": ["vllm", "tgi"]})
print(mine.summaries[["request_throughput", "median_ttft_ms", "p99_tpot_ms"]])
print("results:", mine.save(out + "/results"))
print("figures:", len(mine.plot(out + "/plots")))
