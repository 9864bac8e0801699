"""How a settings field is declared and checked: its type (a `Literal` for choices), its help and
bounds in the field's metadata, and the checks `check_fields` and the CLI read from them. One
value quoted in a message (`quoted`) is cut here, for every refusal of a setting.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import numbers
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from parity.errors import ParityError

Dtype = Literal["fp32", "bf16", "fp16"]
RatioSource = Literal["engine", "shadow", "recompute"]
Correction = Literal["none", "token-tis", "token-mis", "token-icepop", "seq-tis", "seq-mis",
                     "geo-rs"]
LossAgg = Literal["seq-mean", "token-mean", "token-sum"]
DpoRef = Literal["initial", "engine"]
OptimizerName = Literal["adamw", "adam", "sgd"]
Parallel = Literal["ddp", "fsdp"]
CpuFp16 = Literal["emulate", "native"]
Kernels = Literal["default", "invariant"]
ServerEndpoint = Literal["auto", "completions", "chat"]
ShadowKernels = Literal["engine", "independent", "scored"]

DTYPES = typing.get_args(Dtype)
RATIO_SOURCES = typing.get_args(RatioSource)
CORRECTIONS = typing.get_args(Correction)
LOSS_AGGS = typing.get_args(LossAgg)
DPO_REFS = typing.get_args(DpoRef)
OPTIMIZERS = typing.get_args(OptimizerName)
PARALLEL = typing.get_args(Parallel)
# A device setting: `auto`, `cpu`, `cuda` or `cuda:N` (parity/devices.py resolves it).
DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"
# report_to is a comma-separated list of these, so no Literal can say it.
REPORT_TO = ("auto", "none", "tensorboard", "wandb")



@dataclass(frozen=True)
class Range:
    """Bounds of a number field; a float field must also be finite, bounded or not."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def __contains__(self, v: float) -> bool:
        return not (self._below(v) or self._above(v))

    def _below(self, v: float) -> bool:
        return ((self.ge is not None and not v >= self.ge)
                or (self.gt is not None and not v > self.gt))

    def _above(self, v: float) -> bool:
        return ((self.le is not None and not v <= self.le)
                or (self.lt is not None and not v < self.lt))

    def complaint(self, v: float, is_float: bool) -> str | None:
        """What `v` must be, naming the bound it breaks (both for a non-finite float); None when
        it is in range."""
        finite = not is_float or math.isfinite(v)
        if finite and v in self:
            return None
        low = [f"{op} {b:g}" for op, b in ((">=", self.ge), (">", self.gt)) if b is not None]
        high = [f"{op} {b:g}" for op, b in (("<=", self.le), ("<", self.lt)) if b is not None]
        if finite and self._above(v) and not self._below(v):
            return " and ".join(high)
        text = " and ".join(low if finite else low + high)
        return f"a finite number {text}".rstrip() if is_float else text


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A field with its help and checks: `ge`/`gt`/`le`/`lt` bound a number; other keywords
    (`const`, `metavar`) are kept in the metadata for the CLI."""
    bounds = {k: kw.pop(k) for k in ("ge", "gt", "le", "lt") if k in kw}
    meta = {"help": help, **kw, "range": Range(**bounds)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class FieldSpec:
    """What the checks and the CLI need of one field of a settings dataclass, its annotation
    resolved (the modules use `from __future__ import annotations`: annotations are strings)."""
    field: dataclasses.Field
    kind: type                          # bool, int, float or str
    optional: bool                      # None allowed
    literal: tuple[str, ...] | None     # the values of a Literal

    @property
    def range(self) -> Range:
        return self.field.metadata.get("range", Range())

    @property
    def choices(self) -> tuple[str, ...] | None:
        """A Literal's values, or the names in the registry the field's `choices` metadata
        holds (read when asked: an entry registered later is a choice too)."""
        registry = self.field.metadata.get("choices")
        return tuple(registry) if registry is not None else self.literal


@functools.cache
def field_specs(cls: type) -> dict[str, FieldSpec]:
    hints = typing.get_type_hints(cls)
    specs = {}
    for f in dataclasses.fields(cls):
        hint, args = hints[f.name], typing.get_args(hints[f.name])
        optional = typing.get_origin(hint) in (Union, types.UnionType) and type(None) in args
        if optional:
            (hint,) = [a for a in args if a is not type(None)]
        literal = typing.get_origin(hint) is Literal
        specs[f.name] = FieldSpec(f, str if literal else hint, optional,
                                  typing.get_args(hint) if literal else None)
    return specs


def check_fields(obj: Any) -> None:
    """Refuse a field value outside its type, its Literal's choices or its range, with one line
    naming the field. Floats must be finite: NaN and inf pass no comparison a run relies on."""
    for name in field_specs(type(obj)):
        check_value(type(obj), name, getattr(obj, name))


def check_value(cls: type, name: str, v: Any) -> None:
    """`check_fields` for one value of field `name` of `cls`."""
    sp = field_specs(cls)[name]
    if v is None:
        if not sp.optional:
            raise ParityError(f"{name} cannot be empty")
    elif sp.choices is not None:
        if v not in sp.choices:
            raise ParityError(f"{name}={quoted(v)} is not one of: {', '.join(sp.choices)}")
    elif sp.kind in (int, float):
        want = numbers.Integral if sp.kind is int else numbers.Real
        if isinstance(v, bool) or not isinstance(v, want):
            raise ParityError(f"{name}={quoted(v)} is not a valid {sp.kind.__name__}")
        must = sp.range.complaint(v, sp.kind is float)
        if must is not None:
            null = " (or null)" if sp.optional else ""
            raise ParityError(f"{name}={quoted(v)} must be {must}{null}")
    elif (pattern := sp.field.metadata.get("pattern")) and not re.fullmatch(pattern, str(v)):
        raise ParityError(f"{name}={quoted(v)} must be {sp.field.metadata['pattern_text']}")


def coerce(name: str, value: Any, cls: type) -> Any:
    """Convert a YAML or flag value to the type of field `name` of `cls` (a settings dataclass), or
    raise ParityError naming the field. Choices and ranges are `check_fields`'s."""
    specs = field_specs(cls)
    if name not in specs:
        raise ParityError(f"unknown config field {quoted(name)}")
    sp = specs[name]
    if not isinstance(value, (str, numbers.Real, datetime.date, type(None))):
        # Every field holds one value; str() of a YAML list or mapping would pass it as text.
        what = {list: "list", dict: "mapping", set: "set", bytes: "binary value"}.get(
            type(value), type(value).__name__)
        raise ParityError(f"{name} must be one {sp.kind.__name__} value, not a YAML {what}")
    if value is None or (sp.optional and isinstance(value, str)
                         and value.lower() in ("none", "null")):
        if sp.optional:
            return None
        raise ParityError(f"{name} cannot be empty")
    try:
        if sp.kind is bool:
            if isinstance(value, bool):
                return value
            s = str(value).lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if sp.kind is int:
            if isinstance(value, bool) or float(value) != int(float(value)):
                raise ValueError(value)
            return int(float(value))
        if sp.kind is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError, OverflowError):  # int(float("inf")) overflows
        raise ParityError(f"{name}={quoted(value)} is not a valid {sp.kind.__name__}") from None


def own(default: Any, help: str, **checks: Any) -> Any:
    """A field of such settings that Config does not have, checked as Config's are (`_f`)."""
    return _f(default, help, **checks)



# A message quotes at most this many characters of a value: a value can be megabytes long, and
# the refusal must stay one line a reader can read (docs/errors.md).
QUOTE_LIMIT = 80
_SHORT_REPR = reprlib.Repr()
for _k in ("maxtuple", "maxlist", "maxarray", "maxdict", "maxset", "maxfrozenset", "maxdeque"):
    setattr(_SHORT_REPR, _k, 4)
_SHORT_REPR.maxlevel = 2
_SHORT_REPR.maxstring = _SHORT_REPR.maxlong = _SHORT_REPR.maxother = QUOTE_LIMIT


def quoted(v: Any) -> str:
    """`repr(v)` for a message, cut to QUOTE_LIMIT characters with `...`. A long string is cut
    before it is repr'd, and a container's repr stops at its first few items and levels, so
    quoting costs little whatever the value holds."""
    text = repr(v[:QUOTE_LIMIT + 1]) if isinstance(v, str) else _SHORT_REPR.repr(v)
    return text if len(text) <= QUOTE_LIMIT else text[:QUOTE_LIMIT - 3] + "..."


