"""llama-server's flags, the deployments it runs and the n_ctx --fit sizes (ggml-org/llama.cpp common/common.h,
tools/server, master 001d906). The server loop that uses them is engines/llamacpp.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Literal

from simengine.config.dtypes import WEIGHT_FORMATS
from simengine.config.loader import MAX_TOKENS, Checked, Range, Sequences, Share, Tokens
from simengine.engines.devices import gpu_visible_bytes
from simengine.engines.memory import GIB, Deployment, activation_reserve_bytes
from simengine.engines.speculative import AcceptanceDataset, AcceptanceKnobs, AcceptanceRates, Speculation, resolve
from simengine.errors import CannotRun, InputError

MIB = 2**20
# ESTIMATE: driver context outside ggml's buffers (CUDA context 0.3-0.5 GiB; Metal/Vulkan/OpenCL similar).
DRIVER_CONTEXT_BYTES = 0.4 * GIB
GGUF_WEIGHT_DTYPES = ("fp32", "fp16", "bf16", "q8_0", "q4_0", "q4_k_m", "mxfp4")  # ggml tensor types llama.cpp runs


@dataclass(frozen=True, kw_only=True)
class LlamaCppParams(Checked):
    """llama-server flags (long names, dashes as underscores). Defaults from common/common.h at 001d906."""

    n_parallel: Sequences | None = None  # -np; None (or 1 without -kvu): 4 slots, unified KV (server.cpp, #16736)
    kv_unified: bool | None = None       # -kvu; None: true when n_parallel was auto-set (same)
    # -c; 0: the model's training context, shrunk by --fit (common.h n_ctx)
    ctx_size: Annotated[int, Range(0, MAX_TOKENS)] = 0
    fit: bool = True                     # --fit (common.h fit_params)
    # --fit-target: MiB --fit leaves free per device (common.h fit_params_target)
    fit_target: Annotated[int, Range(0, 1 << 24)] = 1024
    fit_ctx: Tokens = 4096               # --fit-ctx: smallest n_ctx --fit shrinks to (common.h fit_params_min_ctx)
    batch_size: Tokens = 2048            # -b: logical batch n_batch (common.h)
    ubatch_size: Tokens = 512            # -ub: physical batch n_ubatch (common.h)
    # build option GGML_CUDA_FORCE_CUBLAS (off; ggml-org/llama.cpp PR #8075, b3216): quantized weights in ubatches
    # over 32 tokens dequantized to F16 for cuBLAS instead of MMQ, as CUDA builds before b3216 did on tensor-core GPUs
    cuda_force_cublas: bool = False
    # CUDA graphs for single-token forwards (ggml-cuda, PR #6766, merged 2024-05; GGML_CUDA_DISABLE_GRAPHS=1 turns
    # them off at run time): off, every kernel of a decode step is launched from the host, as before that PR
    cuda_graphs: bool = True
    # -fa, --flash-attn: auto (common.h, PR #15434, 2025-08) turns it on where the backend has the kernel, which
    # every backend modelled here has for these models; builds before then ran without it unless -fa was given
    flash_attn: Literal["on", "off", "auto"] = "auto"
    cont_batching: bool = True           # -cb (common.h cont_batching)
    context_shift: bool = False          # --context-shift (common.h ctx_shift)
    cache_prompt: bool = True            # request field cache_prompt, on by default (common.h)
    # --cache-ram: MiB of host prompt cache, 0 off, -1 half the host RAM free at startup (common.h @001d906; taken
    # as no limit here: the host's memory is not modelled)
    cache_ram: Annotated[int, Range(0, 1 << 30, also=(-1,))] = 8192
    cache_idle_slots: bool = True        # --cache-idle-slots: save idle slots to the RAM cache (common.h)
    slot_prompt_similarity: Share = 0.1  # -sps; 0 disables similarity-based slot choice (common.h)
    # speculative decoding with a draft model (-md / --spec-draft-model; a catalog name here): each generating slot
    # drafts up to spec_draft_n_max tokens with it, one slot at a time, and the iteration verifies them
    # (common.h common_params_speculative_draft n_max = 3 at 001d906; --draft-max, default 16, in older builds)
    model_draft: str | None = None
    spec_draft_n_max: Annotated[int, Range(1, 256)] = 3
    # the simulator's acceptance model (engines/speculative.py AcceptanceKnobs), not llama.cpp flags
    spec_acceptance: AcceptanceRates = None
    spec_acceptance_dataset: AcceptanceDataset = "chat"

    def __post_init__(self):
        super().__post_init__()
        if self.context_shift:
            raise InputError("true is not modelled (shifting discards KV mid-sequence, which the simulator's token "
                             "accounting cannot represent); leave the default false", field="context_shift")


def llamacpp_check_deployment(dep: Deployment) -> None:
    """Refuse what llama.cpp cannot run: non-GGUF weights, an fp8 KV cache, tensor parallelism."""
    if dep.weight_format.name not in GGUF_WEIGHT_DTYPES:
        raise CannotRun(f"llama.cpp runs GGUF weights; '{dep.weight_format.name}' has no ggml type; valid: "
                        f"{', '.join(GGUF_WEIGHT_DTYPES)} (q8_0, q4_0 and q4_k_m are GGUF's 8- and 4-bit formats)",
                        field="deployment.weight_dtype")
    if dep.kv_dtype == "fp8":
        raise CannotRun("llama.cpp has no fp8 KV cache type (-ctk/-ctv: f16, bf16, q8_0, q4_0, ...); use bf16, "
                        "int8 (~q8_0) or int4 (~q4_0)", field="deployment.kv_dtype")
    if dep.tp > 1:
        raise CannotRun("llama.cpp splits layers across devices (--split-mode layer, the default), not tensors; "
                        "use deployment.pp instead of tp", field="deployment.tp")


def gguf_tensor_types(dep: Deployment) -> Deployment:
    """The deployment's weights as the GGUF files llama.cpp loads store them. gpt-oss's MXFP4 GGUF keeps the
    experts in MXFP4 and every other tensor (attention, router, embedding, output) in Q8_0, 34 bytes per 32: the
    file's size says so (lmstudio-community/gpt-oss-20b-GGUF gpt-oss-20b-MXFP4.gguf, 12,109,565,632 bytes: the
    19.11 G expert weights at 17 bytes per 32 take 10.15 GB, the other 1.80 G weights the remaining 1.96 GB, 1.09
    bytes each with the f32 norms and biases), where the HF checkpoint holds them in BF16."""
    fmt = dep.weight_format
    if fmt.name != "mxfp4":
        return dep
    q8 = WEIGHT_FORMATS["q8_0"].bytes_per_param
    return dataclasses.replace(dep, weight_format=dataclasses.replace(
        fmt, dense_bytes=q8, embedding_bytes=q8, lm_head_bytes=q8,
        source=fmt.source + "; GGUF: the other tensors Q8_0"))


def llamacpp_fit_ctx(p: LlamaCppParams, dep: Deployment) -> int:
    """n_ctx cells: the training context (or -c), shrunk by --fit to what device memory holds (>= fit_ctx)."""
    want = p.ctx_size or dep.model.max_model_len
    fixed = (dep.weight_bytes_per_device + DRIVER_CONTEXT_BYTES + p.fit_target * MIB * p.fit
             + activation_reserve_bytes(dep, min(p.ubatch_size, p.batch_size), p.ubatch_size))  # compute buffer
    room = int((gpu_visible_bytes(dep.hardware) - fixed) // dep.kv_bytes_per_token_per_device)
    if want <= room:
        return want
    if p.fit and not p.ctx_size and room >= p.fit_ctx:
        return room
    hw = dep.hardware
    raise CannotRun(
        f"{dep.model.name} with n_ctx {want if p.ctx_size else p.fit_ctx} does not fit on {hw.name} with "
        f"llama.cpp: weights {dep.weight_bytes_per_device / GIB:.1f} GiB of "
        f"{gpu_visible_bytes(hw) / GIB:.1f} GiB usable leave room for {max(room, 0)} KV cells; --fit would move "
        f"layers to the CPU (not modelled): use a smaller weight_dtype (q4_0), a smaller ctx_size or more devices",
        field="deployment")


def llamacpp_speculation(p: LlamaCppParams, dep: Deployment) -> Speculation | None:
    """Speculative decoding with the draft model -md names (None: off)."""
    if p.model_draft is None:
        return None
    knobs = AcceptanceKnobs(acceptance=p.spec_acceptance, acceptance_dataset=p.spec_acceptance_dataset)
    return resolve("draft_model", p.spec_draft_n_max, knobs, target=dep.model, at="model_draft",
                   draft_model=p.model_draft, model_field="model_draft", batched_drafts=False)
