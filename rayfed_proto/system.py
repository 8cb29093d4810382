"""Client system profiles: each simulated client's compute speed, bandwidth and availability.

The virtual clock (``rayfed_proto.runtime.scheduler``) asks this module how long a client's
local update takes in *simulated* seconds and which clients are online at a simulated time.
Nothing here measures wall time, so the same config and seed give the same durations on any
machine (see docs/simulation.md):

* **work**: the passes one local update of the run's method declares
  (``ClientAlgorithm.update_work``: samples forward-backward, each at the architecture's cost per
  training sample, and forward only, at a third of it), by default the client's training samples x
  ``training.local_epochs``, forward-backward; passes a method adds from a later server version
  (``from_version``) are charged to updates against that version on. The cost is ``system.cost_per_sample[arch]`` when given (a table, e.g. measured
  on real devices), otherwise computed from the model: 2 x 3 x MACs of one forward pass of one
  sample (multiply-add = 2 FLOPs, forward + backward ~ 3 forward passes) divided by
  ``system.reference_flops`` (a speed-1.0 client sustains that many FLOP/s, 1 GFLOP/s by default);
* **speed**: constant, lognormal (``exp(N(0, sigma^2))``, median 1, drawn once per client from the
  run seed) or read from a CSV ``client_id,speed``; compute time = work / speed;
* **transfers**: message bytes / ``system.download_bytes_per_s`` and ``upload_bytes_per_s``
  (``None``: instantaneous), the same for every client;
* **availability**: always, online with probability ``p`` at each dispatch decision (drawn from the
  scheduler's generator), or online windows ``[start_s, end_s)`` read from a CSV.

No Ray import here: the module is plain Python + NumPy (+ torch once, to count MACs).
"""

from __future__ import annotations

import csv
import functools
import math
import pickle
from bisect import bisect_right
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from rayfed_proto.config import ConfigError, ConfigIssue, register_check

if TYPE_CHECKING:
    from rayfed_proto.config import ExperimentConfig

SPEED_STREAM = 0x5EED5  # default_rng([seed, SPEED_STREAM]): the lognormal speeds' own stream
FLOPS_PER_MAC = 2  # one multiply-accumulate = one multiply + one add
TRAIN_PASSES = 3  # forward + backward ~ 3 forward passes (backward ~ 2x forward)
MAX_REPORTED_ROWS = 10  # a bad CSV: at most this many rows are reported (plus a count of the rest)

SPEED_KEY = "system.speed.path"
AVAILABILITY_KEY = "system.availability.path"
BANDWIDTH_KEY = "system.bandwidth.path"
BANDWIDTH_STREAM = 0xBA4D  # default_rng([seed, BANDWIDTH_STREAM]): the lognormal bandwidth factors
SERVER_STREAM = 0x5E4E  # default_rng([seed, SERVER_STREAM]): a lognormal server speed's one draw
TRACE_STREAM = 0x7ACE  # default_rng([seed, TRACE_STREAM, salt]): which trace client each run client is
DEVICE_SALT, BEHAVIOUR_SALT = 1, 2  # the device-capacity and the behaviour trace map independently


# --------------------------------------------------------------------------- cost of an architecture


def count_macs(model, input_shape: tuple[int, ...]) -> int:
    """Multiply-accumulates of one forward pass of ``model`` on a zeros input of ``input_shape``.

    Counted with forward hooks on ``nn.Conv2d`` (output elements x in_channels / groups x kernel
    area) and ``nn.Linear`` (output elements x in_features). Everything else (BatchNorm,
    activations, pooling, bias additions, the softmax) is element-wise, a small fraction of
    the convolutions' and matrix products' cost, and is not counted.
    """
    import torch
    from torch import nn

    total = 0

    def conv_hook(mod: nn.Conv2d, _inp, out) -> None:
        nonlocal total
        kh, kw = mod.kernel_size
        total += out.numel() * (mod.in_channels // mod.groups) * kh * kw

    def linear_hook(mod: nn.Linear, _inp, out) -> None:
        nonlocal total
        total += out.numel() * mod.in_features

    handles = []
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            handles.append(m.register_forward_hook(conv_hook))
        elif isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(linear_hook))
    was_training = model.training
    try:
        model.eval()
        device = next((t.device for t in model.parameters()), None)
        with torch.no_grad():
            model(torch.zeros(input_shape, device=device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return int(total)


@functools.cache
def architecture_macs(arch: str, in_channels: int, image_size: int, num_classes: int, feature_dim: int,
                      projector: str = "linear", stem: str = "imagenet") -> int:
    """MACs of one forward pass of one ``in_channels`` x ``image_size`` x ``image_size`` sample
    through the zoo's ``arch`` (extractor, projection, head). Depends only on shapes, not on
    weights or the machine (``stem``: ``model.stem``, the ResNets' first layers). The model is built on torch's ``meta`` device (shapes only: nothing
    initialised) and counted on an uninitialised CPU copy (``to_empty``), one image through it;
    a forward on ``meta`` itself would import torch's Python meta kernels, about 2 s of a run's
    start-up. An architecture that cannot be built on ``meta`` is built on the CPU. Either way
    inside ``torch.random.fork_rng``, so the global torch RNG is left as it was."""
    import torch

    from rayfed_proto.models.zoo import _on_cpu_if_meta, build_model

    shape = (1, in_channels, image_size, image_size)
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                model = build_model(arch, in_channels, image_size, num_classes, feature_dim, projector=projector, stem=stem)
            # counted on an uninitialised CPU copy: a forward on meta imports torch's meta kernels (~2 s)
            return count_macs(_on_cpu_if_meta(model), shape)
        except (RuntimeError, ValueError):  # an op meta cannot run (the zoo reports dry-run failures as
            pass  # ValueError): the CPU build below computes the same count, or raises the real error
        return count_macs(build_model(arch, in_channels, image_size, num_classes, feature_dim, projector=projector, stem=stem),
                          shape)


def seconds_per_sample(macs: int, reference_flops: float) -> float:
    """Seconds one training sample (forward + backward) takes at speed 1.0."""
    return FLOPS_PER_MAC * TRAIN_PASSES * macs / reference_flops


def update_work_s(passes, cost_s: float, version: int = 0) -> float:
    """Seconds at speed 1.0 of one local update that declares ``passes`` (``algorithms.base.Pass``:
    ``samples``, ``backward``, ``from_version``), trained against server ``version``: each sample of a
    forward-backward pass costs ``cost_s`` (one training sample), each forward-only sample
    ``cost_s / TRAIN_PASSES`` (backward ~ 2x forward, so forward ~ a third of a training step)."""
    fwd_bwd = sum(int(p.samples) for p in passes if p.backward and p.from_version <= version)
    fwd = sum(int(p.samples) for p in passes if not p.backward and p.from_version <= version)
    return fwd_bwd * cost_s + fwd * (cost_s / TRAIN_PASSES)


def server_step_work_s(passes, arch_cost_s: dict[str, float], reference_flops: float) -> float:
    """Seconds at speed 1.0 of one server step that declares ``passes`` (``algorithms.base.ServerPass``):
    a pass with ``arch`` costs that architecture's seconds per training sample per forward-backward
    sample (a third of it forward only), as a client's work; one with ``macs`` 2 x macs FLOPs per
    forward sample (x ``TRAIN_PASSES`` with backward) at ``reference_flops``."""
    total = 0.0
    for p in passes:
        passes_per_sample = TRAIN_PASSES if p.backward else 1
        if p.arch is not None:
            total += int(p.samples) * arch_cost_s[p.arch] * passes_per_sample / TRAIN_PASSES
        else:
            total += int(p.samples) * FLOPS_PER_MAC * int(p.macs) * passes_per_sample / reference_flops
    return total


def server_speed(server, seed: int) -> Optional[float]:
    """``system.server``'s speed: None for ``free`` (no simulated time), the value for ``constant``,
    one lognormal draw from the run's seed (its own stream) for ``lognormal``."""
    if server.kind == "free":
        return None
    if server.kind == "lognormal":
        return float(np.exp(np.random.default_rng([seed, SERVER_STREAM]).normal(0.0, server.sigma)))
    return float(server.value)


# --------------------------------------------------------------------------- CSV profiles


def _issue(key: str, path, where: str) -> ConfigIssue:
    return ConfigIssue(key=key, value=str(path), allowed=where)


def _read_csv(path, key: str, columns: tuple[str, ...]) -> tuple[list[tuple[int, list[str]]], list[ConfigIssue]]:
    """(line number, fields) for each non-blank data row; line numbers count the header as line 1."""
    p = Path(path)
    if not p.is_file():
        return [], [_issue(key, path, "an existing CSV file")]
    try:
        text = p.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        return [], [_issue(key, path, f"a readable UTF-8 CSV file ({e})")]
    reader = csv.reader(text.splitlines())
    rows: list[tuple[int, list[str]]] = []
    header: Optional[list[str]] = None
    for fields in reader:
        if not fields or all(not f.strip() for f in fields):
            continue
        fields = [f.strip() for f in fields]
        if header is None:
            header = fields
            if header != list(columns):
                return [], [_issue(key, path, f"line {reader.line_num}: the header must be {','.join(columns)}, "
                                              f"got {','.join(header)}")]
            continue
        rows.append((reader.line_num, fields))
    if header is None:
        return [], [_issue(key, path, f"a CSV with header {','.join(columns)}; the file is empty")]
    return rows, []


def _client_id(text: str, num_clients: int) -> tuple[Optional[int], Optional[str]]:
    try:
        cid = int(text)
    except ValueError:
        return None, f"client_id {text!r} is not an integer"
    if not 0 <= cid < num_clients:
        return None, f"client_id {cid} is not a client of this run (0..{num_clients - 1})"
    return cid, None


def _number(text: str, column: str) -> tuple[Optional[float], Optional[str]]:
    try:
        v = float(text)
    except ValueError:
        return None, f"{column} {text!r} is not a number"
    if not math.isfinite(v):
        return None, f"{column} {text!r} is not a finite number"
    return v, None


def _raise(key: str, path, problems: list[str]) -> None:
    issues = [_issue(key, path, msg) for msg in problems[:MAX_REPORTED_ROWS]]
    if len(problems) > MAX_REPORTED_ROWS:
        issues.append(_issue(key, path, f"... and {len(problems) - MAX_REPORTED_ROWS} more bad rows"))
    raise ConfigError(issues)


def load_speed_csv(path, num_clients: int, key: str = SPEED_KEY) -> np.ndarray:
    """Per-client speeds from a CSV with header ``client_id,speed``: every client ``0..num_clients-1``
    exactly once, speed a finite number > 0.

    Raises :class:`ConfigError` whose issues name ``key``, the file (the issue's value) and the line
    (the header is line 1): unknown or non-integer id, duplicate id, bad speed, missing clients.
    """
    rows, issues = _read_csv(path, key, ("client_id", "speed"))
    if issues:
        raise ConfigError(issues)
    speeds = np.full(num_clients, np.nan)
    first_line: dict[int, int] = {}
    problems: list[str] = []
    for line, fields in rows:
        if len(fields) != 2:
            problems.append(f"line {line}: expected 2 fields (client_id,speed), got {len(fields)}: {','.join(fields)}")
            continue
        cid, err = _client_id(fields[0], num_clients)
        if err is None:
            speed, err = _number(fields[1], "speed")
            if err is None and speed <= 0:
                err = f"speed {fields[1]} of client {cid} must be > 0"
        if err is None and cid in first_line:
            err = f"client_id {cid} appears twice (first on line {first_line[cid]})"
        if err is not None:
            problems.append(f"line {line}: {err}")
            continue
        first_line[cid] = line
        speeds[cid] = speed
    missing = [c for c in range(num_clients) if c not in first_line]
    if missing and not problems:
        shown = ", ".join(map(str, missing[:MAX_REPORTED_ROWS])) + (f", ... ({len(missing)} in all)"
                                                                      if len(missing) > MAX_REPORTED_ROWS else "")
        problems.append(f"every client 0..{num_clients - 1} needs a row; missing: {shown}")
    if problems:
        _raise(key, path, problems)
    return speeds


def load_availability_csv(path, num_clients: int, key: str = AVAILABILITY_KEY) -> dict[int, list[tuple[float, float]]]:
    """Online windows from a CSV with header ``client_id,start_s,end_s``: client -> sorted windows
    ``[start_s, end_s)`` in simulated seconds (overlapping or touching windows merged). A client may
    have several rows; clients with none are always online. ``0 <= start_s < end_s``, finite.

    Raises :class:`ConfigError` naming ``key``, the file and the line (the header is line 1).
    """
    rows, issues = _read_csv(path, key, ("client_id", "start_s", "end_s"))
    if issues:
        raise ConfigError(issues)
    windows: dict[int, list[tuple[float, float]]] = {}
    problems: list[str] = []
    for line, fields in rows:
        if len(fields) != 3:
            problems.append(f"line {line}: expected 3 fields (client_id,start_s,end_s), got {len(fields)}: "
                            f"{','.join(fields)}")
            continue
        cid, err = _client_id(fields[0], num_clients)
        start = end = None
        if err is None:
            start, err = _number(fields[1], "start_s")
        if err is None:
            end, err = _number(fields[2], "end_s")
        if err is None and start < 0:
            err = f"start_s {fields[1]} must be >= 0"
        if err is None and end <= start:
            err = f"end_s {fields[2]} must be greater than start_s {fields[1]}"
        if err is not None:
            problems.append(f"line {line}: {err}")
            continue
        windows.setdefault(cid, []).append((start, end))
    if problems:
        _raise(key, path, problems)
    merged: dict[int, list[tuple[float, float]]] = {}
    for cid, ws in windows.items():
        out: list[tuple[float, float]] = []
        for s, e in sorted(ws):
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], e))
            else:
                out.append((s, e))
        merged[cid] = out
    return merged


# --------------------------------------------------------------------------- FedScale traces


class _NoGlobals(pickle.Unpickler):
    """Unpickles plain data only: any global (a class, a function: what a pickle needs to run code
    or build an object) is refused before it is looked up, so nothing from the file is executed."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refused global {module}.{name}: only plain dicts, lists and numbers are allowed")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refused persistent id: only plain dicts, lists and numbers are allowed")


def _trace_rows(path, key: str, columns: tuple[str, ...]) -> dict[Any, list[tuple[int, dict[str, float]]]]:
    """CSV / Parquet trace: client_id -> [(row number, {column: value})] (row 1: the header)."""
    p = Path(path)
    try:
        if p.suffix.lower() == ".parquet":
            import pandas as pd

            frame = pd.read_parquet(p)
            header = [str(c) for c in frame.columns]
            records = [(i + 2, list(r)) for i, r in enumerate(frame.itertuples(index=False, name=None))]
        else:
            rows, issues = _read_csv(p, key, ("client_id",) + columns)
            if issues:
                raise ConfigError(issues)
            header, records = ["client_id", *columns], rows
    except (OSError, ValueError, ImportError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError([_issue(key, path, f"a readable Parquet file with columns client_id,{','.join(columns)} "
                                             f"({type(e).__name__}: {e})")]) from None
    if header != ["client_id", *columns]:
        raise ConfigError([_issue(key, path, f"columns client_id,{','.join(columns)}; got {','.join(header)}")])
    out: dict[Any, list[tuple[int, dict[str, float]]]] = {}
    problems: list[str] = []
    for line, fields in records:
        if len(fields) != len(columns) + 1:
            problems.append(f"line {line}: expected {len(columns) + 1} fields, got {len(fields)}")
            continue
        values: dict[str, float] = {}
        for col, text in zip(columns, fields[1:], strict=True):
            v, err = _number(str(text), col)
            if err is not None:
                problems.append(f"line {line}: {err}")
                break
            values[col] = v
        else:
            out.setdefault(str(fields[0]).strip(), []).append((line, values))
    if problems:
        _raise(key, path, problems)
    return out


def _read_trace(path, key: str, columns: tuple[str, ...]):
    """A pickle (``.pkl`` / ``.pickle``, FedScale's form) as plain data, or CSV / Parquet rows."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([_issue(key, path, "an existing trace file (.pkl/.pickle, .csv or .parquet)")])
    if p.suffix.lower() in (".pkl", ".pickle"):
        try:
            with p.open("rb") as f:
                data = _NoGlobals(f).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as e:
            raise ConfigError([_issue(key, path, f"a pickle of plain dicts, lists and numbers ({e})")]) from None
        if not isinstance(data, dict) or not data:
            raise ConfigError([_issue(key, path, f"a pickle of a non-empty dict {{client_id: {{...}}}}; got "
                                                 f"{type(data).__name__}")])
        return data, None
    return None, _trace_rows(p, key, columns)


def _num(v, what: str) -> tuple[Optional[float], Optional[str]]:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None, f"{what} {v!r} is not a finite number"
    return float(v), None


def _sorted_ids(ids) -> list:
    return sorted(ids, key=lambda k: (not isinstance(k, int), k if isinstance(k, int) else str(k)))


def _dict_records(data: dict, expected: str, problems: list[str]):
    """(client, record) for each record of a trace pickle that is a dict; the others go to ``problems``."""
    for cid, rec in data.items():
        if isinstance(rec, dict):
            yield cid, rec
        else:
            problems.append(f"client {cid!r}: expected a dict with {expected}, got {type(rec).__name__}")


def load_device_trace(path, key: str = SPEED_KEY) -> dict[Any, tuple[float, float]]:
    """FedScale's device-capacity trace: trace client -> (computation ms per sample, communication
    kbit/s), both finite and > 0. A pickle ``{client: {"computation": x, "communication": y, ...}}``
    (other keys ignored) or CSV / Parquet columns ``client_id,computation,communication``."""
    data, rows = _read_trace(path, key, ("computation", "communication"))
    out: dict[Any, tuple[float, float]] = {}
    problems: list[str] = []
    if data is not None:
        for cid, rec in _dict_records(data, "computation and communication", problems):
            comp, err = _num(rec.get("computation"), f"client {cid!r}: computation")
            if err is None:
                comm, err = _num(rec.get("communication"), f"client {cid!r}: communication")
            if err is None and (comp <= 0 or comm <= 0):
                err = f"client {cid!r}: computation and communication must be > 0, got {comp} and {comm}"
            if err is not None:
                problems.append(err)
                continue
            out[cid] = (comp, comm)
    else:
        for cid, recs in rows.items():
            line, v = recs[0]
            if len(recs) > 1:
                problems.append(f"line {recs[1][0]}: client_id {cid} appears twice (first on line {line})")
            elif v["computation"] <= 0 or v["communication"] <= 0:
                problems.append(f"line {line}: computation and communication must be > 0")
            else:
                out[cid] = (v["computation"], v["communication"])
    if problems:
        _raise(key, path, problems)
    if not out:
        raise ConfigError([_issue(key, path, "a trace with at least one client")])
    return out


def _periodic_windows(active, inactive, finish: float) -> list[tuple[float, float]]:
    """Sorted, merged windows [active, inactive) within one period [0, finish) (cut at finish)."""
    ws = sorted((a, min(b, finish)) for a, b in zip(active, inactive, strict=True) if a < finish)
    out: list[tuple[float, float]] = []
    for s, e in ws:
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def load_behaviour_trace(path, key: str = AVAILABILITY_KEY) -> dict[Any, tuple[list[tuple[float, float]], float]]:
    """FedScale's behaviour trace: trace client -> (online windows within one period, the period).
    A pickle ``{client: {"active": [...], "inactive": [...], "finish_time": T, ...}}`` (other keys
    ignored) or CSV / Parquet with one row per interval, columns ``client_id,active,inactive,
    finish_time`` (finish_time the same on every row of a client). The client is online from
    ``active[k]`` to ``inactive[k]`` (``0 <= active[k] < inactive[k]``), the pattern repeating every
    ``finish_time`` (> 0) seconds, as FedScale reads it (time modulo finish_time); an interval's
    part past finish_time is cut."""
    data, rows = _read_trace(path, key, ("active", "inactive", "finish_time"))
    raw: dict[Any, tuple[list, list, Any, str]] = {}
    problems: list[str] = []
    if data is not None:
        for cid, rec in _dict_records(data, "active, inactive and finish_time", problems):
            act, ina = rec.get("active"), rec.get("inactive")
            if not isinstance(act, (list, tuple)) or not isinstance(ina, (list, tuple)) or len(act) != len(ina):
                problems.append(f"client {cid!r}: active and inactive must be lists of the same length")
                continue
            raw[cid] = (list(act), list(ina), rec.get("finish_time"), f"client {cid!r}")
    else:
        for cid, recs in rows.items():
            finishes = {v["finish_time"] for _, v in recs}
            if len(finishes) > 1:
                problems.append(f"line {recs[0][0]}: client_id {cid} has different finish_time values "
                                f"{sorted(finishes)}")
                continue
            raw[cid] = ([v["active"] for _, v in recs], [v["inactive"] for _, v in recs], finishes.pop(),
                        f"line {recs[0][0]}: client_id {cid}")
    out: dict[Any, tuple[list[tuple[float, float]], float]] = {}
    for cid, (act, ina, fin, where) in raw.items():
        finish, err = _num(fin, f"{where}: finish_time")
        if err is None and finish <= 0:
            err = f"{where}: finish_time {finish} must be > 0"
        for a, b in zip(act, ina, strict=True):
            if err is not None:
                break
            a, err = _num(a, f"{where}: active")
            if err is None:
                b, err = _num(b, f"{where}: inactive")
            if err is None and not 0 <= a < b:
                err = f"{where}: an interval must have 0 <= active < inactive, got [{a}, {b}]"
        if err is not None:
            problems.append(err)
            continue
        out[cid] = (_periodic_windows([float(a) for a in act], [float(b) for b in ina], finish), finish)
    if problems:
        _raise(key, path, problems)
    if not out:
        raise ConfigError([_issue(key, path, "a trace with at least one client")])
    return out


def map_trace_clients(trace_ids, num_clients: int, seed: int, salt: int) -> list:
    """Which trace client each run client is: the trace's ids sorted, then a permutation drawn from
    ``default_rng([seed, TRACE_STREAM, salt])``; run client ``c`` is ``ids[perm[c % len(ids)]]``
    (distinct trace clients while the trace has enough, each reused at most ceil(N / len) times
    otherwise). A function of the seed, the trace's ids and ``salt`` (one per trace file kind)."""
    ids = _sorted_ids(trace_ids)
    perm = np.random.default_rng([seed, TRACE_STREAM, salt]).permutation(len(ids))
    return [ids[int(perm[c % len(ids)])] for c in range(num_clients)]


def fedscale_speeds(trace: dict[Any, tuple[float, float]], num_clients: int, seed: int) -> np.ndarray:
    """Speed of each run client from its trace client's computation (ms per sample): the mapped
    clients' median computation / its own (the median device is speed 1.0; the architectures'
    seconds per sample at speed 1.0 stay as configured)."""
    comp = np.array([trace[t][0] for t in map_trace_clients(trace, num_clients, seed, DEVICE_SALT)])
    return float(np.median(comp)) / comp


def fedscale_bandwidths(trace: dict[Any, tuple[float, float]], num_clients: int, seed: int) -> np.ndarray:
    """Bytes/s of each run client from its trace client's communication (kbit/s: x 1000 / 8), the
    same mapping as :func:`fedscale_speeds` (one device: one trace client for speed and bandwidth)."""
    return np.array([trace[t][1] * 1000.0 / 8.0 for t in map_trace_clients(trace, num_clients, seed, DEVICE_SALT)])


def fedscale_windows(trace, num_clients: int, seed: int) -> tuple[dict[int, list[tuple[float, float]]], dict[int, float]]:
    """(windows, periods) of the run clients from the behaviour trace (:func:`load_behaviour_trace`)."""
    mapped = map_trace_clients(trace, num_clients, seed, BEHAVIOUR_SALT)
    return ({c: list(trace[t][0]) for c, t in enumerate(mapped)}, {c: trace[t][1] for c, t in enumerate(mapped)})


def lognormal_speeds(seed: int, num_clients: int, sigma: float) -> np.ndarray:
    """``exp(N(0, sigma^2))`` per client from ``default_rng([seed, SPEED_STREAM])``: a function of the
    seed and the client id only (client ``c`` gets the ``c``-th draw; median speed 1)."""
    rng = np.random.default_rng([seed, SPEED_STREAM])
    return np.exp(rng.normal(0.0, sigma, size=num_clients))


def lognormal_bandwidth_factors(seed: int, num_clients: int, sigma: float) -> np.ndarray:
    """``exp(N(0, sigma^2))`` per client from ``default_rng([seed, BANDWIDTH_STREAM])`` (median 1):
    client c's upload and download bandwidths are the configured ones x its factor."""
    rng = np.random.default_rng([seed, BANDWIDTH_STREAM])
    return np.exp(rng.normal(0.0, sigma, size=num_clients))


@register_check("system")
def system_issues(cfg: ExperimentConfig) -> list[ConfigIssue]:
    """Cross-section checks of ``cfg.system`` (registered with ``config.register_check``, so run by
    ``config.semantic_issues``): the profile CSVs against ``federation.num_clients``, and
    ``cost_per_sample``'s architecture names; none without ``system:``."""
    from rayfed_proto.models import ARCHITECTURES

    sysc = cfg.system
    if sysc is None:
        return []
    issues: list[ConfigIssue] = []
    n = cfg.federation.num_clients
    if sysc.speed.kind == "csv":
        try:
            load_speed_csv(sysc.speed.path, n)
        except ConfigError as e:
            issues.extend(e.issues)
    if sysc.availability.kind == "csv":
        try:
            load_availability_csv(sysc.availability.path, n)
        except ConfigError as e:
            issues.extend(e.issues)
    for section, loader, key in ((sysc.speed, load_device_trace, SPEED_KEY),
                                 (sysc.availability, load_behaviour_trace, AVAILABILITY_KEY),
                                 (sysc.bandwidth, load_device_trace, BANDWIDTH_KEY)):
        if section.kind == "fedscale":
            try:
                loader(section.path, key)
            except ConfigError as e:
                issues.extend(e.issues)
    fixed = [k for k in ("upload_bytes_per_s", "download_bytes_per_s") if getattr(sysc, k) is not None]
    if sysc.bandwidth.kind == "fedscale" and fixed:
        issues.append(ConfigIssue(key="system.bandwidth.kind", value="fedscale",
                                  allowed=f"with system.{' and system.'.join(fixed)} unset (the trace gives each "
                                          "client's bandwidth)"))
    if sysc.bandwidth.kind == "lognormal" and not fixed:
        issues.append(ConfigIssue(key="system.bandwidth.kind", value="lognormal",
                                  allowed="with system.upload_bytes_per_s and/or system.download_bytes_per_s set (the "
                                          "medians the per-client factors multiply)"))
    for arch in sysc.cost_per_sample:
        if arch not in ARCHITECTURES:
            issues.append(ConfigIssue(key=f"system.cost_per_sample.{arch}", value=sysc.cost_per_sample[arch],
                                      allowed="keys are architecture names: " + ", ".join(ARCHITECTURES.names())))
    return issues


# --------------------------------------------------------------------------- the model


class SystemModel:
    """Per-client simulated durations and availability for the virtual clock.

    Build it with :meth:`from_config`; the constructor takes the resolved pieces (for tests and
    for callers that have them already).
    """

    def __init__(self, speeds, archs: list[str], arch_cost_s: dict[str, float], train_sizes: list[int],
                 local_epochs: int, upload_bytes_per_s: Optional[float] = None,
                 download_bytes_per_s: Optional[float] = None, availability: str = "always", p: float = 1.0,
                 retry_s: float = 60.0, windows: Optional[dict[int, list[tuple[float, float]]]] = None,
                 work: Optional[list[list]] = None, periods: Optional[dict[int, float]] = None,
                 client_upload_bytes_per_s=None, client_download_bytes_per_s=None,
                 server_speed: Optional[float] = None, server_work=None, server_arch_cost_s=None,
                 reference_flops: float = 1e9):
        self.speeds = np.asarray(speeds, dtype=float)
        # the server: its speed (None: free) and the work of a step, server_work(updates, uploaders) -> passes
        self.server_speed, self.server_work, self.reference_flops = server_speed, server_work, float(reference_flops)
        self.server_arch_cost_s = dict(server_arch_cost_s or {})
        if server_speed is not None and not (math.isfinite(server_speed) and server_speed > 0):
            raise ValueError(f"server_speed must be finite and > 0 (or None: free), got {server_speed}")
        n = len(self.speeds)
        if len(archs) != n or len(train_sizes) != n:
            raise ValueError(f"speeds, archs and train_sizes must have one entry per client; got {n}, {len(archs)}, "
                             f"{len(train_sizes)}")
        if not np.all(np.isfinite(self.speeds) & (self.speeds > 0)):
            raise ValueError("speeds must be finite and > 0")
        if availability not in ("always", "probability", "csv", "fedscale"):
            raise ValueError(f"availability must be always, probability, csv or fedscale, got {availability!r}")
        self.archs = list(archs)
        self.arch_cost_s = {a: float(arch_cost_s[a]) for a in dict.fromkeys(self.archs)}
        self.train_sizes = np.asarray(train_sizes, dtype=np.int64)
        self.local_epochs = int(local_epochs)
        self.upload_bytes_per_s = upload_bytes_per_s
        self.download_bytes_per_s = download_bytes_per_s
        self.availability = availability
        self.p = float(p)
        self.retry_s = float(retry_s)
        self.windows = {int(c): list(ws) for c, ws in (windows or {}).items()}
        self._starts = {c: [s for s, _ in ws] for c, ws in self.windows.items()}
        # fedscale availability: client -> the period its windows repeat with (FedScale's finish_time)
        self.periods = {int(c): float(t) for c, t in (periods or {}).items()}
        if availability == "fedscale" and set(self.periods) != set(self.windows):
            raise ValueError("fedscale availability needs one period per client with windows")
        # per-client bandwidths (bytes/s; None: upload_bytes_per_s / download_bytes_per_s for everyone)
        self.client_upload_bytes_per_s = None if client_upload_bytes_per_s is None else np.asarray(
            client_upload_bytes_per_s, dtype=float)
        self.client_download_bytes_per_s = None if client_download_bytes_per_s is None else np.asarray(
            client_download_bytes_per_s, dtype=float)
        for bw in (self.client_upload_bytes_per_s, self.client_download_bytes_per_s):
            if bw is not None and (len(bw) != n or not np.all(np.isfinite(bw) & (bw > 0))):
                raise ValueError("per-client bandwidths must have one finite value > 0 per client")
        cost = np.array([self.arch_cost_s[a] for a in self.archs], dtype=float)
        self.compute_s = self.train_sizes * self.local_epochs * cost / self.speeds
        # the methods' declared work (algorithms.base.Pass per client): compute_s is the work of an
        # update against version 0, self.phases the later versions from which passes are added
        self.phases: list[tuple[int, np.ndarray]] = []
        if work is not None:
            if len(work) != n:
                raise ValueError(f"work must have one list of passes per client; got {len(work)} for {n} clients")
            starts = sorted({int(p.from_version) for passes in work for p in passes} | {0})
            at = {v: np.array([update_work_s(passes, cost[c], v) for c, passes in enumerate(work)]) / self.speeds
                  for v in starts}
            self.compute_s = at[0]
            self.phases = [(v, at[v]) for v in starts[1:]]

    @property
    def num_clients(self) -> int:
        return len(self.speeds)

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, train_sizes: list[int], in_channels: int, image_size: int,
                    num_classes: int, work: Optional[list[list]] = None, server_work=None) -> SystemModel:
        """The model of ``cfg.system`` (which must be set) for clients with ``train_sizes[c]`` training
        samples; CSV profiles are read again (a bad file raises :class:`ConfigError`). ``work``: each
        client's declared passes of one update (``ClientAlgorithm.update_work``); None: local epochs
        of forward-backward over the training split. ``server_work(updates, uploaders)``: the passes
        of one server step (``ServerAlgorithm.server_work``); None: a free server."""
        from rayfed_proto.models.zoo import arch_for_client

        sysc = cfg.system
        if sysc is None:
            raise ValueError("cfg.system is None: wall-clock mode has no system model")
        n = cfg.federation.num_clients
        if len(train_sizes) != n:
            raise ValueError(f"train_sizes has {len(train_sizes)} entries for {n} clients")
        if sysc.speed.kind == "constant":
            speeds = np.full(n, float(sysc.speed.value))
        elif sysc.speed.kind == "lognormal":
            speeds = lognormal_speeds(cfg.seed, n, sysc.speed.sigma)
        elif sysc.speed.kind == "fedscale":
            speeds = fedscale_speeds(load_device_trace(sysc.speed.path), n, cfg.seed)
        else:
            speeds = load_speed_csv(sysc.speed.path, n)
        archs = [arch_for_client(cfg.model.group, c) for c in range(n)]
        cost: dict[str, float] = {}
        for arch in dict.fromkeys(archs):
            if arch in sysc.cost_per_sample:
                cost[arch] = float(sysc.cost_per_sample[arch])
            else:
                macs = architecture_macs(arch, in_channels, image_size, num_classes, cfg.model.feature_dim,
                                         cfg.model.projector, cfg.model.stem)
                cost[arch] = seconds_per_sample(macs, sysc.reference_flops)
        av = sysc.availability
        kwargs: dict = {"availability": av.kind}
        if av.kind == "probability":
            kwargs.update(p=av.p, retry_s=av.retry_s)
        elif av.kind == "csv":
            kwargs.update(windows=load_availability_csv(av.path, n))
        elif av.kind == "fedscale":
            windows, periods = fedscale_windows(load_behaviour_trace(av.path), n, cfg.seed)
            kwargs.update(windows=windows, periods=periods)
        bw = sysc.bandwidth
        if bw.kind == "fedscale":
            per_client = fedscale_bandwidths(load_device_trace(bw.path, BANDWIDTH_KEY), n, cfg.seed)
            kwargs.update(client_upload_bytes_per_s=per_client, client_download_bytes_per_s=per_client)
        elif bw.kind == "lognormal":
            factor = lognormal_bandwidth_factors(cfg.seed, n, bw.sigma)
            for k in ("upload_bytes_per_s", "download_bytes_per_s"):
                if getattr(sysc, k) is not None:
                    kwargs[f"client_{k}"] = getattr(sysc, k) * factor
        # the server's speed, and the cost of the architectures its declared passes name (as the clients')
        server_archs = {p.arch for p in (server_work(1, 1) if server_work is not None else []) if p.arch is not None}
        kwargs.update(server_speed=server_speed(sysc.server, cfg.seed), server_work=server_work,
                      reference_flops=sysc.reference_flops,
                      server_arch_cost_s={a: sysc.cost_per_sample.get(a) or seconds_per_sample(architecture_macs(
                          a, in_channels, image_size, num_classes, cfg.model.feature_dim, cfg.model.projector,
                          cfg.model.stem),
                          sysc.reference_flops) for a in server_archs})
        return cls(speeds, archs, cost, list(train_sizes), cfg.training.local_epochs,
                   sysc.upload_bytes_per_s, sysc.download_bytes_per_s, work=work, **kwargs)

    # ------------------------------------------------------------------ durations

    def server_step_s(self, updates: int, uploaders: int = 0) -> float:
        """Simulated seconds of one server step aggregating ``updates`` (``uploaders``: distinct
        clients whose upload the server holds): the method's declared server work at the server's
        speed; 0 for a free server or a method that declares none."""
        if self.server_speed is None or self.server_work is None:
            return 0.0
        work = server_step_work_s(self.server_work(updates, uploaders), self.server_arch_cost_s, self.reference_flops)
        return work / self.server_speed

    def transfer_s(self, download_bytes: int, upload_bytes: int, client: Optional[int] = None) -> float:
        """Seconds to receive ``download_bytes`` and send ``upload_bytes`` (0 for an unset bandwidth);
        with ``client``, at that client's own bandwidths when they are per client."""
        if download_bytes < 0 or upload_bytes < 0:
            raise ValueError(f"message sizes must be >= 0, got {download_bytes} and {upload_bytes}")
        down, up = self.download_bytes_per_s, self.upload_bytes_per_s
        if client is not None and self.client_download_bytes_per_s is not None:
            down = float(self.client_download_bytes_per_s[client])
        if client is not None and self.client_upload_bytes_per_s is not None:
            up = float(self.client_upload_bytes_per_s[client])
        t = 0.0
        if down is not None:
            t += download_bytes / down
        if up is not None:
            t += upload_bytes / up
        return t

    def compute_at(self, client: int, version: int = 0) -> float:
        """Simulated compute seconds of ``client``'s update trained against server ``version`` (the
        method's declared passes from that version on; ``compute_s`` before any later phase)."""
        out = self.compute_s
        for v, arr in self.phases:
            if v <= version:
                out = arr
        return float(out[client])

    def update_duration(self, client: int, download_bytes: int, upload_bytes: int, version: int = 0) -> float:
        """Simulated seconds of one local update of ``client`` against ``version``: download + compute + upload."""
        return self.compute_at(client, version) + self.transfer_s(download_bytes, upload_bytes, client)

    # ------------------------------------------------------------------ availability

    def _in_window(self, client: int, t: float) -> bool:
        ws = self.windows.get(client)
        if ws is None:
            return True  # not listed: always online
        if client in self.periods:
            t = t % self.periods[client]  # fedscale: the pattern repeats every period
        i = bisect_right(self._starts[client], t) - 1
        return i >= 0 and t < ws[i][1]

    def _next_start(self, client: int, t: float) -> Optional[float]:
        """The first window start of ``client`` after ``t`` (None: none)."""
        starts = self._starts[client]
        period = self.periods.get(client)
        if period is None:
            i = bisect_right(starts, t)
            return starts[i] if i < len(starts) else None
        if not starts:
            return None
        base = t - t % period
        i = bisect_right(starts, t - base)
        return base + starts[i] if i < len(starts) else base + period + starts[0]

    def offline_at(self, client: int, t: float) -> float:
        """When ``client``, online at ``t``, next goes offline: the end of its window holding ``t``
        (``inf``: never, for ``always`` / ``probability`` availability and clients without windows;
        ``t`` itself when it is not online at ``t``). An update started at ``t`` that would finish
        later than this is lost (the dropout rule, docs/simulation.md)."""
        if self.availability not in ("csv", "fedscale") or client not in self.windows:
            return math.inf
        if not self._in_window(client, t):
            return t
        ws, period = self.windows[client], self.periods.get(client)
        base = 0.0 if period is None else t - t % period
        end = base + ws[bisect_right(self._starts[client], t - base) - 1][1]
        if period is not None and ws[0][0] <= 0.0:  # a window reaching the period's end goes on in the next period
            covered = sum(e - s for s, e in ws)
            if covered >= period:
                return math.inf  # online all the time
            while end >= base + period:
                base += period
                end = base + ws[0][1]
        return end

    def online_clients(self, candidates: list[int], t: float, rng: np.random.Generator) -> list[int]:
        """The candidates online at simulated time ``t``, in the candidates' order.

        ``probability``: one ``rng.random(len(candidates))`` per call (so the caller's stream
        advances by exactly that much); candidate ``i`` is online when its draw is ``< p``.
        ``always`` and ``csv`` draw nothing; ``csv``: online when ``start_s <= t < end_s`` for one of
        the client's windows, or the client has no window at all.
        """
        if self.availability == "always":
            return list(candidates)
        if self.availability == "probability":
            draws = rng.random(len(candidates))
            return [c for c, u in zip(candidates, draws, strict=True) if u < self.p]
        return [c for c in candidates if self._in_window(c, t)]

    def next_online_time(self, candidates: list[int], t: float) -> Optional[float]:
        """The earliest simulated time ``>= t`` at which some candidate may be online (``t`` itself
        when one is online at ``t``); ``None`` when none ever will be again, or no candidates.

        ``always``: ``t``; ``probability``: ``t + retry_s`` (a new draw is needed); ``csv``: ``t`` if a
        candidate is online at ``t``, else the next window start after ``t``.
        """
        if not candidates:
            return None
        if self.availability == "always":
            return t
        if self.availability == "probability":
            return t + self.retry_s
        best: Optional[float] = None
        for c in candidates:
            if self._in_window(c, t):
                return t
            s = self._next_start(c, t)
            if s is not None and (best is None or s < best):
                best = s
        return best

    def max_update_starts(self) -> float:
        """At most how many local updates can ever start (``inf`` unless CSV windows list every
        client): a client's next update starts after its previous one's compute time at the
        earliest, so a window [s, e) holds at most ceil((e - s) / compute_s) starts."""
        if self.availability != "csv" or len(self.windows) < self.num_clients:
            return math.inf
        total = 0
        for c, ws in self.windows.items():
            d = float(self.compute_s[c])
            if d <= 0:
                return math.inf
            total += sum(math.ceil((e - s) / d) for s, e in ws if e > s)
        return float(total)

    # ------------------------------------------------------------------ summary

    def describe(self) -> dict[str, float]:
        """Summary for MLflow params and the log: speed and compute-time spread, seconds per sample of
        each architecture, bandwidths (``inf`` when unset) and the availability parameters."""
        out: dict[str, float] = {
            "speed_min": float(self.speeds.min()), "speed_median": float(np.median(self.speeds)),
            "speed_max": float(self.speeds.max()),
            "compute_s_min": float(self.compute_s.min()), "compute_s_median": float(np.median(self.compute_s)),
            "compute_s_max": float(self.compute_s.max()),
            "upload_bytes_per_s": float(self.upload_bytes_per_s) if self.upload_bytes_per_s is not None else math.inf,
            "download_bytes_per_s": (float(self.download_bytes_per_s) if self.download_bytes_per_s is not None
                                     else math.inf),
        }
        out["server_speed"] = float(self.server_speed) if self.server_speed is not None else math.inf  # inf: free
        for arch, c in self.arch_cost_s.items():
            out[f"cost_s_per_sample.{arch}"] = c
        if self.availability == "probability":
            out.update(availability_p=self.p, availability_retry_s=self.retry_s)
        elif self.availability in ("csv", "fedscale"):
            out["clients_with_windows"] = float(len(self.windows))
        for k, bw in (("upload", self.client_upload_bytes_per_s), ("download", self.client_download_bytes_per_s)):
            if bw is not None:  # per client: the spread (the medians replace the single values above)
                out.update({f"{k}_bytes_per_s": float(np.median(bw)), f"{k}_bytes_per_s_min": float(bw.min()),
                            f"{k}_bytes_per_s_max": float(bw.max())})
        return out
