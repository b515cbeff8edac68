"""How each engine spells speculative decoding (engines/speculative.py), for the tests that switch it on. (Not in
conftest.py: the fuzz suite imports it, and importing conftest again would reload the default Hypothesis profile.)"""

from __future__ import annotations

# engines with speculative decoding and how each spells it (engines/speculative.py); `method` is mapped to what the
# engine has: llama.cpp drafts with a model, TGI with n-grams
SPEC_ENGINES = ("vllm", "sglang", "trtllm", "llamacpp", "tgi")


def spec_params(engine: str, method: str, k: int, acceptance: list[float] | None = None,
                draft: str = "llama-3.2-1b") -> dict:
    """Engine params switching speculative decoding on: `method` with `k` drafts a step (a chain)."""
    if engine == "vllm":
        return {"speculative_config": {"method": method, "num_speculative_tokens": k, "acceptance": acceptance,
                                       **({"model": draft} if method == "draft_model" else {})}}
    if engine == "sglang":
        algo = {"eagle": "EAGLE", "eagle3": "EAGLE3", "ngram": "NGRAM", "draft_model": "STANDALONE"}[method]
        return {"speculative_algorithm": algo, "speculative_num_steps": k, "speculative_eagle_topk": 1,
                "speculative_num_draft_tokens": k + 1, "speculative_acceptance": acceptance,
                **({"speculative_draft_model_path": draft} if method == "draft_model" else {})}
    if engine == "trtllm":
        kind = {"eagle": "Eagle3", "eagle3": "Eagle3", "ngram": "NGram", "draft_model": "DraftTarget"}[method]
        return {"speculative_config": {"decoding_type": kind, "max_draft_len": k, "acceptance": acceptance,
                                       **({"speculative_model_dir": draft} if method == "draft_model" else {})}}
    if engine == "llamacpp":
        return {"model_draft": draft, "spec_draft_n_max": k, "spec_acceptance": acceptance}
    if engine == "tgi":
        return {"speculate": k, "speculate_acceptance": acceptance}
    raise ValueError(f"{engine} has no speculative decoding")
