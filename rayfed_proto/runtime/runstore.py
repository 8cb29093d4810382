"""A run's own files beside its checkpoints at a remote store, and the run folder rebuilt from them.

A run whose ``checkpoint.dir`` is a URI (``s3://bucket/prefix``, ``gs://``, ``file:///shared/...``)
outlives the machine of its run folder: with its first checkpoint, the driver copies the folder's
``config.yaml`` (the resolved config), ``partition.parquet`` (which client holds which samples) and
``run.json`` (the MLflow run id and store) to ``<checkpoint.dir>/run/``, beside the ``vNNNNNN/``
checkpoint folders (the store lists only those, so the extra folder is never taken for one).
``rayfed-proto run --resume <checkpoint URI>`` then rebuilds the run folder from there
(:func:`rebuild_run_folder`) and continues from the newest complete checkpoint, in the same
MLflow run, on any machine (after ``ray down``, on a new cluster).

Everything else in a run folder is either rewritten by the resumed run (history, plots, summary)
or already in MLflow (every artifact), so these three files are all a resume needs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from rayfed_proto.config import InputError

log = logging.getLogger("rayfed_proto")

FOLDER = "run"  # <checkpoint URI>/run/
RUN_FILES = ("config.yaml", "partition.parquet", "run.json")
NAME_FILE = "folder.json"  # the run folder's name, so that a rebuilt folder is named as the original


def store_run_files(store, out: Path) -> bool:
    """Copy the run folder's files (:data:`RUN_FILES`) beside the checkpoints of a remote
    ``store`` (a :class:`~rayfed_proto.runtime.checkpoint.CheckpointStore`); True when done (or
    nothing to do: a local store keeps the run folder itself). A failure is a warning, as a failed
    checkpoint is: the run goes on, and the next checkpoint tries again."""
    remote = getattr(store, "remote", None)
    if remote is None:
        return True
    try:
        for name in RUN_FILES:
            path = Path(out) / name
            if path.is_file():
                remote.write_bytes(f"{FOLDER}/{name}", path.read_bytes())
        remote.write_bytes(f"{FOLDER}/{NAME_FILE}", json.dumps({"name": Path(out).name}).encode())
    except OSError as e:
        log.warning("could not copy the run's files to %s/%s (%s); a resume from that URI alone is not possible "
                    "until a later checkpoint copies them", remote.uri, FOLDER, e)
        return False
    return True


def rebuild_run_folder(uri: str, output_dir: Optional[str | Path] = None, filesystem=None) -> Path:
    """The run folder of the run whose checkpoints are at ``uri``: ``<output_dir>/<its name>``
    (``output_dir`` defaults to the saved config's ``tracking.output_dir``), used as it is when it
    still holds the run's ``config.yaml``, else rebuilt from ``<uri>/run/``. An
    :class:`InputError` says what is missing when ``uri`` holds no run."""
    import yaml

    from rayfed_proto.runtime import storage

    try:
        loc = storage.Location(uri, filesystem)
        present = loc.exists(f"{FOLDER}/config.yaml")
    except (OSError, ValueError) as e:
        raise InputError(f"--resume {uri}: cannot open it ({e}); give the checkpoint.dir URI of a run") from None
    if not present:
        found = [n for n in (loc.list() if loc.exists() else []) if n.startswith("v") and n[1:].isdigit()]
        why = (f"it holds checkpoints ({', '.join(found[-2:])}) but not {FOLDER}/config.yaml: they were written before "
               f"runs copied their files there; resume from the run's folder instead (rayfed-proto run --resume DIR)"
               if found else "nothing a run wrote is there (no checkpoint, no run files)")
        raise InputError(f"--resume {uri}: {why}")
    config_text = loc.read_bytes(f"{FOLDER}/config.yaml").decode()
    try:
        name = json.loads(loc.read_bytes(f"{FOLDER}/{NAME_FILE}"))["name"]
    except (OSError, ValueError, KeyError, TypeError):
        name = "resumed-" + uri.rstrip("/").rsplit("/", 1)[-1]
    if output_dir is None:
        output_dir = ((yaml.safe_load(config_text) or {}).get("tracking") or {}).get("output_dir") or "runs"
    out = Path(output_dir).expanduser().resolve() / Path(name).name
    if (out / "config.yaml").is_file():  # the folder is still here (same machine): it is the run's
        return out
    try:
        out.mkdir(parents=True, exist_ok=True)
        for f in RUN_FILES:
            if loc.exists(f"{FOLDER}/{f}"):
                (out / f).write_bytes(loc.read_bytes(f"{FOLDER}/{f}"))
    except OSError as e:
        raise PermissionError(f"cannot rebuild the run folder {out} ({e}); set tracking.output_dir to a writable "
                              "folder (--set tracking.output_dir=DIR)") from None
    missing = [f for f in ("config.yaml", "partition.parquet") if not (out / f).is_file()]
    if missing:
        raise InputError(f"--resume {uri}: {FOLDER}/{missing[0]} is missing there; the run folder cannot be rebuilt")
    log.info("run folder %s rebuilt from %s/%s", out, uri.rstrip("/"), FOLDER)
    return out
