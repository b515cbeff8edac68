"""Strict dict -> frozen dataclass conversion: unknown keys, wrong types and bad values become InputError."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

import yaml

from simengine.errors import InputError, did_you_mean

_MISSING = dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric field accepts, declared on its type: `Annotated[int, Range(1, 1 << 20)]`. Values
    outside are typos, not experiments; NaN and infinities are never accepted. `above`: the low end is exclusive;
    `also`: single values outside the range that mean something (llama.cpp's -1 = unlimited); `unit`: what the
    number counts, said in the error."""

    lo: float
    hi: float
    above: bool = False
    also: tuple[float, ...] = ()
    unit: str = ""

    def check(self, value: float, *, source: str | None, field: str) -> None:
        if value in self.also:
            return
        low_ok = value > self.lo if self.above else value >= self.lo
        if not (math.isfinite(value) and low_ok and value <= self.hi):
            span = f"{'(' if self.above else '['}{_num(self.lo)}, {_num(self.hi)}]"
            extra = "".join(f" or {_num(v)}" for v in self.also)
            unit = f" {self.unit}" if self.unit else ""
            raise InputError(f"must be in {span}{extra}{unit}, got {value}", source=source, field=field)


def _num(x: float) -> str:
    x = float(x)
    return str(int(x)) if x.is_integer() and abs(x) < 1e15 else f"{x:g}"


# Declared ranges shared by many fields (one-off fields write Annotated[T, Range(...)] themselves). The upper ends
# catch unit slips and typos with a wide margin over any real deployment.
MAX_TOKENS = 10_000_000        # one prompt, output or context; 10M is the longest context any released model claims
Tokens = Annotated[int, Range(1, MAX_TOKENS, unit="tokens")]          # a token count of at least one
Sequences = Annotated[int, Range(1, 1_000_000, unit="requests")]      # requests in a batch, slots, sequences
BlockTokens = Annotated[int, Range(1, 65_536, unit="tokens per block")]
MemoryFraction = Annotated[float, Range(0, 1, above=True, unit="(a fraction of memory, not a percentage)")]
Share = Annotated[float, Range(0, 1, unit="(a fraction, not a percentage)")]
HostSeconds = Annotated[float, Range(0, 10, unit="seconds")]          # host time of one step or sequence
PoolSize = Annotated[int, Range(1, 1_000_000_000, unit="tokens or blocks")]   # a whole KV pool


class Checked:
    """Base of configuration dataclasses: construction (from YAML or from Python) checks every declared Range. A
    subclass with its own __post_init__ calls super().__post_init__() first."""

    def __post_init__(self) -> None:
        cls: Any = type(self)   # a class is hashable (the cache's key), whatever its instances are
        for name, tp in _annotated_hints(cls).items():
            value = getattr(self, name)
            if value is None or isinstance(value, bool):
                continue
            if isinstance(value, int | float):
                if (r := range_of(tp)) is not None:
                    r.check(value, source=None, field=name)
            elif isinstance(value, tuple | list):   # a range on the item type: tuple[Annotated[int, Range], ...]
                if get_origin(tp) in (typing.Union, types.UnionType):   # list[...] | None
                    tp = next(a for a in get_args(tp) if a is not type(None))
                r = next((r for a in get_args(tp) if (r := range_of(a)) is not None), None)
                for i, v in enumerate(value):
                    if r is not None and isinstance(v, int | float) and not isinstance(v, bool):
                        r.check(v, source=None, field=f"{name}[{i}]")


@functools.cache
def _annotated_hints(cls: Any) -> dict[str, Any]:
    return {k: v for k, v in get_type_hints(cls, include_extras=True).items()
            if k in {f.name for f in dataclasses.fields(cls)}}


def range_of(tp: Any) -> Range | None:
    """The Range declared on a field's type (looking inside Optional), or None."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        found = [r for a in get_args(tp) if (r := range_of(a)) is not None]
        return found[0] if found else None
    if get_origin(tp) is Annotated:
        return next((m for m in tp.__metadata__ if isinstance(m, Range)), None)
    return None
_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")  # exponent forms PyYAML leaves as strings


class _Strict:
    """A safe loader (no Python tags, nothing executed) that also refuses duplicate keys: YAML says a key appears
    once, and PyYAML would otherwise keep the last copy without a word."""

    source = ""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
                line = key_node.start_mark.line + 1
                if key is not None and key in seen:
                    raise InputError(f"duplicate key (first on line {seen[key]}); keep only one",
                                     source=f"{self.source}:{line}", field=str(key))
                seen.setdefault(key, line)
        return super().construct_mapping(node, deep=deep)  # type: ignore[misc]


class _StrictLoader(_Strict, yaml.SafeLoader):
    """The pure-Python parser: its messages name the offending character (a tab), so it words every syntax error."""


# libyaml's parser when PyYAML was built with it: 8x faster on the model catalog
class _FastLoader(_Strict, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """libyaml's parser, the same constructors."""


def _parse(cls: type, text: str, source: str) -> Any:
    loader = cls(text)
    loader.source = source
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_yaml(path: Path) -> Any:
    """Read a YAML file with a safe loader only; every failure is an InputError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("file not found", source=str(path)) from None
    except IsADirectoryError:
        raise InputError("is a directory; give a YAML file", source=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read file ({exc.__class__.__name__}); save it as UTF-8 text",
                         source=str(path)) from None
    if not text.strip():
        raise InputError("file is empty; write a YAML mapping", source=str(path))
    try:
        try:
            data = _parse(_FastLoader, text, str(path))
        except yaml.YAMLError:   # parse again with the pure loader, whose messages the fixes below read
            data = _parse(_StrictLoader, text, str(path))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if "constructor for the tag" in problem:
            m = re.search(r"'([^']*)'", problem)
            tag = (m.group(1) if m else "").replace("tag:yaml.org,2002:", "!!")
            raise InputError(f"YAML tag {tag} is not allowed: files are plain data (no Python objects); remove the "
                             "tag", source=where) from None
        fix = "indent with spaces, not tabs" if "'\\t'" in problem else "fix the syntax (is the file truncated?)"
        raise InputError(f"invalid YAML ({problem}); {fix}", source=where) from None
    if data is None:
        raise InputError("file holds no data (only comments?); write a YAML mapping", source=str(path))
    return data


def from_dict(cls: type, data: Any, *, source: str | None, field: str = "") -> Any:
    """Build dataclass `cls` from `data`, rejecting unknown keys and mistyped values with the field path."""
    if isinstance(data, cls):
        return data
    if isinstance(data, str) and hasattr(cls, "from_name"):  # e.g. an engine given by name only
        return cls.from_name(data)
    if not isinstance(data, dict):
        hint = "; is the file truncated?" if data is None else ""
        if isinstance(data, int | float) and not isinstance(data, bool) and "dist" in {f.name for f in
                                                                                        dataclasses.fields(cls)}:
            hint = f"; a distribution is a mapping, e.g. {{dist: constant, value: {data:g}}}"
        raise InputError(f"expected a mapping for {cls.__name__}, got {_kind(data)}{hint}", source=source,
                         field=field or None)
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{field}.{key}" if field else str(key)
        if key not in fields:
            raise InputError(
                f"unknown key{did_you_mean(key, fields)}; valid keys: "
                f"{', '.join(sorted(fields)) or 'none (remove it)'}",
                source=source, field=path)
        kwargs[key] = convert(hints[key], value, source=source, field=path)
    missing = [name for name, f in fields.items()
               if name not in kwargs and f.default is _MISSING and f.default_factory is _MISSING]
    if missing:
        path = f"{field}.{missing[0]}" if field else missing[0]
        also = f" (and {', '.join(missing[1:])}: give each)" if len(missing) > 1 else ""
        raise InputError(f"required key is missing{also}", source=source, field=path)
    try:
        return cls(**kwargs)
    except InputError as exc:
        raise exc.located(source, field or None) from None
    except (ValueError, TypeError) as exc:
        raise InputError(str(exc), source=source, field=field or None) from None


def convert(tp: Any, value: Any, *, source: str | None, field: str) -> Any:
    """Convert one YAML value to type `tp` (scalars, Optional, Literal, list, tuple, dict, dataclass)."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(arg, value, source=source, field=field)
            except InputError as exc:
                errors.append(exc)
        raise errors[0]
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise InputError(f"'{value}' is not one of {', '.join(map(str, allowed))}"
                             f"{did_you_mean(value, map(str, allowed))}", source=source, field=field)
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise InputError(f"expected a list, got {_kind(value)}", source=source, field=field)
        (item_tp, *_rest) = get_args(tp) or (Any,)
        items = [convert(item_tp, v, source=source, field=f"{field}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise InputError(f"expected a mapping, got {_kind(value)}", source=source, field=field)
        _, val_tp = get_args(tp) or (Any, Any)
        return {str(k): convert(val_tp, v, source=source, field=f"{field}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source=source, field=field)  # type: ignore[arg-type]  # a dataclass type
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise InputError(f"expected true or false, got {_kind(value)}", source=source, field=field)
        return value
    if tp in (int, float) and isinstance(value, str) and _NUMBER.match(value):
        value = float(value)  # YAML 1.1 reads 1e12 as a string; YAML 1.2 and JSON read it as a number
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise InputError(f"expected an integer, got {_kind(value)}", source=source, field=field)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InputError(f"expected a number, got {_kind(value)}", source=source, field=field)
        if math.isnan(value):
            raise InputError("NaN is not a number; give a finite value", source=source, field=field)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise InputError(f"expected a string, got {_kind(value)}", source=source, field=field)
        return value
    raise TypeError(f"unsupported config type {tp!r} for {field}")


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    return f"{type(value).__name__} {value!r}"[:80]


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split a --set 'a.b.c=value' into a key path and a YAML-parsed value."""
    if "=" not in text:
        raise InputError(f"'{text}' is not key.path=value", field="--set")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise InputError(f"'{text}' has an empty key", field="--set")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        if raw.lstrip().startswith(("{", "[")):   # meant as a mapping or a list: say why it is not one
            raise InputError(f"the value of '{text}' is not valid YAML (an unclosed bracket or brace?)",
                             field="--set") from None
        value = raw   # plain text with YAML punctuation (a path, a label): taken as written
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply dotted --set overrides to a raw scenario mapping (a copy is returned)."""
    import copy

    data = copy.deepcopy(data)
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            if isinstance(node, list):
                node = _list_item(node, k, text)
                continue
            if not isinstance(node.get(k), dict | list):
                node[k] = {}
            node = node[k]
        last = keys[-1]
        if isinstance(node, list):
            node[_index(node, last, text)] = value
        else:
            node[last] = value
    return data


def _index(node: list, key: str, text: str) -> int:
    if not key.isdigit() or int(key) >= len(node):
        raise InputError(f"'{key}' is not an index of a list of {len(node)} in '{text}'", field="--set")
    return int(key)


def _list_item(node: list, key: str, text: str) -> Any:
    i = _index(node, key, text)
    if isinstance(node[i], str):  # an engine given by name: expand it so params can be set
        node[i] = {"engine": node[i]}
    return node[i]


def check_fraction(value: float, field: str) -> None:
    """Raise unless 0 < value <= 1."""
    if not (0.0 < value <= 1.0):
        raise InputError(f"must be in (0, 1], got {value}", field=field)
