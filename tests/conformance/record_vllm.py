"""Record vLLM's own scheduler decisions on the random traces of traces.py (`make conformance-record`, in
.venv-conformance with vLLM installed; never part of `make test`).

vLLM's V1 Scheduler (vllm/v1/core/sched/scheduler.py, with its KVCacheManager and prefix hashing) runs on a CPU with no
weights: a VllmConfig on device "cpu" over a tiny local config.json, one FullAttentionSpec group of the trace's
num_blocks, requests hashed by get_request_block_hasher, and after each schedule() a fake ModelRunnerOutput that samples
the trace's next token for every scheduled request that is not still in its prompt. Two loops, as EngineCore runs them:
`sync` (schedule, update, schedule: EngineCore.step) and `async` (AsyncScheduler with a batch queue of two: the next
step is scheduled before the previous step's output is applied: EngineCore.step_with_batch_queue).

Each step's record: [scheduled [[rid, tokens], ...] in vLLM's order, preempted rids, admitted [[rid, computed
tokens at admission], ...] (new and resumed requests), finished rids of the update that applied this step]. Written
to tests/conformance/vllm-<version>/<mode>.json.gz.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from tests.conformance.traces import Trace, make_trace  # noqa: E402

HERE = Path(__file__).resolve().parent
MAX_CALLS = 20_000   # a trace that has not drained by then is recorded as stuck (none has)


def model_dir() -> str:
    d = tempfile.mkdtemp(prefix="conformance-model-")
    Path(d, "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 32000,
        "max_position_embeddings": 1 << 20, "torch_dtype": "float16"}))
    return d


def make_scheduler(t: Trace, mode: str, model: str):
    mc = ModelConfig(model=model, skip_tokenizer_init=True, max_model_len=t.max_model_len, dtype="float16")
    sc = SchedulerConfig(max_num_seqs=t.max_num_seqs, max_num_batched_tokens=t.max_num_batched_tokens,
                         max_model_len=t.max_model_len, is_encoder_decoder=False, policy=t.policy,
                         long_prefill_token_threshold=t.long_prefill_token_threshold,
                         async_scheduling=mode == "async")
    cc = CacheConfig(block_size=t.block_size, enable_prefix_caching=t.enable_prefix_caching)
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, device_config=DeviceConfig(device="cpu"))
    vc.cache_config.num_gpu_blocks = t.num_blocks
    spec = FullAttentionSpec(block_size=t.block_size, num_kv_heads=2, head_size=16, dtype=torch.float16)
    kvc = KVCacheConfig(num_blocks=t.num_blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn"], spec)])
    cls = AsyncScheduler if mode == "async" else Scheduler
    return cls(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
               block_size=t.block_size)


def record(t: Trace, mode: str, model: str) -> list:
    sched = make_scheduler(t, mode, model)
    hasher = get_request_block_hasher(t.block_size, sha256)
    reqs = {}
    pending = deque(t.requests)
    steps: list[list] = []
    queue: deque = deque()   # async: (step index, scheduler output, sampling flags) in flight

    def schedule(call: int):
        out = sched.schedule()
        sampled = {rid: not sched.requests[rid].is_prefill_chunk for rid in out.num_scheduled_tokens}
        admitted = [[int(n.req_id), n.num_computed_tokens] for n in out.scheduled_new_reqs]
        steps.append([[[int(r), n] for r, n in out.num_scheduled_tokens.items()],
                      sorted(int(r) for r in out.preempted_req_ids), admitted, []])
        return len(steps) - 1, out, sampled

    def update(k: int, out, sampled) -> None:
        ids = list(out.num_scheduled_tokens)
        tokens = []
        for rid in ids:
            req, tr = reqs[rid], t.requests[int(rid)]
            # the trace's next output token (a request finished meanwhile takes any: vLLM drops it)
            i = min(tr.prompt_len + req.num_output_tokens, len(tr.tokens) - 1)
            tokens.append([tr.tokens[i]] if sampled[rid] else [])
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=tokens)
        outs = sched.update_from_output(out, mro)
        steps[k][3] = sorted(int(o.request_id) for v in outs.values() for o in v.outputs
                             if o.finish_reason is not None)

    for call in range(MAX_CALLS):
        while pending and pending[0].arrival_step <= call:
            tr = pending.popleft()
            req = Request(str(tr.rid), tr.tokens[:tr.prompt_len],
                          SamplingParams(max_tokens=tr.output_len, ignore_eos=True), None,
                          arrival_time=float(tr.arrival_step) + tr.rid * 1e-6, priority=tr.priority,
                          block_hasher=hasher)
            reqs[req.request_id] = req
            sched.add_request(req)
        if mode == "sync":
            if sched.has_requests():
                update(*schedule(call))
            elif not pending:
                break
            continue
        # EngineCore.step_with_batch_queue with batch_queue_size 2
        if sched.has_requests():
            k, out, sampled = schedule(call)
            queue.appendleft((k, out, sampled))
            executed = out.total_num_scheduled_tokens > 0
            if len(queue) < 2 and (executed or sched.has_requests()):
                continue
        elif not queue:
            if not pending:
                break
            continue
        update(*queue.pop())
    else:
        raise RuntimeError(f"trace {t.seed} ({mode}) did not drain in {MAX_CALLS} calls")
    return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=1000)
    ap.add_argument("--modes", default="sync,async")
    args = ap.parse_args()
    init_none_hash(sha256)
    model = model_dir()
    out_dir = HERE / f"vllm-{vllm.__version__}"
    out_dir.mkdir(exist_ok=True)
    for mode in args.modes.split(","):
        start = time.time()
        traces = [{"seed": s, "steps": record(make_trace(s), mode, model)} for s in range(args.traces)]
        path = out_dir / f"{mode}.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump({"vllm": vllm.__version__, "mode": mode, "traces": traces}, f, separators=(",", ":"))
        n = sum(len(x["steps"]) for x in traces)
        print(f"{mode}: {len(traces)} traces, {n} steps, {path.stat().st_size / 1e6:.2f} MB "
              f"in {time.time() - start:.0f} s -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
