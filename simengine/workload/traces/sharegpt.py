"""Reader for ShareGPT-style conversation datasets (e.g. ShareGPT_V3_unfiltered_cleaned_split.json).

The file is a JSON list of conversations (or, equally, JSON Lines with one conversation per line):

    {"id": ..., "conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}, ...]}

Mapping (other keys are ignored):

    "from": human | user                          -> a user turn
    "from": gpt | chatgpt | assistant | bard | bing | model -> an assistant turn
    "from": system                                -> context only (counts toward later prompts)
    "value" (string)                              -> the turn's text

Every user turn immediately followed by an assistant turn becomes one request, in file order:
    input_tokens  = tokens of every turn of the conversation up to and including that user turn
                    (the whole history is resent, as a chat client does; no chat-template overhead added)
    output_tokens = tokens of the assistant reply
A user turn not followed by an assistant reply produces no request but stays in the history. Counts of 0
(empty text) are clamped to 1.

Token counts: with tokenizer="<name>" and `transformers` importable, each turn is encoded with
AutoTokenizer.from_pretrained(name, local_files_only=True) (add_special_tokens=False) -- nothing is ever
downloaded. Otherwise (no name, no transformers, or the tokenizer is not in the local cache: a warning
says so) the estimate is ceil(len(text) / chars_per_token) per turn with chars_per_token = 4, OpenAI's rule
of thumb that one token is about 4 characters of common English text ("What are tokens and how to count
them?", OpenAI Help Center). Code and non-English text usually have more tokens per character.

Arrivals: the dataset has no timestamps, so every arrival_s is 0.0 (an offline batch); the caller assigns
arrival times (e.g. a Poisson process). Of ReplayOptions only max_requests and rate_scale change anything
(start_s must be 0; time_scale is a no-op). With rate_scale = 1 reading stops once max_requests requests
are found, so later parts of a big file are not checked.

Errors name "path:LINE" where LINE is the line on which the offending conversation starts, and the field
as "conversations[k].from" / ".value".
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from simengine.errors import InputError, unknown_name
from simengine.workload.traces.base import ReplayOptions, Trace, build_trace, check_path, not_utf8, open_error

USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "chatgpt", "assistant", "bard", "bing", "model"})
SYSTEM_ROLES = frozenset({"system"})
CHARS_PER_TOKEN = 4.0


def estimate_tokens(text: str, chars_per_token: float = CHARS_PER_TOKEN) -> int:
    """ceil(len(text) / chars_per_token): OpenAI's ~4 characters per token rule of thumb (0 for '')."""
    return math.ceil(len(text) / chars_per_token)


def _token_counter(tokenizer: str | None, chars_per_token: float) -> Callable[[str], int]:
    if tokenizer:
        try:
            from transformers import AutoTokenizer  # optional dependency
        except Exception:  # noqa: BLE001 -- any import failure means "not available"
            warnings.warn(f"transformers is not importable; estimating tokens as characters / "
                          f"{chars_per_token:g} instead of using tokenizer '{tokenizer}'", stacklevel=3)
        else:
            try:
                tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
            except Exception as exc:  # noqa: BLE001 -- not cached locally, bad name, ...
                warnings.warn(f"tokenizer '{tokenizer}' is not available locally ({exc.__class__.__name__}); "
                              f"estimating tokens as characters / {chars_per_token:g}", stacklevel=3)
            else:
                return lambda text: len(tok.encode(text, add_special_tokens=False))
    return lambda text: estimate_tokens(text, chars_per_token)


def _iter_documents(text: str, p: Path):
    """Yield (line, conversation) from a JSON list or a stream of JSON objects (JSON Lines)."""
    decoder = json.JSONDecoder()
    n = len(text)
    pos, line, counted = 0, 1, 0

    def skip(i: int) -> int:
        while i < n and text[i] in " \t\r\n":
            i += 1
        return i

    def line_of(i: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, i)
        counted = i
        return line

    def decode(i: int):
        try:
            return decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            raise InputError(f"invalid JSON at column {exc.colno} ({exc.msg}); is the file truncated?",
                             source=f"{p}:{exc.lineno}") from None

    pos = skip(0)
    if pos == n:
        raise InputError("empty file; expected a JSON list of conversations", source=f"{p}:1")
    if text[pos] == "[":
        pos = skip(pos + 1)
        if pos < n and text[pos] == "]":
            return
        while True:
            start = pos
            obj, pos = decode(pos)
            yield line_of(start), obj
            pos = skip(pos)
            if pos < n and text[pos] == ",":
                pos = skip(pos + 1)
                continue
            if pos < n and text[pos] == "]":
                if skip(pos + 1) != n:
                    raise InputError("unexpected text after the closing ']'", source=f"{p}:{line_of(pos)}")
                return
            where = line_of(min(pos, n))
            raise InputError("expected ',' or ']' between conversations (is the file truncated?)",
                             source=f"{p}:{where}")
    if text[pos] == "{":
        while pos < n:
            start = pos
            obj, pos = decode(pos)
            yield line_of(start), obj
            pos = skip(pos)
        return
    raise InputError(f"expected a JSON list of conversations, got {text[pos]!r}", source=f"{p}:{line_of(pos)}")


def read_sharegpt(path: str | Path, options: ReplayOptions, rng: np.random.Generator | None = None, *,
                  tokenizer: str | None = None, chars_per_token: float = CHARS_PER_TOKEN) -> Trace:
    """Read a ShareGPT-style JSON file into a Trace with all arrivals 0 (see the module docstring)."""
    p = check_path(path)
    if isinstance(chars_per_token, bool) or not isinstance(chars_per_token, int | float) \
            or not math.isfinite(chars_per_token) or chars_per_token <= 0:
        raise InputError(f"must be a number > 0, got {chars_per_token!r}; 4 is OpenAI's rule of thumb",
                         field="chars_per_token")
    try:
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise not_utf8(p) from None
    except OSError as exc:
        raise open_error(p, exc) from None
    count = _token_counter(tokenizer, float(chars_per_token))
    limit = options.max_requests if isinstance(options, ReplayOptions) and options.rate_scale == 1.0 else None
    valid_roles = USER_ROLES | ASSISTANT_ROLES | SYSTEM_ROLES
    ins: list[int] = []
    outs: list[int] = []
    for line, conv in _iter_documents(text, p):
        where = f"{p}:{line}"
        if not isinstance(conv, dict):
            raise InputError(f"expected a conversation object, got {type(conv).__name__}", source=where)
        turns = conv.get("conversations")
        if turns is None:
            raise InputError("missing key", source=where, field="conversations")
        if not isinstance(turns, list):
            raise InputError(f"expected a list of turns, got {type(turns).__name__}", source=where,
                             field="conversations")
        history = 0
        pending: int | None = None  # prompt tokens of a user turn waiting for its reply
        for k, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise InputError(f"expected an object with 'from' and 'value', got {type(turn).__name__}",
                                 source=where, field=f"conversations[{k}]")
            role = turn.get("from")
            if not isinstance(role, str):
                raise InputError(f"missing or non-string role: {role!r}", source=where,
                                 field=f"conversations[{k}].from")
            role = role.strip().lower()
            if role not in valid_roles:
                raise unknown_name("role", role, valid_roles, source=where, field=f"conversations[{k}].from")
            value = turn.get("value")
            if not isinstance(value, str):
                raise InputError(f"expected the turn's text as a string, got {type(value).__name__}",
                                 source=where, field=f"conversations[{k}].value")
            n = count(value)
            if role in ASSISTANT_ROLES and pending is not None:
                ins.append(pending)
                outs.append(n)
            pending = None
            history += n
            if role in USER_ROLES:
                pending = history
            if limit is not None and len(ins) >= limit:
                break
        if limit is not None and len(ins) >= limit:
            break
    if not ins:
        raise InputError("no requests: no conversation has a human turn followed by a gpt reply", source=str(p))
    if isinstance(options, ReplayOptions) and options.start_s > 0:
        raise InputError(f"ShareGPT has no timestamps (every arrival is 0), so start_s must be 0, got "
                         f"{options.start_s:g}", source=str(p), field="start_s")
    return build_trace(np.zeros(len(ins)), np.array(ins, dtype=np.int64), np.array(outs, dtype=np.int64),
                       None, 0, str(path), options, rng)
