"""Numbers in a config mean what they say: no boolean taken for a number, no infinity or NaN.

YAML reads ``true`` as a boolean and pydantic takes it for the integer 1 (``--set
federation.num_clients=true`` would run one client), and ``.inf`` / ``nan`` pass a ``gt=0``
bound (``training.lr=inf`` would train until every update is refused). :class:`StrictNumbers`
refuses both for every number field of every model built on it (the config's sections, each
algorithm's options), keys added later included, with a message that names the allowed range.
No import of the rest of the package.
"""

from __future__ import annotations

import math
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _accepts(annotation: Any, kind: type) -> bool:
    """Whether ``annotation`` (with its unions, Optional, Annotated and Literal) admits a ``kind``."""
    if annotation is kind or annotation is Any:
        return True
    origin = get_origin(annotation)
    if origin is None:
        return False
    args = get_args(annotation)
    if origin in (Union, types.UnionType):
        return any(_accepts(a, kind) for a in args)
    if origin is Annotated:
        return _accepts(args[0], kind)
    if origin is Literal:
        return any(isinstance(a, kind) for a in args)
    return False


def _element(annotation: Any, value: Any) -> Any:
    """The annotation of ``value``'s items (lists, tuples, sets) or values (dicts), None when it has none."""
    for a in (annotation, *get_args(annotation)):  # Optional[list[int]]: look through the union
        origin = get_origin(a)
        if origin in (list, tuple, set, frozenset) and isinstance(value, (list, tuple, set, frozenset)):
            args = [x for x in get_args(a) if x is not Ellipsis]
            return args[0] if args else None
        if origin is dict and isinstance(value, dict):
            args = get_args(a)
            return args[1] if len(args) == 2 else None
    return None


def bound_text(metadata: list) -> str:
    """``metadata``'s bounds as text (" > 0 and < 1"), '' when unbounded."""
    parts = [f"{sign} {getattr(m, name)}" for m in metadata for name, sign in _BOUNDS if getattr(m, name, None) is not None]
    return (" " + " and ".join(parts)) if parts else ""


def number_problem(annotation: Any, value: Any, bounds: str = "") -> str | None:
    """What is wrong with ``value`` for a field of type ``annotation`` (a boolean where a number
    is expected, a non-finite float), or None; looks into lists and dicts."""
    if isinstance(value, bool):
        if not _accepts(annotation, bool) and (_accepts(annotation, int) or _accepts(annotation, float)):
            return f"a number{bounds}, not a boolean"
        return None
    if isinstance(value, str):  # "inf", "nan": pydantic would read them as floats
        try:
            value = float(value)
        except ValueError:
            return None
        if math.isfinite(value):
            return None
    if isinstance(value, float) and not math.isfinite(value):
        if _accepts(annotation, float) or _accepts(annotation, int):
            return f"a finite number{bounds}"
        return None
    element = _element(annotation, value)
    if element is not None:
        for item in (value.values() if isinstance(value, dict) else value):
            problem = number_problem(element, item)
            if problem is not None:
                return f"each entry {problem}"
    return None


STRICT_NUMBER = "strict_number"  # the error type; its context names the field and the problem


class StrictNumbers(BaseModel):
    """Base model whose number fields refuse booleans and non-finite values (see the module doc).
    Checked on the raw input, one error per field, of type :data:`STRICT_NUMBER` with the field's
    name and the problem in its context (a model-level check: a field-level one would also wrap a
    discriminated union's ``kind``, which pydantic forbids)."""

    model_config = ConfigDict(allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _strict_numbers(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, field in cls.model_fields.items():
            key = field.alias or name
            if key not in data:
                continue
            problem = number_problem(field.annotation, data[key], bound_text(field.metadata))
            if problem is not None:
                raise PydanticCustomError(STRICT_NUMBER, "{field}: {problem}",
                                          {"field": key, "problem": problem, "value": repr(data[key])})
        return data
