"""Every number key of the config and of every algorithm's options refuses a boolean and a
non-finite value, naming the key and the allowed range; the seed's range is enforced (issue 40.4).
The keys are found by walking the pydantic models, so keys added later are covered too."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from rayfed_proto.algorithms import ALGORITHMS
from rayfed_proto.config import SEED_MAX, ConfigError, ExperimentConfig, build_config
from rayfed_proto.numbers import _accepts


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation holds (a section, Optional[section], a union of profile kinds)."""
    if get_origin(annotation) is Annotated:
        return _models(get_args(annotation)[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) is Union:
        return [m for a in get_args(annotation) for m in _models(a)]
    return []


def _number_keys(model: type[BaseModel], prefix: str = "", context: Optional[dict] = None):
    """(dotted key, the other entries a section of a union needs (its kind), accepts floats)
    for every number field below ``model``."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        inner = _models(field.annotation)
        if inner:
            for m in inner:
                kind = m.model_fields.get("kind")
                extra = {f"{key}.kind": get_args(kind.annotation)[0]} if kind is not None and get_origin(kind.annotation) is Literal else {}
                yield from _number_keys(m, key + ".", {**(context or {}), **extra})
            continue
        if _accepts(field.annotation, bool):
            continue
        if _accepts(field.annotation, int) or _accepts(field.annotation, float):
            yield key, dict(context or {}), _accepts(field.annotation, float)


CONFIG_KEYS = [k for k in _number_keys(ExperimentConfig) if not k[0].startswith("algorithm.")]
ALGO_KEYS = [(a, f"algorithm.{k}", c, f) for a in ALGORITHMS.names() for k, c, f in _number_keys(ALGORITHMS.get(a).Options)]


def test_the_walk_finds_the_number_keys():
    keys = {k for k, _, _ in CONFIG_KEYS}
    assert {"seed", "training.lr", "federation.num_clients", "system.speed.sigma", "system.reference_flops"} <= keys
    assert len(keys) > 30 and len(ALGO_KEYS) > 10


def _issues(overrides: dict[str, Any], algorithm: Optional[str] = None) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    for dotted, value in {**({"algorithm.name": algorithm} if algorithm else {}), **overrides}.items():
        cur = raw
        *parents, last = dotted.split(".")
        for p in parents:
            cur = cur.setdefault(p, {})
        cur[last] = value
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    return {i.key: i for i in err.value.issues}


@pytest.mark.parametrize("key,context,_", CONFIG_KEYS, ids=[k for k, _, _ in CONFIG_KEYS])
def test_a_boolean_is_not_a_number(key, context, _):
    issues = _issues({**context, key: True})
    assert key in issues, issues
    assert "not a boolean" in issues[key].allowed and issues[key].value is True


@pytest.mark.parametrize("key,context", [(k, c) for k, c, f in CONFIG_KEYS if f], ids=[k for k, _, f in CONFIG_KEYS if f])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), "inf"])
def test_a_float_key_refuses_non_finite_values(key, context, value):
    issues = _issues({**context, key: value})
    assert key in issues, issues
    assert issues[key].allowed.startswith("a finite number")


@pytest.mark.parametrize("algorithm,key,context,is_float", ALGO_KEYS, ids=[f"{a}:{k}" for a, k, _, _ in ALGO_KEYS])
def test_algorithm_options_refuse_booleans_and_non_finite_values(algorithm, key, context, is_float):
    issues = _issues({**context, key: True}, algorithm)
    assert key in issues and "not a boolean" in issues[key].allowed, issues
    if is_float:
        issues = _issues({**context, key: float("inf")}, algorithm)
        assert key in issues and issues[key].allowed.startswith("a finite number"), issues


def test_the_message_names_the_range():
    assert _issues({"training.lr": float("inf")})["training.lr"].allowed == "a finite number > 0"
    assert _issues({"federation.num_clients": True})["federation.num_clients"].allowed == "a number >= 1, not a boolean"


@pytest.mark.parametrize("seed", [-1, SEED_MAX + 1, 2**65])
def test_the_seed_range(seed):
    issue = _issues({"seed": seed})["seed"]
    assert issue.value == seed and str(SEED_MAX) in issue.allowed


def test_the_seed_range_bounds_are_accepted():
    assert build_config({"seed": SEED_MAX}).seed == SEED_MAX
    assert build_config({"seed": 0}).seed == 0


def test_a_list_of_numbers_refuses_booleans():
    issues = _issues({"faults.corrupt_clients": [1, True]})
    assert "not a boolean" in issues["faults.corrupt_clients"].allowed
