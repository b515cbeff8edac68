"""What the benchmark tool behind a measurement configured, when the notes name the tool, and the engine flags
the notes quote (`--max_model_len 4096`, `--disable-radix-cache`, `--mem-frac 0.88`).

A published number is the engine *as the benchmark ran it*. Two tools set engine knobs of their own:
- `trtllm-bench throughput` (PyTorch backend) sizes max_batch_size and max_num_tokens from the dataset's mean
  lengths and the free KV memory (tensorrt_llm/bench/build/tuning.py calc_engine_setting + finetune_setting),
  raises max_num_tokens to max ISL + max_batch_size when chunking is off, enables CUDA-graph padding up to
  max_batch_size and passes --kv_cache_free_gpu_mem_fraction (default 0.90) through
  (tensorrt_llm/bench/benchmark/utils/general.py get_settings; benchmark/throughput.py options);
- `llama-bench` processes prompts in ubatches of 512 tokens (-b 2048 -ub 512 defaults), handled in run.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing

from simengine.config.dtypes import kv_bytes, weight_format
from simengine.config.hardware import load_hardware
from simengine.config.model import load_model
from simengine.validate.measurements import Measurement

GIB = 2**30
TRTLLM_BENCH_KV_FRACTION = 0.90   # trtllm-bench throughput --kv_cache_free_gpu_mem_fraction default


def _finetune(kv_max_requests: float, isl: int, osl: int, pp: int) -> tuple[int, int]:
    """finetune_setting (optimistic tuning on): (max_batch_size, max_num_tokens)."""
    raw_bs = min(kv_max_requests, 4096) / pp
    raw_token = min(raw_bs * (1 + isl / osl), 32768)
    if raw_bs < 256:
        bs = max(64, 32 * math.ceil(raw_bs / 32))
    elif raw_bs < 1024:
        bs = 128 * math.ceil(raw_bs / 128)
    else:
        bs = 256 * math.ceil(raw_bs / 256)
    if raw_token < 4096:
        tok = max(2048, 256 * math.ceil(raw_token / 256))
    elif raw_token < 8192:
        tok = 512 * math.ceil(raw_token / 512)
    else:
        tok = 1024 * math.ceil(raw_token / 1024)
    return bs, tok


def trtllm_bench_params(row: Measurement) -> dict:
    """TrtllmParams overrides trtllm-bench throughput applies for a fixed-length dataset of the row's lengths."""
    model, hw = load_model(row.model), load_hardware(row.hardware)
    isl, osl = row.input_len, row.output_len
    assert isl is not None and osl is not None, "trtllm-bench settings need the row's input and output lengths"
    wbytes = min(weight_format(row.weight_dtype).bytes_per_param, 2.0)   # BYTES_PER_ELEM: fp8 1, else 2
    kvb = kv_bytes(row.kv_dtype)
    per_token_gib = 2 * model.num_full_attention_layers * max(row.tp, model.num_kv_heads) * model.head_dim * kvb / GIB
    n_gpus = row.tp * row.pp
    available = hw.memory_bytes / GIB * n_gpus - model.total_params * wbytes / GIB
    kv_max_requests = available * TRTLLM_BENCH_KV_FRACTION / (per_token_gib * (isl + osl))
    bs, tokens = _finetune(kv_max_requests, isl, osl, row.pp)
    tokens = max(tokens, isl + bs)   # chunked prefill off: max_num_tokens >= max ISL + max_batch_size
    return {"max_batch_size": bs, "max_num_tokens": tokens, "free_gpu_memory_fraction": TRTLLM_BENCH_KV_FRACTION,
            "cuda_graph_max_batch_size": bs, "cuda_graph_enable_padding": True}


# LMDeploy's own A100 benchmark page (docs/en/benchmark/a100_fp16.md @3e391df4) ran every row, the request-throughput
# rows as the static ones, on the config.ini its scripts set (benchmark/benchmark_{7b,13b,70b}.sh: crudini --set
# ... max_batch_size, cache_max_entry_count (> 1: a block count), max_context_token_num 4, which v0.1's
# LlamaTritonModel multiplies by session_len when it is at most max_batch_size); v0.1's blocks held 128 tokens
# (deploy/target_model/base.py cache_block_seq_len)
LMDEPLOY_A100_PAGE = "docs/en/benchmark/a100_fp16.md"
LMDEPLOY_A100_CONFIG = {"llama-2-7b": (128, 1000), "llama-2-13b": (128, 500), "llama-2-70b": (256, 4000)}


# vLLM's v0.6.0 post (vllm-project.github.io _posts/2024-09-05-perf-update.md) ran every engine from the nightly
# benchmark suite of its date (vllm-project/vllm issue #8176: the suite of buildkite build 8532), whose
# .buildkite/nightly-benchmarks/tests/nightly-tests.json set these server parameters for every test (the copy of that
# file at ehuaa/vllm @f1e5d9cc: tests llama8B_tp1_* and llama70B_tp4_* over sharegpt, sonnet_512_16 and
# sonnet_512_256; trtllm-build --max_batch_size/--max_num_tokens/--max_seq_len from trt_server_parameters, PR #7412's
# launch-trt-server.sh); SGLang compiled only the 8B tests' model.
VLLM_V060_POST = "_posts/2024-09-05-perf-update.md"
VLLM_V060_SERVER_PARAMS: dict[str, dict[str, object]] = {
    "vllm": {"max_num_seqs": 512, "gpu_memory_utilization": 0.9, "num_scheduler_steps": 10},
    "sglang": {"disable_radix_cache": True},
    "trtllm": {"max_batch_size": 2048, "max_num_tokens": 16384, "max_seq_len": 6144, "enable_block_reuse": False},
}


def vllm_v060_post_params(row: Measurement, engine: str) -> dict:
    """The server parameters vLLM's v0.6.0 post ran `engine` with; {} for other rows."""
    if VLLM_V060_POST not in row.source:
        return {}
    params = dict(VLLM_V060_SERVER_PARAMS.get(engine, {}))
    if engine == "sglang" and load_model(row.model).total_params < 20e9:   # llama8B_tp1_*: --enable-torch-compile
        params["enable_torch_compile"] = True
    return params


# SGLang's automatic mem_fraction_static before sgl-project/sglang PR #7054 'Simplify the heuristics for setting
# --mem-fraction-static' (2025-06-10, first in v0.4.7): a ladder on the tensor-parallel size in ServerArgs.__post_init__
# (0.88 at TP1, 0.87 at 2-3, 0.85 at 4-7, 0.81 at 8-15 (0.83 in the 0.3 releases, before DP attention), 0.79 from 16);
# from then on it reserves memory by the device. The 0.4 releases had a branch of their own for GPUs over 80 GB
# (PR #5893's 13-18 GB reserve), so those keep the current rule here.
SGLANG_LADDER_BEFORE = (0, 4, 7)
SGLANG_LADDER = ((16, 0.79), (8, 0.81), (4, 0.85), (2, 0.87), (1, 0.88))
SGLANG_LADDER_TP8_BEFORE_0_4 = 0.83
SGLANG_LADDER_MAX_MEMORY_BYTES = 80 * 2**30


def sglang_ladder_params(row: Measurement, engine: str) -> dict:
    """{mem_fraction_static} a SGLang release before v0.4.7 chose for the row's TP on an 80 GB GPU; {} otherwise."""
    version = engine_version(row, engine)
    if (engine != "sglang" or version is None or version >= SGLANG_LADDER_BEFORE
            or load_hardware(row.hardware).memory_bytes > SGLANG_LADDER_MAX_MEMORY_BYTES):
        return {}
    fraction = next(f for tp, f in SGLANG_LADDER if row.tp >= tp)
    if version < (0, 4) and 8 <= row.tp < 16:
        fraction = SGLANG_LADDER_TP8_BEFORE_0_4
    return {"mem_fraction_static": fraction}


def lmdeploy_benchmark_params(row: Measurement) -> dict:
    """LmdeployParams of LMDeploy's A100 benchmark page as its scripts configured the model; {} for other rows."""
    if LMDEPLOY_A100_PAGE not in row.source or row.model not in LMDEPLOY_A100_CONFIG:
        return {}
    batch, blocks = LMDEPLOY_A100_CONFIG[row.model]
    return {"max_batch_size": batch, "cache_max_entry_count": blocks, "cache_block_seq_len": 128,
            "max_context_token_num": 4 * load_model(row.model).max_model_len}


# a value ends at a space, ';', a bracket or a closing quote (`a quoted command`, "a quoted flag")
_FLAG = re.compile(r"--([a-z][a-z0-9_-]*)(?:[ =](-?\d[^\s;()`\"']*|[^\s;()`\"'-][^\s;()`\"']*))?")
# the benchmark client's own flags (vllm bench serve, sglang.bench_serving), not engine knobs
CLIENT_FLAGS = frozenset({"backend", "dataset-name", "dataset-path", "num-prompts", "request-rate", "seed",
                          "tokenizer", "disable-log-requests", "disable-log-stats", "ignore-eos", "model", "port",
                          "host", "tensor", "tp", "tensor-parallel-size", "dtype", "max-concurrency",
                          "sonnet-input-len", "sonnet-output-len", "sonnet-prefix-len", "random-input-len",
                          "random-output-len", "endpoint"})
# flags of the deployment, which the row's columns (tp, pp) and layout items (expert_parallel=, attention_dp=) carry,
# and of where the server listens or finds its checkpoint: not engine knobs, never reported as unmodelled
DEPLOYMENT_FLAGS = frozenset({"tp-size", "tp_size", "pp-size", "pp_size", "pipeline-parallel-size", "ep-size",
                              "ep_size", "enable-expert-parallel", "enable-dp-attention", "dp", "dp-size",
                              "data-parallel-size", "model-path"})
# argparse accepts unambiguous prefixes; the abbreviations sources print, and flags since renamed, as the engine's
# argument name today (SGLang v0.3's --max-torch-compile-bs, PR #1497)
FLAG_ALIASES = {"mem_frac": "mem_fraction_static", "max_torch_compile_bs": "torch_compile_max_bs",
                "gpu_memory_util": "gpu_memory_utilization"}
# machine-readable notes items that are engine knobs (README 'Machine-readable notes'; vLLM names) -> field name
NOTE_KNOBS = {"max_num_batched_tokens": "max_num_batched_tokens", "max_num_seqs": "max_num_seqs",
              "gpu_memory_utilization": "gpu_memory_utilization", "max_model_len": "max_model_len",
              "kv_block_size": "block_size", "gpu_kv_blocks": "num_gpu_blocks_override"}


def _knob_type(hint) -> type:
    """What a quoted flag's text converts to: a Literal knob's values' type (vLLM's block_size), an optional knob's
    own, a class as is, anything else text."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return type(args[0])
    if args:
        return _knob_type(args[0])
    return hint if isinstance(hint, type) else str


def quoted_flags(row: Measurement, engine: str) -> tuple[dict, list[str]]:
    """Engine knobs quoted as command-line flags in the notes that are fields of the engine's params (real knob
    names, dashes as underscores), converted to the field's type; and the flags that are not (reported)."""
    from simengine.engines import ENGINES

    cls = ENGINES.get(engine).Params
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    params: dict = {}
    ignored: list[str] = []
    items = [(NOTE_KNOBS[k], v.split()[0]) for k, v in row.note_items.items() if k in NOTE_KNOBS]
    for name, value in _FLAG.findall(row.notes) + items:
        if name in CLIENT_FLAGS or name in DEPLOYMENT_FLAGS:
            continue
        key = FLAG_ALIASES.get(name.replace("-", "_"), name.replace("-", "_"))
        if key.startswith("no_") and key[3:] in fields:   # argparse's --no-<flag> (BooleanOptionalAction)
            key, value = key[3:], "false"
        if key not in fields:
            ignored.append(f"--{name}")
            continue
        kind = _knob_type(hints[key])
        if kind is bool:
            params[key] = value.lower() not in ("0", "false", "no") if value and not value.startswith("-") else True
        else:
            try:
                params[key] = kind(value)
            except (TypeError, ValueError):
                ignored.append(f"--{name} {value}")
    return params, ignored


# What an engine version ran with that today's defaults change: (engine, versions from, versions below, params,
# source). A version is (major, minor, patch, final): a pre-release (0.6.0a0, 1.2.0rc1) sorts before its release
# against a four-part bound like (0, 6, 0, 1), and counts as that release against a shorter one like (0, 12).
VERSION_KNOBS = (
    ("vllm", None, (0, 8), {"use_v1": False},
     "the V1 engine became vLLM's default in v0.8.0 (its release notes); V0 scheduled, batched and cached by its own "
     "rules (engines/vllm_config.py use_v1)"),
    ("vllm", None, (0, 12), {"async_scheduling": False},
     "async scheduling became vLLM's default with PR #27614 (the Q4 2025 roadmap's 'async scheduling on by "
     "default'); the V0 engine never had it"),
    ("vllm", None, (0, 21), {"gpu_memory_utilization": 0.9, "memory_profiler_estimate_cudagraphs": False},
     "vLLM PR #38284 (2026-04-21) began counting CUDA-graph memory in the KV budget and raised the "
     "gpu_memory_utilization default from 0.9 to 0.92 ('CUDA graph memory profiling is enabled (default since "
     "v0.21.0)', its startup log); earlier releases (V0 and V1 alike) took 0.9 of the device's memory and captured "
     "their graphs in what was left"),
    ("sglang", None, (0, 4), {"disable_overlap_schedule": True},
     "SGLang's overlap ('zero-overhead') scheduler shipped in v0.4 (LMSYS blog 2024-12-04)"),
    ("trtllm", None, (0, 17), {"disable_overlap_scheduler": True},
     "the overlap scheduler is a feature of the PyTorch backend (TensorRT-LLM docs features/overlap-scheduler); "
     "the 0.1x C++ runtime behind Triton stepped synchronously"),
    ("tgi", None, (3, 0), {"prefill_chunking": False, "prefix_caching": False},
     "TGI 3.0 turned on chunked prefill and prefix caching (huggingface/text-generation-inference v3.0.0 release "
     "notes, 2024-12); 2.x batched new requests by waiting_served_ratio / max_waiting_tokens"),
    ("lmdeploy", None, (0, 11), {"async_": 0},
     "TurboMind's asynchronous execution arrived with the engine refactor of InternLM/lmdeploy PR #4223 "
     "(2025-12-19); ESTIMATE that releases before 0.11 ran one phase"),
    ("lmdeploy", None, (0, 1, 0, 1), {"prefill_passes": "separate"},
     "TurboMind computed new sequences' contexts in prefill-only passes before each decode pass until "
     "InternLM/lmdeploy PR #775 'Unify prefill & decode passes' (2023-12-04, first in v0.1.0; v0.1.0a1 has "
     "LlamaBatch::ContextDecode then Generate)"),
    ("lmdeploy", None, (0, 3), {"decode_attention_kernel": "decoder_multihead_attention"},
     "TurboMind's decode attention was src/turbomind/kernels/decoder_multihead_attention (at most 4 query heads a "
     "thread block) until InternLM/lmdeploy PR #1116 'Refactor turbomind attention' (2024-03-06, first in "
     "v0.3.0) replaced it with kernels/attention/decoding.cu"),
    ("lmdeploy", (0, 2), (0, 6, 0, 1), {"max_batch_size": 128},
     "TurbomindEngineConfig.max_batch_size was a fixed 128 from v0.2.0 (lmdeploy/messages.py) to v0.6.0a0; "
     "InternLM/lmdeploy PR #2434 (2024-09-09, first in v0.6.0) made it depend on the device (utils.py "
     "get_max_batch_size). v0.1 set it in the converted model's config (deploy/target_model/base.py: 64), which "
     "the rows of that release's own benchmark did not run with (their TTFT has no queue of that size)"),
)
# how notes name versions: 'vLLM v0.6.0', 'SGLang v0.3.0', 'lmdeploy v0.6.0a0', 'Triton trtllm backend v0.11'
_VERSION = {"vllm": (r"vllm",), "sglang": (r"sglang",), "lmdeploy": (r"lmdeploy",), "tgi": (r"tgi",),
            "trtllm": (r"tensorrt-llm", r"trtllm backend")}


def engine_version(row: Measurement, engine: str) -> tuple[int, int, int, int] | None:
    """(major, minor, patch, final) of the engine as the notes name it (final 0 for a pre-release: a, b, rc,
    dev), or None."""
    for name in _VERSION.get(engine, ()):
        m = re.search(rf"(?i)\b{name}\s+v?(\d+)\.(\d+)(?:\.(\d+))?(\.?(?:a|b|rc|dev)\d*)?", row.notes)
        if m:
            return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), 0 if m.group(4) else 1
    return None


def version_params(row: Measurement, engine: str) -> tuple[dict, list[str]]:
    """Knobs the row's engine version had (VERSION_KNOBS) and the reasons."""
    version = engine_version(row, engine)
    params: dict = {}
    why: list[str] = []
    for eng, since, below, knobs, source in VERSION_KNOBS:
        if eng == engine and version is not None and (since is None or version >= since) and version < below:
            params.update(knobs)
            why.append(f"{engine} {'.'.join(map(str, version[:3]))}: {knobs} ({source})")
    return params, why


# llama.cpp names builds by their commit count: llama-bench prints 'build: d46dbc76 (2833)'
_LLAMACPP_BUILD = re.compile(r"\bbuild:? [0-9a-f]{7,40} \((\d+)\)")
LLAMACPP_MMQ_DEFAULT_BUILD = 3216   # PR #8075 'CUDA: use MMQ instead of cuBLAS by default' (a818f3028, tag b3216)


# a row's notes saying its run had FlashAttention off: llama-bench's '-fa 0' (its default until PR #15434) as printed
# or stated by the transcriber
_FLASH_ATTN_OFF = re.compile(r"(?i)flash attention off|(?<![\w-])-fa 0\b|--flash-attn (?:off|0)\b")


def llamacpp_build_params(row: Measurement) -> tuple[dict, str]:
    """(knobs, reasons) of a llama.cpp run: quantized prompts through cuBLAS in a build older than b3216, and
    FlashAttention off where the notes say so."""
    params: dict = {}
    why: list[str] = []
    m = _LLAMACPP_BUILD.search(row.notes)
    if m is not None and int(m.group(1)) < LLAMACPP_MMQ_DEFAULT_BUILD:
        params["cuda_force_cublas"] = True
        why.append(f"llama.cpp build {m.group(1)} predates b{LLAMACPP_MMQ_DEFAULT_BUILD} (PR #8075): quantized "
                   "weights over 32 tokens dequantized for cuBLAS")
    if _FLASH_ATTN_OFF.search(row.notes):
        params["flash_attn"] = "off"
        why.append("FlashAttention off, as the notes say (llama-bench -fa 0, its default before PR #15434)")
    return params, "; ".join(why)


def engine_params(row: Measurement, engine: str) -> tuple[dict, str]:
    """(engine params, note) the row's benchmark tool, engine version and quoted engine flags set; ({}, '')."""
    # perf-overview's throughput tables come from trtllm-bench; its online serving table from the Triton backend
    tool = ("trtllm-bench" in row.notes or "perf-overview" in row.notes + row.source) and "triton" not in \
        row.notes.lower()
    params, why = version_params(row, engine)
    flags, ignored = quoted_flags(row, engine)   # applied last: what the notes quote overrides every default
    if engine == "llamacpp" and (built := llamacpp_build_params(row))[0]:
        params.update(built[0])
        why.append(built[1])
    if (ladder := sglang_ladder_params(row, engine)) and "mem_fraction_static" not in flags:
        params.update(ladder)
        why.append(f"SGLang before v0.4.7 chose mem_fraction_static by TP: {ladder} (ServerArgs; PR #7054 replaced it)")
    if harness := vllm_v060_post_params(row, engine):
        params.update(harness)
        why.append(f"the server parameters of the suite vLLM's v0.6.0 post ran {harness} (nightly-tests.json)")
    if engine == "lmdeploy" and (scripted := lmdeploy_benchmark_params(row)):
        params.update(scripted)
        why.append(f"the benchmark scripts' config.ini {scripted} (benchmark/benchmark_*.sh @3e391df4)")
    if engine == "trtllm" and tool and row.input_len and row.output_len:
        p = trtllm_bench_params(row)
        why.append(f"trtllm-bench settings max_batch_size={p['max_batch_size']} max_num_tokens={p['max_num_tokens']}")
        return {**params, **p}, "; ".join(why)
    params.update(flags)
    notes = [*why, f"engine flags from the notes: {flags}" if flags else "",
             f"flags not modelled: {' '.join(sorted(set(ignored)))}" if ignored else "",
             "cpu_kv_offload=true not applied: the notes state no offload size (e.g. --kv-offloading-size)"
             if row.note_flag("cpu_kv_offload") and "kv_offloading_size" not in params else ""]
    return params, "; ".join(n for n in notes if n)
