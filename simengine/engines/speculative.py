"""Speculative decoding as the engines that have it run it: proposals per step, acceptance, and the proposer's memory.

Mechanism (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318): a proposer drafts k tokens
for a decoding request; the target model scores the request's last token and the k drafts in one forward (k + 1
query tokens over its context) and keeps the drafts up to the first it rejects, plus one token of its own, so a step
yields 1 to k + 1 tokens per request. The KV the rejected drafts wrote is discarded: `num_computed_tokens` rolls
back to the accepted tokens (EnginePolicy.update), while the slots stay allocated or are freed as the engine does.

Proposers (what `method` names; the cost of each is priced in cost/step.py `Proposer`):
- ngram: prompt lookup on the host (the longest suffix match in the request's own tokens); no GPU work;
- eagle, eagle3: a one-layer draft head over the target's hidden states, run k times (Li et al. 2024,
  arXiv:2401.15077; EAGLE-3, arXiv:2503.01840);
- mtp: the model's own multi-token-prediction layer (DeepSeek-V3, arXiv:2412.19437 §2.2), run k times;
- draft_model: a smaller model of the same tokenizer (e.g. Llama-3.2-1B for Llama-3.1-70B), run k times.

Acceptance is a property of the text and the proposer, not of the engine: draft position i (1..k) is accepted, given
positions 1..i-1 were, with probability `acceptance[i-1]` (the last rate repeats deeper). The draw for a request's
output position is a hash of the request, the position and the token there, so every engine sees the same
acceptance for the same request, and runs are reproducible. The published default rates per method and dataset are
in ACCEPTANCE with their sources; a scenario can give its own (`acceptance`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Literal

from simengine.config.loader import Checked, Range
from simengine.config.model import ModelSpec, load_model
from simengine.core.request import Request
from simengine.engines.memory import Deployment
from simengine.errors import InputError

DATASETS = ("chat", "code", "summarization", "math")
# the simulator's acceptance knobs as every engine's params spell them (beside each engine's own names)
AcceptanceDataset = Literal["chat", "code", "summarization", "math"]
AcceptanceRates = list[Annotated[float, Range(0, 1)]] | None

# Host time of one prompt-lookup proposal (the longest n-gram suffix match over a request's tokens, vLLM's
# NgramProposer in numba). ESTIMATE: ~10 us per request for contexts of a few thousand tokens.
NGRAM_LOOKUP_S = 10e-6

# Conditional acceptance of draft positions 1, 2, 3, ... (the last repeats) per (method, dataset). Where a source gives
# only an average acceptance length, the rates are the ones that reproduce it.
ACCEPTANCE: dict[tuple[str, str], tuple[float, ...]] = {}


def _fill_defaults() -> None:
    # mtp: DeepSeek-V3 Technical Report (arXiv:2412.19437) §5.4.3: "the acceptance rate of the second token
    # prediction ranges between 85% and 90% across various generation topics" (one MTP module): 0.875 for position 1.
    # The module reused deeper: nebius/MTP-DeepSeek-V3-0324 model card measures the original module's mean accepted
    # length 3.20 with 7 drafts (temperature 0, MT-bench, HumanEval, GSM8K), which 0.62 for each deeper position
    # reproduces (1 + 0.875 (1 + 0.62 + ... + 0.62^6) = 3.2).
    for d in DATASETS:
        ACCEPTANCE[("mtp", d)] = (0.875, 0.62)
    # eagle, eagle3: ESTIMATE. EAGLE (arXiv:2401.15077) reports per-position chain acceptance ("n-alpha") of about
    # 0.7-0.8 on MT-bench; EAGLE-3 (arXiv:2503.01840) trains on the target's outputs and lengthens the accepted run
    # (SGLang's docs, speculative_decoding.md: Llama-3.1-8B on one H100, MT-bench, batch 1: 158 tok/s without
    # speculation, 244 with EAGLE-2, 373 with EAGLE-3, with 5 steps, top-4, 8 draft tokens). Code and math are more
    # predictable than chat (EAGLE-3's HumanEval and GSM8K lengths exceed MT-bench's): +0.05; summarisation as chat.
    eagle = (0.78, 0.74, 0.72, 0.70)
    eagle3 = (0.85, 0.82, 0.80, 0.78)
    for d in DATASETS:
        bump = 0.05 if d in ("code", "math") else 0.0
        ACCEPTANCE[("eagle", d)] = tuple(min(0.95, a + bump) for a in eagle)
        ACCEPTANCE[("eagle3", d)] = tuple(min(0.95, a + bump) for a in eagle3)
    # draft_model: ESTIMATE. Leviathan et al. 2023 (arXiv:2211.17192) measure the expected acceptance of one draft
    # token between about 0.5 and 0.8 for small drafts of T5-XXL and LaMDA; for a same-family draft a tenth of the
    # target's size (Llama-3.2-1B for Llama-3.1-8B/70B): 0.75 on chat, 0.8 on code and math, 0.72 on summarisation.
    for d, a in (("chat", 0.75), ("code", 0.8), ("math", 0.8), ("summarization", 0.72)):
        ACCEPTANCE[("draft_model", d)] = (a,)
    # ngram (prompt lookup) proposes only where the output repeats its context: high on summarisation and code
    # editing, low on open chat (vLLM's blog 'How Speculative Decoding Boosts vLLM Performance by up to 2.8x',
    # 2024-10: up to 2.8x on CNN/DailyMail summarisation with Llama-3-70B on 4 H100 at low QPS). ESTIMATE: 0.6
    # summarisation, 0.4 code, 0.2 math, 0.1 chat (a lookup that finds nothing counts as a rejection here).
    for d, a in (("summarization", 0.6), ("code", 0.4), ("math", 0.2), ("chat", 0.1)):
        ACCEPTANCE[("ngram", d)] = (a,)


_fill_defaults()


@dataclass(frozen=True)
class Speculation:
    """One engine's speculative decoding, in the engine-neutral terms the mechanics need."""

    method: str                       # ngram | eagle | eagle3 | mtp | draft_model
    num_tokens: int                   # drafts verified per decoding request per step (k)
    acceptance: tuple[float, ...]     # conditional acceptance of draft positions 1.. (the last repeats)
    max_batch: int | None = None      # no drafts in a step whose decoding batch is larger (None: always)
    draft_model: ModelSpec | None = None  # the draft_model method's model
    lookahead_tokens: int = 0         # KV slots a decoding request holds past its verified tokens for the drafts
    # a token tree (SGLang's topk > 1): the k drafts are spread over `depth` positions, `width` candidates each on
    # average, and a position is accepted when any of its candidates is; a chain has depth k and width 1
    depth: int = 0                    # 0: num_tokens
    width: float = 1.0
    batched_drafts: bool = True       # the draft runs for the batch at once (False: one request at a time, llama.cpp)

    def rate(self, position: int) -> float:
        """Acceptance of draft position `position` (1-based) given the earlier ones were accepted: the method's
        rate, or for a tree the chance that one of `width` candidates is right (as if each were an independent
        draw: an upper bound, since a draft's candidates are its most likely tokens, not independent guesses)."""
        a = self.acceptance
        r = a[position - 1] if position <= len(a) else a[-1]
        return r if self.width == 1.0 else 1.0 - (1.0 - r) ** self.width

    def expected_tokens(self, k: int | None = None) -> float:
        """Expected tokens a step yields per request with `k` proposals (default num_tokens): 1 + sum of the
        probabilities that positions 1..i are all accepted."""
        k = self.num_tokens if k is None else k
        total, p = 1.0, 1.0
        for i in range(1, min(k, self.depth or k) + 1):
            p *= self.rate(i)
            total += p
        return total

    def proposals(self, req: Request, batch: int, max_model_len: int) -> int:
        """Drafts to verify for decoding `req` in a step of `batch` decoding requests: num_tokens, none above
        max_batch, and never past the request's last output token or the context limit."""
        if self.max_batch is not None and batch > self.max_batch:
            return 0
        room = min(req.output_len - req.num_output_tokens - 1, max_model_len - req.num_computed_tokens - 1)
        k = self.num_tokens
        return k if k <= room else max(room, 0)

    def accepted(self, req: Request, k: int) -> int:
        """How many of the `k` drafts verified for `req` this step the target accepts (drafts for output positions
        num_output_tokens .. + k - 1)."""
        base = req.prompt_len + req.num_output_tokens
        tokens, rid = req.token_ids, req.request_id
        if self.depth and self.depth < k:
            k = self.depth
        for i in range(k):
            pos = base + i
            if _uniform(rid, pos, int(tokens[pos])) >= self.rate(i + 1):
                return i
        return k


_MASK = (1 << 64) - 1


def _uniform(request_id: int, position: int, token: int) -> float:
    """A uniform [0, 1) draw fixed by (request, position, token): splitmix64 of their mix."""
    x = (request_id * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + token * 0x94D049BB133111EB
         + 0x632BE59BD9B4E019) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    return (x >> 11) / float(1 << 53)


@dataclass(frozen=True, kw_only=True)
class AcceptanceKnobs(Checked):
    """The simulator's acceptance model beside an engine's speculative knobs (no engine has these: acceptance is a
    property of the text and the proposer)."""

    acceptance: AcceptanceRates = None  # per draft position (the last repeats); None:
                                                                    # the published default of the method and dataset
    acceptance_dataset: AcceptanceDataset = "chat"


# models with a multi-token-prediction layer (config.json num_nextn_predict_layers)
MTP_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm4_moe", "mimo", "qwen3_next")


def resolve(method: str, num_tokens: int, knobs: AcceptanceKnobs, *, target: ModelSpec, at: str,
            draft_model: str | None = None, model_field: str = "model", max_batch: int | None = None,
            lookahead: bool = False, depth: int = 0, width: float = 1.0, batched_drafts: bool = True) -> Speculation:
    """A Speculation from an engine's knobs (`at` names the engine's params block for messages)."""
    rates = tuple(knobs.acceptance) if knobs.acceptance else ACCEPTANCE[(method, knobs.acceptance_dataset)]
    draft = None
    if method == "draft_model":
        if not draft_model:
            raise InputError("the draft model method needs a draft model; name one from the catalog (e.g. "
                             "llama-3.2-1b)", field=f"{at}.{model_field}")
        draft = load_model(draft_model, field=f"{at}.{model_field}")
        if draft.vocab_size != target.vocab_size:
            raise InputError(f"draft model {draft.name} has a vocabulary of {draft.vocab_size} tokens, "
                             f"{target.name} of {target.vocab_size}; a draft must share the target's tokenizer",
                             field=f"{at}.{model_field}")
    elif draft_model:
        raise InputError(f"a draft model is only used with a separate draft model, not {method}",
                         field=f"{at}.{model_field}")
    if method == "mtp" and target.model_type not in MTP_MODEL_TYPES:
        raise InputError(f"{target.name} has no multi-token-prediction layer; use eagle3, ngram or a draft model",
                         field=at)
    return Speculation(method=method, num_tokens=num_tokens, acceptance=rates, max_batch=max_batch,
                       draft_model=draft, lookahead_tokens=num_tokens if lookahead and method != "ngram" else 0,
                       depth=depth, width=width, batched_drafts=batched_drafts)


def draft_head(target: ModelSpec) -> ModelSpec:
    """The one-layer draft network of eagle, eagle3 and mtp: one decoder layer of the target's shape (an MoE layer
    for an MoE target's MTP module) with the target's vocabulary."""
    return dataclasses.replace(target, name=f"{target.name}-draft-head", num_layers=1,
                               num_moe_layers=1 if target.num_moe_layers else 0, num_sliding_layers=0,
                               sliding_window=0)


def proposer_model(spec: Speculation, target: ModelSpec) -> ModelSpec | None:
    """The model whose forward passes draft the tokens (None for ngram)."""
    if spec.method == "ngram":
        return None
    return spec.draft_model if spec.method == "draft_model" else draft_head(target)


def with_proposer(dep: Deployment, spec: Speculation | None) -> Deployment:
    """The deployment with the proposer's weights and KV on each device (they come out of the KV pool as in the
    engines, which profile memory with the draft loaded): the draft model's whole weights and KV; for a draft head,
    one layer's weights (the head shares the target's embedding and LM head) and one layer's KV."""
    if spec is None:
        return dep
    model = proposer_model(spec, dep.model)
    if model is None:
        return dep
    fmt = dep.weight_format
    if spec.method == "draft_model":
        weights = sum(model.stored_bytes(fmt))
    else:
        weights = (model.dense_linear_params * fmt.dense_bytes_per_param
                   + model.routed_expert_params_total * fmt.bytes_per_param)
    kv_per_token = model.kv_bytes_per_token(dep.kv_elem_bytes)
    if not model.kv_latent_dim:   # KV heads split by tp as the target's (replicated past their count)
        kv_per_token *= max(1.0, model.num_kv_heads / dep.attention_tp) / model.num_kv_heads
    return dataclasses.replace(dep, proposer_weight_bytes_per_device=weights / dep.num_devices,
                               proposer_kv_bytes_per_token_per_device=kv_per_token / dep.pp)
