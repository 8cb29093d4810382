"""``rayfed-proto``: run, validate, list, tune, compare and reproduce.

Exit codes: 0 success; 2 invalid input (config, dataset, resources, a run folder in use or with
no usable checkpoint), with a message naming the key or file, the value and what is allowed;
130 interrupted (143 SIGTERM); 1 a failure during the run (e.g. no progress), with the reason;
141 the reader of stdout went away (``rayfed-proto list | head``), quietly.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional

from rayfed_proto.config import (
    ConfigError,
    ConfigIssue,
    ExperimentConfig,
    InputError,
    check_resume_overrides,
    load_config,
)
from rayfed_proto.preset_files import preset_names, presets_dir, resolve_config_arg

EXIT_BAD_INPUT = 2


def _load(args) -> ExperimentConfig:
    return load_config(resolve_config_arg(args.config), args.set)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="experiment YAML or preset name (default: the packaged default preset)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config entry, e.g. --set federation.mode=sync (repeatable)")


def cmd_validate(args) -> int:
    cfg = _load(args)
    print(f"config OK: {cfg.algorithm.name} on {cfg.data.name}, {cfg.federation.num_clients} clients, "
          f"{cfg.federation.mode} mode, {cfg.federation.rounds} rounds (server versions)")
    if args.show:
        print(cfg.to_yaml())
    return 0


def cmd_list(args) -> int:
    from rayfed_proto.algorithms import ALGORITHMS
    from rayfed_proto.data import DATASETS, PARTITIONERS
    from rayfed_proto.models import ARCHITECTURES, MODEL_GROUPS

    def section(title, registry, detail=None):
        print(f"{title}:")
        for name in registry.names():
            extra = detail(name) if detail else registry.describe(name)
            print(f"  {name:<16} {extra}")
        print()

    section("algorithms", ALGORITHMS)
    section("local update with resources.batch_clients auto", ALGORITHMS, _batching)
    section("datasets", DATASETS)
    section("partitioners", PARTITIONERS)
    section("model groups", MODEL_GROUPS, lambda g: ", ".join(MODEL_GROUPS.get(g)))
    section("architectures", ARCHITECTURES)
    print("presets (rayfed-proto run NAME):")
    for name in preset_names():
        first = (presets_dir() / f"{name}.yaml").read_text().splitlines()[0].lstrip("# ")
        print(f"  {name:<20} {first}")
    print()
    if args.options:
        algo = ALGORITHMS.get(args.options)
        print(f"options of {args.options} (set as algorithm.<name>):")
        for name, f in algo.Options.model_fields.items():
            print(f"  {name:<22} default {f.default!r:<10} {f.description or ''}")
    return 0


def _batching(name: str) -> str:
    """Whether a method's clients may step as one batched model (``resources.batch_clients``)."""
    from rayfed_proto.algorithms import ALGORITHMS
    from rayfed_proto.training.batched import method_refusal

    refusal = method_refusal(ALGORITHMS.get(name).Client)
    return "batched (clients of one architecture on a worker step together)" if refusal is None else \
        f"one client at a time ({refusal})"


def package_version() -> str:
    """The installed distribution's version, else ``rayfed_proto.__version__`` (a checkout on sys.path)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rayfed_proto")
    except PackageNotFoundError:
        import rayfed_proto

        return rayfed_proto.__version__


def browse_hint(tracking_uri: str, run_id: Optional[str] = None, experiment_id: Optional[str] = None) -> str:
    """How to look at a run: its page on a tracking server, else the ``rayfed-proto ui`` command
    that serves the store and the page to open (both in the model-training view: tracking/links.py)."""
    from rayfed_proto.tracking.links import browse_hint as hint

    return hint(tracking_uri, run_id, experiment_id)


def cmd_ui(args) -> int:
    """Serve the store with ``mlflow ui`` and, once it answers, print (``--open``: open) the
    experiment's runs, in the model-training view; on a tracking server (http) only the link.
    Ctrl-C or SIGTERM stops the server and its workers (its whole process group)."""
    from rayfed_proto.tracking import links

    uri = _ui_store(args.tracking_uri)
    serve = not (links.is_server(uri) or args.no_serve)
    if serve:
        _check_port_free(args.host, args.port)
    experiment = links.find_experiment(uri, args.experiment)
    if args.experiment and experiment is None:
        raise InputError(f"no experiment {args.experiment!r} in {uri}; omit --experiment for the latest one, or pass "
                         "the name a run logged to (tracking.experiment_name)")
    base = uri.rstrip("/") if links.is_server(uri) else links.ui_base(args.host, args.port)
    link = links.experiment_url(base, experiment.experiment_id) if experiment else f"{base}/#/experiments?{links.ML_VIEW}"
    what = f"experiment {experiment.name!r}" if experiment else "the experiments (none holds a run yet)"
    if not serve:
        _print_ui_link(what, link)
        if args.open:
            _open_browser(link)
        return 0
    return _serve_ui(links.ui_server_command(uri, args.host, args.port), base, what, link, args.open)


UI_START_TIMEOUT_S = 180.0  # mlflow ui on a loaded machine took 27 s to answer (issue 49)
UI_PROGRESS_EVERY_S = 5.0


def _print_ui_link(what: str, link: str) -> None:
    print(f"MLflow UI, {what}: {link}")
    print("(links carry ?workflowType=machine_learning; elsewhere, the sidebar switch 'Model training' keeps the "
          "UI on runs for this browser)", flush=True)


def _serve_ui(command: list[str], base: str, what: str, link: str, open_browser: bool) -> int:
    """Start ``command`` (``mlflow ui``) in a process group of its own, print the link once ``base``
    answers, then wait; Ctrl-C or SIGTERM stop the whole group (the server, its workers, its job
    runner), as does any way out of here."""
    import signal
    import subprocess

    proc = subprocess.Popen(command, start_new_session=True)  # its own group: killpg reaches every worker
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        if not _wait_for_ui(proc, base):
            code = proc.poll()
            print(f"error: the MLflow UI did not answer at {base} "
                  + (f"(mlflow ui exited with status {code})" if code is not None
                     else f"within {UI_START_TIMEOUT_S:.0f} s; stopped it"), file=sys.stderr)
            return code or 1
        print(f"MLflow UI ready at {base} (Ctrl-C stops it)")
        _print_ui_link(what, link)
        if open_browser:
            _open_browser(link)
        return proc.wait()
    except _Terminated:
        return 143  # 128 + SIGTERM
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop_group(proc)


class _Terminated(KeyboardInterrupt):
    """SIGTERM while ``rayfed-proto ui`` serves: stopped as on Ctrl-C."""


def _terminated(signum, frame):
    raise _Terminated()


def _wait_for_ui(proc, base: str) -> bool:
    """Poll ``base`` until it answers (any HTTP response); a line of progress every few seconds.
    False when the server exited or did not answer within :data:`UI_START_TIMEOUT_S`."""
    import time
    import urllib.error
    import urllib.request

    start = time.monotonic()
    said = start
    print(f"starting the MLflow UI at {base} ...", flush=True)
    while proc.poll() is None and time.monotonic() - start < UI_START_TIMEOUT_S:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2):
                return True
        except urllib.error.HTTPError:  # an HTTP answer, even an error page: it serves
            return True
        except OSError:
            time.sleep(0.25)
        if time.monotonic() - said >= UI_PROGRESS_EVERY_S:
            said = time.monotonic()
            print(f"  waiting for the MLflow UI to answer ({said - start:.0f} s)", flush=True)
    return False


def _stop_group(proc, grace_s: float = 10.0) -> None:
    """SIGTERM to the server's process group, SIGKILL to what is left of it after ``grace_s``."""
    import contextlib
    import os
    import signal
    import subprocess
    import time

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is gone
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                proc.poll()  # reap the leader: a zombie still counts for killpg
            if not group_members(proc.pid):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1)  # reaped, not left a zombie
                return
            time.sleep(0.1)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of the process group ``pgid``, read from /proc; where there
    is no /proc, ``[pgid]`` while the group can still be signalled."""
    import os

    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    members = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):  # ended while read
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def _check_port_free(host: str, port: int) -> None:
    """Refuse at once (an InputError naming the port) when ``host:port`` is taken, rather than
    start ``mlflow ui``, which says "Address already in use" after seconds and exits 0. The probe
    binds as the server does (SO_REUSEADDR: a port held only by closed connections is free)."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError):  # a host this machine cannot resolve: mlflow says so
        return
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise InputError(f"cannot serve the MLflow UI on {host}:{port}: {e.strerror or e} (another server, perhaps "
                             f"an earlier rayfed-proto ui, holds port {port}); pick a free one with --port, e.g. "
                             f"--port {port + 1}, or open the UI already running there") from None


def _ui_store(tracking_uri: Optional[str]) -> str:
    """The store ``rayfed-proto ui`` serves, resolved as ``run`` resolves it; a sqlite file must exist."""
    from rayfed_proto.tracking.mlflow_tracker import resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise InputError(f"no MLflow store at {uri[len('sqlite:///'):]} (--tracking-uri {tracking_uri or '<default>'}); "
                         "pass the store a run logged to (printed at its end), or run an experiment from this folder first")
    return uri


def _open_browser(link: str) -> None:
    import webbrowser

    if not webbrowser.open(link):
        print(f"no browser to open here; open {link} yourself", file=sys.stderr)


def cmd_run(args) -> int:
    from rayfed_proto.runtime import seeds as seed_groups
    from rayfed_proto.runtime.driver import run_experiment

    progress = not args.no_progress
    if args.resume:
        if args.config is not None:
            raise ConfigError([ConfigIssue(key="<config>", value=args.config,
                                           allowed="omit it with --resume: the run's own config.yaml is used")])
        if seed_groups.is_group(args.resume):
            if args.seeds is not None:
                raise ConfigError([ConfigIssue(key="--seeds", value=args.seeds, allowed=(
                    "omit it with --resume of a seed group: the group's seeds.json lists its seeds"))])
            check_resume_overrides(args.set)
            return _report_seed_group(seed_groups.resume_seeds(args.resume, args.set, progress=progress))
        if args.seeds is not None:
            raise ConfigError([ConfigIssue(key="--seeds", value=args.seeds, allowed=(
                f"omit it with --resume of a single run ({args.resume} has no seeds.json); to run more seeds, "
                "start a seed group: rayfed-proto run CONFIG --seeds ..."))])
        if "://" in args.resume:  # a checkpoint.dir URI: the run folder rebuilt from what the store holds (runstore.py)
            from rayfed_proto.config import parse_override
            from rayfed_proto.runtime.runstore import rebuild_run_folder

            check_resume_overrides(args.set)
            out_dir = dict(parse_override(s) for s in args.set).get("tracking.output_dir")
            uri, args.resume = args.resume, str(rebuild_run_folder(args.resume, out_dir))
            args.set = [f"checkpoint.dir={uri}", *args.set]
        saved = Path(args.resume) / "config.yaml"
        if not saved.is_file():
            raise InputError(f"{args.resume} is not the output folder of a run or seed group (no config.yaml or "
                             "seeds.json in it); pass the folder printed as 'outputs:' or in the stop message")
        check_resume_overrides(args.set)
        cfg = load_config(saved, args.set)
    else:
        if args.methods:
            return _run_methods(args, progress)
        cfg = _load(args)
        if args.seeds is not None:
            seeds = seed_groups.check_seeds(args.seeds)
            seed_groups.check_no_seed_override(args.set)
            return _report_seed_group(seed_groups.run_seeds(cfg, seeds, progress=progress))
    result = run_experiment(cfg, progress=progress, resume_dir=args.resume)
    print(result.summary)
    print(f"outputs: {result.output_dir}")
    _print_run_link(result, cfg)
    return 0


def _print_run_link(result, cfg: ExperimentConfig) -> None:
    """The finished run's page in the MLflow UI (model-training view), and how to serve it."""
    if result.run_id:
        print(f"MLflow: run {result.run_id} in experiment {cfg.tracking.experiment_name!r}; "
              f"{browse_hint(result.tracking_uri, result.run_id)}")


def _run_methods(args, progress: bool) -> int:
    """``--methods A B C``: the same experiment once per method (``algorithm.name``), each a seed
    group when ``--seeds`` is given, all in one MLflow experiment, ready for ``compare``. Every
    method's config is checked before the first one runs."""
    from rayfed_proto.runtime import seeds as seed_groups
    from rayfed_proto.runtime.driver import run_experiment

    if args.resume:
        raise ConfigError([ConfigIssue(key="--methods", value=args.methods, allowed=(
            "omit it with --resume: resume each method's run or seed group by its folder"))])
    if len(set(args.methods)) != len(args.methods):
        raise ConfigError([ConfigIssue(key="--methods", value=args.methods, allowed="distinct algorithm names")])
    for item in args.set:
        if item.split("=", 1)[0].strip() == "algorithm.name":
            raise ConfigError([ConfigIssue(key="--set algorithm.name", value=item, allowed=(
                "omit it with --methods: each method sets algorithm.name"))])
    cfgs = [load_config(resolve_config_arg(args.config), [*args.set, f"algorithm.name={m}"]) for m in args.methods]
    seeds = None
    if args.seeds is not None:
        seeds = seed_groups.check_seeds(args.seeds)
        seed_groups.check_no_seed_override(args.set)
    code = 0
    for method, cfg in zip(args.methods, cfgs, strict=True):
        print(f"== {method} ==", flush=True)
        if seeds is not None:
            code = max(code, _report_seed_group(seed_groups.run_seeds(cfg, seeds, progress=progress, method_first=True)))
            continue
        result = run_experiment(cfg, progress=progress)
        print(result.summary)
        print(f"outputs: {result.output_dir}")
        _print_run_link(result, cfg)
    experiment = cfgs[0].tracking.experiment_name
    print(f"compare them with: rayfed-proto compare {experiment}"
          + (f" --tracking-uri {cfgs[0].tracking.tracking_uri}" if cfgs[0].tracking.tracking_uri else ""))
    return code


def _report_seed_group(group) -> int:
    """The seed group's table and where it is; exit 1 when a seed failed."""
    print(group.summary)
    print(f"outputs: {group.output_dir}")
    if group.parent_run_id:
        print(f"MLflow: parent run {group.parent_run_id} in experiment {group.experiment_name!r}; "
              f"{browse_hint(group.tracking_uri, group.parent_run_id)}")
    if group.status != "FINISHED":
        print(f"error: {group.reason}; continue the failed seeds with: rayfed-proto run --resume {group.output_dir}",
              file=sys.stderr)
        return 1
    return 0


def sweep_dirs() -> list[Path]:
    """Where a sweep given by name (or by a relative path not found here) is looked for: the
    current folder, then the checkout this package runs from (its ``tune_configs/`` ships the
    sweeps; they are not package data, so an installed wheel has only the current folder)."""
    checkout = Path(__file__).resolve().parent.parent
    return [Path.cwd()] + ([checkout] if (checkout / "tune_configs").is_dir() and checkout != Path.cwd() else [])


def resolve_sweep_arg(sweep: str) -> Path:
    """A sweep YAML path, or the name of a file in ``tune_configs/`` (``rayfed-proto tune
    fedsa_lambda_cpu``), found from any folder: see :func:`sweep_dirs`. A ConfigError lists
    where it looked."""
    path = Path(sweep).expanduser()
    if path.exists() or path.is_absolute():
        return path  # an absolute path that is missing: load_sweep names it
    by_name = path.suffix == "" and "/" not in sweep
    tried = [root / "tune_configs" / f"{sweep}.yaml" for root in sweep_dirs()] if by_name else [root / path for root in sweep_dirs()]
    for candidate in tried:
        if candidate.is_file():
            return candidate
    names = sorted({p.stem for root in sweep_dirs() for p in (root / "tune_configs").glob("*.yaml")})
    raise ConfigError([ConfigIssue(key="<sweep>", value=sweep, allowed=(
        "a sweep YAML file, or the name of one in tune_configs/; looked for " + ", ".join(map(str, tried))
        + (f"; sweeps found: {', '.join(names)}" if names else "")))])


def cmd_tune(args) -> int:
    from rayfed_proto.tuning.spec import load_sweep

    if (args.sweep is None) == (args.resume is None):
        print("error: give a sweep file, or --resume FOLDER (not both)", file=sys.stderr)
        return EXIT_BAD_INPUT
    spec = None
    if args.sweep is not None:
        spec = load_sweep(resolve_sweep_arg(args.sweep), args.set,
                          {"num_samples": args.num_samples, "max_concurrent_trials": args.max_concurrent,
                           "storage_path": args.storage_path})
        print(f"sweep OK: {spec.name}, {spec.num_trials} trial{'s' if spec.num_trials != 1 else ''} over {', '.join(spec.space)}; "
              f"metric {spec.file.metric} ({spec.file.mode}), scheduler {spec.file.scheduler.name}")
        if args.check:
            return 0
    from rayfed_proto.tuning.sweep import run_sweep

    result = run_sweep(spec, resume=args.resume, address=args.address, tracking_uri=args.tracking_uri,
                       best_out=Path(args.best_out) if args.best_out else None, verbose=0 if args.quiet else 1)
    print(f"sweep folder: {result.experiment_path}")
    if result.parent_run_id:
        print(f"MLflow: parent run {result.parent_run_id}; {browse_hint(result.tracking_uri, result.parent_run_id)}")
    if result.interrupted:
        return 130
    return 1 if result.num_errors and result.num_errors == len(result.ranked) else 0


def cmd_compare(args) -> int:
    """Mean ± std over seeds per method (and differing config keys) from MLflow: table, plots, comparison run."""
    from rayfed_proto.tracking.compare import compare, default_out_dir, log_comparison, write_outputs

    comp = compare(args.experiments, tracking_uri=args.tracking_uri, metric=args.metric, mode=args.mode)
    out = Path(args.out) if args.out else default_out_dir()
    files = write_outputs(comp, out)
    print(comp.markdown())
    print(f"\nfiles in {out}: {', '.join(p.name for p in files.values())}")
    if not args.no_log:
        run_id = log_comparison(comp, files, args.experiment_name)
        print(f"MLflow: comparison run {run_id} in experiment {args.experiment_name!r}; "
              f"{browse_hint(comp.tracking_uri, run_id)}")
    return 0


def cmd_reproduce(args) -> int:
    """A paper's table as its authors ran it (``--scale full``) or tiny on a CPU (``--scale small``):
    3 seeds per method, our mean ± std beside the published numbers (docs/reproduce.md)."""
    from rayfed_proto.reproduce import runner

    if args.list:
        print(runner.list_text())
        return 0
    if args.paper is None:
        raise ConfigError([ConfigIssue(key="PAPER", value=None, allowed=", ".join(runner.MAIN_TABLE)
                                       + " (rayfed-proto reproduce --list names every table)")])
    sets = list(args.set) + ([f"tracking.tracking_uri={args.tracking_uri}"] if args.tracking_uri else [])
    plan = runner.make_plan(args.paper, args.table, scale=args.scale, seeds=args.seeds, columns=args.columns,
                            methods=args.methods, overrides=sets)
    print(plan.describe(), flush=True)
    if args.dry_run:
        return 0
    outcome = runner.execute(plan, out_dir=Path(args.out) if args.out else None, experiment_name=args.experiment_name,
                             progress=not args.no_progress)
    print(outcome.markdown)
    print(f"\nfiles: {', '.join(str(p) for p in outcome.files.values())}")
    if outcome.parent_run_id:
        print(f"MLflow: parent run {outcome.parent_run_id} in experiment {outcome.experiment_name!r}; "
              f"{browse_hint(outcome.tracking_uri, outcome.parent_run_id)}")
    if outcome.failures:
        print("error: " + "; ".join(outcome.failures), file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayfed-proto", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run one federated experiment (or one per seed with --seeds)")
    _add_config_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    p.add_argument("--resume", metavar="DIR", help="continue an interrupted run, or seed group, from its output folder "
                                                   "(a run from its latest checkpoint; a group from where it stopped), or "
                                                   "a run from its checkpoint.dir URI (s3://..., file://...: the run folder "
                                                   "is rebuilt from what the store holds, e.g. after ray down)")
    p.add_argument("--seeds", nargs="+", type=int, metavar="SEED",
                   help="run the experiment once per seed (e.g. --seeds 0 1 2): one MLflow parent run with a nested run "
                        "per seed, and a table of each seed's final and best accuracy with their mean and std")
    p.add_argument("--methods", nargs="+", metavar="ALGORITHM",
                   help="run the experiment once per method (algorithm.name), with --seeds once per method and seed, "
                        "all in one MLflow experiment; then: rayfed-proto compare EXPERIMENT")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("validate", help="check a config without starting Ray")
    _add_config_args(p)
    p.add_argument("--show", action="store_true", help="print the resolved config")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("list", help="algorithms, datasets, partitioners and model groups")
    p.add_argument("--options", metavar="ALGORITHM", help="also list one algorithm's options")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("tune", help="a Ray Tune sweep: one whole federated run per trial")
    p.add_argument("sweep", nargs="?", help="sweep YAML (see docs/tuning.md), or a name in ./tune_configs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override an entry of the base experiment config (repeatable)")
    p.add_argument("--resume", metavar="FOLDER", help="continue an interrupted sweep from its folder")
    p.add_argument("--address", help="an existing Ray cluster: auto, or ray://HOST:10001 (default: a local instance)")
    p.add_argument("--tracking-uri", help="MLflow store: http(s)://server, or sqlite:///... served by a local server; "
                                          "with --resume: where the sweep logs from now on (its old server is gone "
                                          "with its cluster)")
    p.add_argument("--num-samples", type=int, help="override the sweep's num_samples")
    p.add_argument("--max-concurrent", type=int, help="override the sweep's max_concurrent_trials")
    p.add_argument("--storage-path", help="override the sweep's storage_path (Tune's folder parent; s3://bucket/prefix on a cluster)")
    p.add_argument("--best-out", metavar="PATH", help="where to write the best config (default: <sweep folder>/best.yaml)")
    p.add_argument("--check", action="store_true", help="validate the sweep file (every trial's config) and exit")
    p.add_argument("--quiet", action="store_true", help="no Tune progress tables")
    p.set_defaults(func=cmd_tune)
    p = sub.add_parser("ui", help="serve the MLflow UI on the runs' store and print (or open) the experiment's runs")
    p.add_argument("--tracking-uri", help="MLflow store: sqlite:///path.db, a folder, or http(s)://server (default: "
                                          "$MLFLOW_TRACKING_URI, else ./mlflow.db, as for run)")
    p.add_argument("--experiment", help="the experiment to open (default: the one with the latest runs)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=5000, help="port to serve on (default 5000)")
    p.add_argument("--open", action="store_true", help="open the link in a browser once the UI answers")
    p.add_argument("--no-serve", action="store_true", help="print the link only (the UI already runs)")
    p.set_defaults(func=cmd_ui)
    p = sub.add_parser("compare", help="compare methods over seeds: mean ± std table, plots and a comparison run from MLflow")
    p.add_argument("experiments", nargs="+", metavar="EXPERIMENT", help="MLflow experiment name(s) whose runs are compared")
    p.add_argument("--tracking-uri", help="MLflow store: sqlite:///path.db, a folder, or http(s)://server "
                                          "(default: $MLFLOW_TRACKING_URI, else ./mlflow.db, as for run)")
    p.add_argument("--metric", default="eval/head_acc",
                   help="the metric compared (default: eval/head_acc), or 'paper': each method's paper metric "
                        "(eval/proto_acc best for FedSA, FedTGP, FedProto; eval/global_acc for FedSC, FedProtoKD...; "
                        "rayfed_proto/tracking/paper_metric.py)")
    p.add_argument("--mode", choices=("max", "min"), default="max", help="best = the highest (max) or lowest (min) value")
    p.add_argument("--out", metavar="DIR", help="folder for the CSV, Markdown and PNG files (default: ./compare-<time>)")
    p.add_argument("--experiment-name", default="rayfed_proto_compare",
                   help="MLflow experiment of the comparison run (default: rayfed_proto_compare)")
    p.add_argument("--no-log", action="store_true", help="write the files only, log no comparison run")
    p.set_defaults(func=cmd_compare)
    _add_reproduce_parser(sub)
    return parser


def _add_reproduce_parser(sub) -> None:
    """``rayfed-proto reproduce PAPER [TABLE]`` (docs/reproduce.md)."""
    p = sub.add_parser("reproduce", help="run a paper's table (3 seeds per method) and set ours beside its numbers")
    p.add_argument("paper", nargs="?", metavar="PAPER", help="fedsa, fedlsa, fedprotokd, fedsc or fedsap (--list)")
    p.add_argument("table", nargs="?", metavar="TABLE", help="the paper's table, e.g. table2 (default: its main table)")
    p.add_argument("--list", action="store_true", help="name every table that can be reproduced, and exit")
    p.add_argument("--scale", choices=("small", "full"), default="small",
                   help="small: minutes on a CPU, embedded stand-in data (NOT the paper's experiment; default); "
                        "full: the paper's data, clients and rounds (a GPU cluster)")
    p.add_argument("--columns", nargs="+", metavar="COLUMN", help="the table's columns to run (default: small: the "
                   "main one; full: every column this platform can build)")
    p.add_argument("--methods", nargs="+", metavar="ALGORITHM", help="the table's methods to run (default: all)")
    p.add_argument("--seeds", nargs="+", type=int, metavar="SEED", help="seeds per method (default: 0 1 2)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config entry of every run, e.g. --set tracking.output_dir=runs (repeatable)")
    p.add_argument("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, else ./mlflow.db, as for run)")
    p.add_argument("--experiment-name", help="MLflow experiment of the runs (default: reproduce_<paper>)")
    p.add_argument("--out", metavar="DIR", help="folder for reproduce.csv and reproduce.md "
                                                "(default: ./reproduce-<paper>-<table>-<scale>-<time>)")
    p.add_argument("--dry-run", action="store_true", help="print the runs (presets and overrides) and exit: no Ray")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    p.set_defaults(func=cmd_reproduce)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from rayfed_proto.data.datasets import DatasetNotFoundError
    from rayfed_proto.registry import UnknownNameError
    from rayfed_proto.runtime.progress import NoProgressError
    from rayfed_proto.runtime.runfolder import RunFault

    try:
        code = args.func(args)
        sys.stdout.flush()  # inside the try: a reader that went away is seen here, not at exit
        return code
    except BrokenPipeError:  # the reader went away (rayfed-proto list | head): stop quietly, as a shell tool does
        return _reader_gone()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (InputError, DatasetNotFoundError, UnknownNameError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (NoProgressError, RunFault) as e:  # a fault during the run, not bad input: exit 1, with the reason
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        from rayfed_proto.runtime.signals import RunInterrupted

        if isinstance(e, RunInterrupted):  # drained and checkpointed: say how to resume
            print(f"\n{e}", file=sys.stderr)
            return 143 if e.signal_name == "SIGTERM" else 130
        print("interrupted", file=sys.stderr)
        return 130


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a tool whose reader closed the pipe


def _reader_gone() -> int:
    """stdout's reader closed the pipe: no traceback, and none at exit when Python flushes stdout
    (pointed at /dev/null; the Python docs' recipe for SIGPIPE)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout: nothing left to flush
        pass
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
