"""A sweep file: a base experiment config plus a search space over dotted config keys.

```yaml
name: fedsa_lambda_cpu
base: fedsa_digits                 # a preset name, a run-config path (relative to this file), or a mapping
set: {federation.rounds: 20}       # optional overrides of the base, dotted KEY: VALUE
search_space:
  algorithm.lam: {loguniform: [0.01, 10]}
num_samples: 6
metric: eval/head_acc               # an MLflow metric name (old flat names are read for one release)
mode: max
scheduler: {name: asha, grace_period: 5, reduction_factor: 2}
searcher: null                     # or {name: optuna}
max_concurrent_trials: 2
trial_resources: {driver_cpus: 0.25, server_cpus: 0.25, client_cpus: 0.25, client_actors: 2, gpus_per_trial: auto}
```

Validation happens before Ray starts and reports every problem as a :class:`ConfigIssue`
(key, value, what is allowed), raised together as one :class:`ConfigError`, like run configs.
Every trial's config shape is checked by building the config at the corners of the space
(each choice, each bound).
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rayfed_proto.config import (
    ConfigError,
    ConfigIssue,
    ExperimentConfig,
    _issues_from_validation,
    build_config,
    parse_override,
    read_yaml_file,
    set_dotted,
)
from rayfed_proto.preset_files import default_config_path, preset_names, presets_dir

DISTRIBUTIONS = ("choice", "grid", "uniform", "loguniform", "randint", "quniform")
# Tune's metric: the MLflow name; the pre-namespacing names (head_acc...) are read as these for one release
METRICS = ("eval/head_acc", "eval/head_acc_mean", "eval/proto_acc", "eval/proto_acc_mean", "eval/global_acc")
# keys the sweep owns in every trial: sweeping them would break placement or tracking
RESERVED_PREFIXES = ("resources.", "tracking.")
# how many corner configs are built one by one before falling back to one key at a time
MAX_CORNER_CONFIGS = 256


# --------------------------------------------------------------------------- distributions


@dataclass(frozen=True)
class Distribution:
    """One swept key's distribution; ``args`` as written (bounds checked)."""

    kind: str
    args: tuple

    def to_tune(self):
        from ray import tune

        k, a = self.kind, self.args
        if k == "choice":
            return tune.choice(list(a))
        if k == "grid":
            return tune.grid_search(list(a))
        if k == "uniform":
            return tune.uniform(a[0], a[1])
        if k == "loguniform":
            return tune.loguniform(a[0], a[1])
        if k == "randint":
            return tune.randint(a[0], a[1])  # high exclusive, as Tune
        if all(float(x).is_integer() for x in a):  # integer steps: ints, so int-typed keys accept them
            return tune.qrandint(int(a[0]), int(a[1]), int(a[2]))
        return tune.quniform(a[0], a[1], a[2])

    def corners(self) -> list[Any]:
        """Values every sampled value lies between (or among): what validation builds."""
        k, a = self.kind, self.args
        if k in ("choice", "grid"):
            return list(a)
        if k == "randint":
            return [a[0], a[1] - 1]
        return [a[0], a[1]]

    @property
    def is_log(self) -> bool:
        return self.kind == "loguniform"

    def describe(self) -> str:
        return f"{self.kind}{list(self.args)}"


def _number(v: Any) -> Optional[float]:
    """A YAML number, or a string YAML left unparsed (``1e-3`` has no dot: YAML reads a string)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def parse_distribution(key: str, spec: Any) -> tuple[Optional[Distribution], list[ConfigIssue]]:
    """``{loguniform: [0.01, 10]}`` -> Distribution; problems as issues keyed ``search_space.<key>``."""
    where = f"search_space.{key}"
    allowed_shape = ("a mapping with one of " + ", ".join(DISTRIBUTIONS)
                     + ", e.g. {loguniform: [0.01, 10]}, {choice: [a, b]}, {quniform: [0, 1, 0.1]}")
    if not isinstance(spec, dict) or len(spec) != 1:
        return None, [ConfigIssue(key=where, value=spec, allowed=allowed_shape)]
    kind, args = next(iter(spec.items()))
    if kind not in DISTRIBUTIONS:
        return None, [ConfigIssue(key=where, value=spec, allowed=f"distribution one of {', '.join(DISTRIBUTIONS)}")]
    if kind in ("choice", "grid"):
        if not isinstance(args, list) or not args:
            return None, [ConfigIssue(key=where, value=spec, allowed=f"{kind}: a non-empty list of values")]
        return Distribution(kind, tuple(args)), []
    arity = 3 if kind == "quniform" else 2
    names = "[low, high, q]" if kind == "quniform" else "[low, high]"
    if not isinstance(args, list) or len(args) != arity:
        return None, [ConfigIssue(key=where, value=spec, allowed=f"{kind}: a list {names}")]
    nums = [_number(v) for v in args]
    if any(n is None for n in nums):
        return None, [ConfigIssue(key=where, value=spec, allowed=f"{kind}: {names} must be numbers")]
    low, high = nums[0], nums[1]
    if kind == "randint":
        if not all(float(n).is_integer() for n in nums):
            return None, [ConfigIssue(key=where, value=spec, allowed="randint: integer bounds [low, high)")]
        if not low < high:
            return None, [ConfigIssue(key=where, value=spec, allowed="randint: low < high (high is exclusive)")]
        return Distribution(kind, (int(low), int(high))), []
    if not (math.isfinite(low) and math.isfinite(high)) or not low < high:
        return None, [ConfigIssue(key=where, value=spec, allowed=f"{kind}: finite bounds with low < high")]
    if kind == "loguniform" and low <= 0:
        return None, [ConfigIssue(key=where, value=spec, allowed="loguniform: 0 < low < high")]
    if kind == "quniform":
        q = nums[2]
        if not q > 0:
            return None, [ConfigIssue(key=where, value=spec, allowed="quniform: step q > 0")]
        if q > high - low:
            return None, [ConfigIssue(key=where, value=spec, allowed=f"quniform: step q at most high - low ({high - low:g})")]
        return Distribution(kind, (low, high, q)), []
    return Distribution(kind, (low, high)), []


# --------------------------------------------------------------------------- the file's sections


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SchedulerSpec(_Section):
    name: Literal["fifo", "asha"] = "fifo"
    grace_period: int = Field(1, ge=1, description="asha: server versions every trial runs before it can be stopped")
    reduction_factor: float = Field(2.0, gt=1, description="asha: keep 1/reduction_factor of the trials at each rung")
    max_t: Optional[int] = Field(None, ge=1, description="asha: versions of a full trial (default federation.rounds)")
    brackets: int = Field(1, ge=1)


class SearcherSpec(_Section):
    name: Literal["optuna"] = "optuna"
    seed: Optional[int] = None


class TrialResources(_Section):
    """What one trial reserves (one placement-group bundle each): its driver, the server and
    ``client_actors`` client actors. GPUs: ``gpus_per_trial`` split over the server and client
    actors; ``auto`` = none without GPUs, else the cluster's GPUs / max_concurrent_trials (at most 1)."""

    driver_cpus: float = Field(0.25, ge=0, description="the trial's driver (scheduler loop, MLflow logging)")
    server_cpus: float = Field(0.25, gt=0)
    client_cpus: float = Field(0.25, gt=0, description="per client actor")
    client_actors: Union[Literal["all"], int] = Field(
        2, description="client actors per trial; clients_per_actor = ceil(num_clients / client_actors)")
    gpus_per_trial: Union[Literal["auto"], float] = "auto"
    torch_threads: int = Field(1, ge=1)

    @field_validator("client_actors")
    @classmethod
    def _actors(cls, v):
        if v != "all" and v < 1:
            raise ValueError("must be 'all' or an integer >= 1")
        return v

    @field_validator("gpus_per_trial")
    @classmethod
    def _gpus(cls, v):
        if v != "auto" and (v < 0 or (v > 1 and not float(v).is_integer())):
            raise ValueError("must be 'auto', a fraction in [0, 1] or a whole number of GPUs")
        return v


class SweepFile(_Section):
    name: Optional[str] = Field(None, description="Tune experiment and MLflow parent run name (default: the file's stem)")
    base: Union[str, dict[str, Any], None] = Field(None, description="preset name, run-config path or mapping; None: the default preset")
    set: dict[str, Any] = Field(default_factory=dict, description="dotted overrides of the base")
    search_space: dict[str, Any]
    num_samples: int = Field(1, ge=1)
    metric: str = "eval/head_acc"
    mode: Literal["max", "min"] = "max"
    scheduler: SchedulerSpec = SchedulerSpec()
    searcher: Optional[SearcherSpec] = None
    max_concurrent_trials: int = Field(2, ge=1)
    trial_resources: TrialResources = TrialResources()
    storage_path: str = Field("tune_results", description="Tune's experiment folder parent: a path or s3://...")
    tracking_uri: Optional[str] = Field(None, description="an http(s) MLflow server; None: start one over the base's store")
    max_failures: int = Field(1, ge=0, description="a failed trial (a lost node) is retried this many times, from its "
                              "latest Tune checkpoint in storage_path")
    checkpoints_to_keep: int = Field(2, ge=1, description="Tune checkpoints kept per trial")

    @field_validator("metric")
    @classmethod
    def _metric(cls, v):
        from rayfed_proto.tracking.metric_names import resolve

        if isinstance(v, str) and "/" not in v and resolve(v, warn=False) in METRICS:
            v = resolve(v)  # an old name: accepted for one release, with a DeprecationWarning
        if v not in METRICS:
            raise ValueError(f"one of {', '.join(METRICS)}")
        return v


# --------------------------------------------------------------------------- the validated sweep


@dataclass
class SweepSpec:
    name: str
    source: str
    base_raw: dict[str, Any]          # the base run config, as written plus `set` (not resolved)
    base_config: ExperimentConfig     # the base built as-is (the sweep's tracking store and output folder)
    space: dict[str, Distribution]
    file: SweepFile

    @property
    def num_trials(self) -> int:
        grid = math.prod(len(d.args) for d in self.space.values() if d.kind == "grid")
        return self.file.num_samples * grid

    def param_space(self) -> dict[str, Any]:
        """Tune's param_space: flat dotted keys (Tune would otherwise treat the dots as nesting)."""
        return {k: d.to_tune() for k, d in self.space.items()}

    def trial_raw(self, values: dict[str, Any]) -> dict[str, Any]:
        raw = copy.deepcopy(self.base_raw)
        for k, v in values.items():
            set_dotted(raw, k, v)
        return raw



def _resolve_base(base: Any, source_dir: Path, issues: list[ConfigIssue]) -> dict[str, Any]:
    if isinstance(base, dict):
        return copy.deepcopy(base)
    if base is None:
        path = default_config_path()
    else:
        path = Path(base).expanduser()
        if not path.is_absolute():
            path = source_dir / path
        if not path.exists() and Path(base).suffix == "" and base in preset_names():
            path = presets_dir() / f"{base}.yaml"
    if not path.is_file():
        issues.append(ConfigIssue(key="base", value=base, allowed="a preset name (" + ", ".join(preset_names())
                                  + "), an existing run-config YAML (relative to the sweep file), or a mapping"))
        return {}
    try:
        raw = read_yaml_file(path, key="base") or {}
    except ConfigError as e:
        issues.extend(e.issues)
        return {}
    if not isinstance(raw, dict):
        issues.append(ConfigIssue(key="base", value=str(path), allowed="a YAML mapping (a run config)"))
        return {}
    return raw


def _models_in(ann: Any) -> tuple[list[type[BaseModel]], Any]:
    """The pydantic models a field annotation can hold, looking through ``Optional[...]``,
    ``Union[...]`` and ``Annotated[...]`` (so every branch of a discriminated union), plus the
    value annotation of a ``dict[str, V]`` among them (its keys are free: any next part is one);
    ``([], None)`` for a leaf."""
    origin = get_origin(ann)
    if origin is Annotated:
        return _models_in(get_args(ann)[0])
    if origin in (Union, UnionType):
        models: list[type[BaseModel]] = []
        value_ann: Any = None
        for arm in get_args(ann):
            arm_models, arm_value = _models_in(arm)
            models.extend(m for m in arm_models if m not in models)
            value_ann = value_ann if arm_value is None else arm_value
        return models, value_ann
    if origin is dict:
        args = get_args(ann)
        return [], (args[1] if len(args) == 2 else Any)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann], None
    return [], None


def _schema_has_key(dotted: str) -> bool:
    """Whether ``dotted`` names a field of ExperimentConfig outside ``algorithm`` (whose options
    depend on the method and are checked by building the config). Optional sections and every
    branch of a union count (``system.speed.sigma`` is a field of the ``lognormal`` speed; whether
    the base's ``kind`` has it is checked by building the trial configs), as do the keys of a
    mapping field (``system.cost_per_sample.<arch>``, whose names the build checks too)."""
    models: list[Any] = [ExperimentConfig]
    value_ann: Any = None  # the values' annotation when the current level is a dict[str, V]
    for part in dotted.split("."):
        next_models: list[Any] = []
        next_value: Any = None
        found = False
        for model in models:
            fields = getattr(model, "model_fields", None) or {}
            if part in fields:
                found = True
                arm_models, arm_value = _models_in(fields[part].annotation)
                next_models.extend(m for m in arm_models if m not in next_models)
                next_value = next_value if arm_value is None else arm_value
        if value_ann is not None:  # any key of a mapping
            found = True
            arm_models, arm_value = _models_in(value_ann)
            next_models.extend(m for m in arm_models if m not in next_models)
            next_value = next_value if arm_value is None else arm_value
        if not found:
            return False
        models, value_ann = next_models, next_value
    return True


def corner_values(space: dict[str, Distribution]) -> list[dict[str, Any]]:
    """The swept values at the corners of ``space`` (each choice, each bound: every sampled value
    lies between or among them), one mapping per trial to build; every combination while there
    are at most ``MAX_CORNER_CONFIGS``, else each key's corners with the others at their first.
    Never empty: an empty space has one corner, ``{}``. The first stands for every trial where
    one trial's shape is needed (the placement groups a sweep asks the autoscaler for)."""
    keys = list(space)
    corners = [space[k].corners() for k in keys]
    if math.prod(len(c) for c in corners) <= MAX_CORNER_CONFIGS:
        return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*corners)]
    # too many combinations: every value of each key, the others at their first value
    first = {k: c[0] for k, c in zip(keys, corners, strict=True)}
    return [{**first, k: v} for k, c in zip(keys, corners, strict=True) for v in c]


def parse_sweep(raw: Any, source: str = "<sweep>", source_dir: Path | None = None,
                overrides: list[str] | None = None) -> SweepSpec:
    """Validate a sweep mapping; ``overrides`` (``KEY=VALUE``) apply to the base like ``set``."""
    source_dir = source_dir or Path.cwd()
    if not isinstance(raw, dict):
        raise ConfigError([ConfigIssue(key="<root>", value=type(raw).__name__, allowed="a mapping (a sweep file)")], source)
    issues: list[ConfigIssue] = []
    sweep: Optional[SweepFile] = None
    try:
        sweep = SweepFile(**raw)
    except ValidationError as err:  # reported together with the search space's problems below
        issues.extend(_issues_from_validation(err, raw))

    space_raw = raw.get("search_space") if isinstance(raw.get("search_space"), dict) else {}
    space: dict[str, Distribution] = {}
    if not space_raw and sweep is not None:
        issues.append(ConfigIssue(key="search_space", value={}, allowed="at least one swept key"))
    for key, spec in space_raw.items():
        if key.startswith(RESERVED_PREFIXES):
            issues.append(ConfigIssue(key=f"search_space.{key}", value=spec, allowed=(
                "not sweepable: each trial's resources.* are set from trial_resources and tracking.* by the sweep")))
            continue
        if not key.startswith("algorithm.") and not _schema_has_key(key):
            issues.append(ConfigIssue(key=f"search_space.{key}", value=spec, allowed=(
                "a config key (dotted, as in a run config: algorithm.lam, training.lr, data.partition.beta, ...)")))
            continue
        dist, problems = parse_distribution(key, spec)
        issues.extend(problems)
        if dist is not None:
            space[key] = dist
    if sweep is None:
        raise ConfigError(issues, source)
    base_raw = _resolve_base(sweep.base, source_dir, issues)
    for key, value in sweep.set.items():
        set_dotted(base_raw, key, value)
    for item in overrides or []:
        key, value = parse_override(item)
        set_dotted(base_raw, key, value)
    if sweep.searcher is not None and any(d.kind == "grid" for d in space.values()):
        issues.append(ConfigIssue(key="searcher", value=sweep.searcher.name, allowed=(
            "null with grid: distributions (optuna samples; use choice instead of grid)")))
    if sweep.searcher is not None:
        try:
            import optuna  # noqa: F401
        except ImportError:
            issues.append(ConfigIssue(key="searcher.name", value="optuna", allowed="needs the optuna package: pip install optuna"))
    if issues:
        raise ConfigError(issues, source)

    try:
        base_config = build_config(base_raw, source=f"{source} (base)")
    except ConfigError as e:
        raise ConfigError([ConfigIssue(key=f"base.{i.key}", value=i.value, allowed=i.allowed) for i in e.issues],
                          source) from None
    name = sweep.name or Path(source).stem
    spec = SweepSpec(name=name, source=source, base_raw=base_raw, base_config=base_config, space=space, file=sweep)
    _check_trials(spec)
    return spec


def _check_trials(spec: SweepSpec) -> None:
    """Build every corner trial config (with the trial resources applied): a sampled value
    that makes an invalid config fails here, before Ray starts."""
    from rayfed_proto.tuning.resources import trial_overrides

    seen: dict[str, ConfigIssue] = {}
    for values in corner_values(spec.space):
        raw = spec.trial_raw(values)
        try:
            cfg = build_config(raw)
            trial_overrides(cfg, spec.file.trial_resources, gpus_per_trial=0.0, check=True)
        except ConfigError as e:
            where = ", ".join(f"{k}={v!r}" for k, v in values.items())
            for issue in e.issues:
                key = issue.key
                seen.setdefault(f"{key}:{issue.value!r}", ConfigIssue(
                    key=key, value=issue.value, allowed=f"{issue.allowed} (in the trial with {where})"))
    if seen:
        raise ConfigError(list(seen.values()), spec.source)


def load_sweep(path: str | Path, overrides: list[str] | None = None, sweep_overrides: dict[str, Any] | None = None) -> SweepSpec:
    """Load and validate a sweep file; ``overrides`` (``KEY=VALUE``) change the base config,
    ``sweep_overrides`` top-level sweep entries (``num_samples``, ``max_concurrent_trials``)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([ConfigIssue(key="<file>", value=str(p), allowed="an existing sweep YAML file")])
    raw = read_yaml_file(p)
    if isinstance(raw, dict):
        raw.update({k: v for k, v in (sweep_overrides or {}).items() if v is not None})
    return parse_sweep(raw, str(p), p.resolve().parent, overrides)
