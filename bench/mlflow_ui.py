"""Screenshots of the MLflow UI as a person browses a finished run: run overview, model metrics,
system metrics, the sweep's parent run and its child runs, a seed group and a comparison, in headless Chromium.

The checks of *content* are tests (tests/integration/test_mlflow_content.py, through MlflowClient);
this script is for what a person sees. It serves the store with ``mlflow ui`` on 127.0.0.1 (a free
port, stopped at the end) and renders each page with Debian's ``chromium`` package
(``apt-get install -y chromium``; any Chromium or Chrome on PATH works, or pass --chromium).

    python bench/mlflow_ui.py --demo --out docs/img/mlflow      # a 4-client run, a 2-trial sweep, 2 methods x 2 seeds
    python bench/mlflow_ui.py --tracking-uri sqlite:///mlflow.db --run-id RUN [--parent-run-id SWEEP] --out shots

``--demo`` writes its store under a temporary folder (or --workdir) so it never touches ./mlflow.db.

The UI is a single-page app that draws after its API calls return and loads its charts lazily, so
a plain ``chromium --screenshot`` catches spinners. With Playwright installed (``pip install
playwright``; it drives the system Chromium, no browser download) each page is opened by the
link ``rayfed-proto ui`` prints (``?workflowType=machine_learning``: the "Model training" view),
a chart filter is typed where asked, and the screenshot is taken ``--wait`` seconds after the
page's tabs appear. Pop-ups are kept out of the pictures: MLflow 3.17 opens its Assistant side
panel on a browser's first visit to a local server (local storage
``mlflow.assistant.fab.autoOpenedOnFirstLoad_v1``), and a fresh browser context is a first visit;
so every page starts with the UI's "already shown / dismissed" keys set (Assistant, Detect
Issues and Flag for Review guidance, the model-registry promotion, the MySQL banner), and
anything marked ``data-assistant-ui`` (the panel, its floating button) is hidden by a style
sheet. The workflow type is *not* stored: the view comes from the link alone, as a user gets it.
Without Playwright the script falls back to ``chromium --headless --screenshot`` with a
virtual-time budget (charts may still be loading; the Assistant panel may be open).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                  "--disable-dev-shm-usage"]

# MLflow 3.17's local-storage flags (``<key>_v<version>``, JSON values) that say a pop-up was already
# shown or dismissed; set before the app's own scripts run, on every page
DISMISSED = {"mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": True, "mlflow.assistant.panelOpen_v1": False,
             "mlflow.detectIssues.guidanceShown_v1": True, "mlflow.flagForReview.guidanceShown_v1": True,
             "_mlflow_model_registry_promo_modal_dismissed_v1": True, "mlflow.overview.mysqlBannerDismissed_v0": True}
# the run list's "+" before a parent run (runs/cells/RunNameCellRenderer.tsx): shows its child runs
EXPAND_RUNS = 'button[data-component-id*="runnamecellrenderer"]'
# the Assistant's side panel and floating button, should either appear anyway
HIDE_CSS = '[data-assistant-ui="true"] { display: none !important; }'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_chromium(given: str | None) -> str:
    for name in ([given] if given else []) + ["chromium", "chromium-browser", "google-chrome", "chrome"]:
        path = shutil.which(name) if name else None
        if path:
            return path
    sys.exit("no Chromium found: install it (Debian/Ubuntu: apt-get install -y chromium) or pass --chromium PATH")


class MlflowUi:
    """``mlflow ui`` on 127.0.0.1 over a store, as a context manager."""

    def __init__(self, store_uri: str, workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
        self.log = open(workdir / "mlflow_ui.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store_uri,
                                      "--host", "127.0.0.1", "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                     start_new_session=True)

    def __enter__(self):
        deadline = time.monotonic() + 600  # a loaded machine: MLflow 3.17 starts its job runner first
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow ui exited ({self.proc.returncode}); see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise TimeoutError("mlflow ui did not answer within 600 s")

    def __exit__(self, *exc):
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the server and its workers
            self.proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def new_page(browser, width: int, height: int):
    """A page in a fresh browser context whose local storage already says every pop-up was seen."""
    import json

    page = browser.new_page(viewport={"width": width, "height": height})
    flags = json.dumps({k: json.dumps(v) for k, v in DISMISSED.items()})
    page.add_init_script("(() => { try { const kv = " + flags + ";"
                         " for (const k in kv) window.localStorage.setItem(k, kv[k]); } catch (e) {} })();")
    return page


def hide_popups(page) -> None:
    """Hide the Assistant (style sheet; survives re-renders) and close whatever dialog is open."""
    try:
        page.add_style_tag(content=HIDE_CSS)
    except Exception:
        pass
    try:
        if page.get_by_role("dialog").count():
            page.keyboard.press("Escape")
    except Exception:
        pass


def settle(page, timeout_ms: int = 60_000) -> None:
    """Until the page's API calls are done (a filter typed, rows expanded)."""
    try:
        page.wait_for_load_state("networkidle", timeout=timeout_ms)
    except Exception:
        pass


def widen_run_names(page, extra_px: int = 160) -> None:
    """A runs list's "Run Name" column, wider by ``extra_px`` (its edge dragged in small steps, as the
    grid follows a hand): its default width cuts names such as ``seed=0 fedproto digits`` short.
    Nothing on pages without that column."""
    edge = page.locator('.ag-header-cell[col-id="attributes.`Run Name`"] .ag-header-cell-resize')
    try:
        if not edge.count():
            return
        edge.first.hover(timeout=10_000)
        box = edge.first.bounding_box()
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        page.mouse.down()
        for dx in range(10, extra_px + 1, 10):
            page.mouse.move(x + dx, y)
            time.sleep(0.05)
        page.mouse.up()
    except Exception:
        pass
    finally:
        page.mouse.move(page.viewport_size["width"] - 3, 3, steps=10)  # off the headers: no tooltip left open


def screenshot_playwright(browser, url: str, out: Path, width: int, height: int, wait_s: float,
                          search: str | None = None, click: str | None = None, expect: str | None = None) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    page = new_page(browser, width, height)
    try:
        page.goto(url, timeout=180_000)
        hide_popups(page)
        try:  # a run page is drawn once its tabs are; a runs or models list once its table is
            page.locator('[role="tab"], [role="grid"], [role="table"], table').first.wait_for(timeout=90_000)
        except Exception:
            pass
        if search:
            box = page.get_by_placeholder(re.compile("search", re.I))
            box = box.first if box.count() else page.locator("input[placeholder]").first  # the run list filter
            box.fill(search)
            box.press("Enter")
            settle(page)
        if click:  # every element `click` selects, in order: e.g. each parent run's "+" (EXPAND_RUNS)
            target = page.locator(click)
            try:
                target.first.wait_for(timeout=60_000)
                for i in range(target.count()):  # child rows come after their parent and have no "+" of their own
                    target.nth(i).click(timeout=30_000)
                settle(page)
            except Exception:
                print(f"  ({click!r} not found or not clickable on {url})")
        if expect:  # e.g. the first child run's name: the expanded rows are drawn
            try:
                page.get_by_text(re.compile(expect)).first.wait_for(timeout=120_000)
            except Exception:
                print(f"  ({expect!r} not drawn on {url})")
        widen_run_names(page)
        time.sleep(wait_s)  # API calls and lazily drawn charts
        hide_popups(page)
        try:  # no focus ring or hover highlight left on what was typed into or clicked
            page.evaluate("() => document.activeElement && document.activeElement.blur()")
            page.mouse.move(page.viewport_size["width"] - 3, 3, steps=10)
        except Exception:
            pass
        if "workflowType=machine_learning" not in page.url:
            print(f"  (the page left the model-training link: {page.url})")
        if page.get_by_text("MLflow Assistant").first.is_visible():
            print(f"  (the MLflow Assistant is still visible on {url})")
        page.screenshot(path=str(out), timeout=300_000)  # a page of charts on a loaded machine: minutes
    finally:
        page.close()
    print(f"{out}  <-  {url}" + (f" (filter {search!r})" if search else ""))
    return out


def screenshot(chromium: str, url: str, out: Path, width: int, height: int, wait_s: float, profile: Path) -> Path:
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(profile, ignore_errors=True)  # a fresh profile per page: no state carried over
    cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
           f"--virtual-time-budget={int(wait_s * 1000)}", f"--screenshot={out}", url]
    subprocess.run(cmd, capture_output=True, timeout=wait_s + 120, check=False)
    if not out.is_file():
        raise RuntimeError(f"chromium wrote no screenshot for {url}")
    print(f"{out}  <-  {url}")
    return out


def demo(workdir: Path) -> tuple[str, str, str, str | None, str | None]:
    """In ``workdir``: a small finished run and a 2-trial sweep (experiment ``mlflow_ui_demo``), and two
    methods x two seeds with their comparison (experiment ``mlflow_ui_seeds``): (store uri, run id, sweep
    parent run id, a seed group's parent run id, the comparison run id)."""
    import ray

    from rayfed_proto.config import build_config
    from rayfed_proto.runtime.driver import run_experiment
    from rayfed_proto.runtime.seeds import run_seeds
    from rayfed_proto.tracking.compare import compare, log_comparison, write_outputs
    from rayfed_proto.tuning.spec import parse_sweep
    from rayfed_proto.tuning.sweep import run_sweep

    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    base = {"data": {"name": "digits", "partition": {"name": "dirichlet", "beta": 0.5, "min_samples": 20}},
            "model": {"group": "small_hetero", "feature_dim": 32}, "algorithm": {"name": "fedproto"},
            "federation": {"mode": "sync", "num_clients": 4, "rounds": 6, "eval_every": 1},
            "tracking": {"experiment_name": "mlflow_ui_demo", "tracking_uri": uri, "output_dir": str(workdir / "runs"),
                         "system_metrics_interval_s": 1.0, "run_name": "fedproto-digits-4-clients"}}
    # the experiments, made first with their artifacts under workdir: else a sqlite store puts them in
    # ./mlruns of whichever process makes the experiment (the caller's folder, a Tune trial's)
    from mlflow.tracking import MlflowClient

    from rayfed_proto.tracking.compare import DEFAULT_EXPERIMENT_NAME

    client = MlflowClient(uri)
    for name in ("mlflow_ui_demo", "mlflow_ui_seeds", DEFAULT_EXPERIMENT_NAME):
        if client.get_experiment_by_name(name) is None:
            client.create_experiment(name, artifact_location=(workdir / "mlartifacts" / name).as_uri())
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        result = run_experiment(build_config(base), progress=False, echo=print)
        sweep_base = {**base, "federation": {**base["federation"], "rounds": 3},
                      "tracking": {k: v for k, v in base["tracking"].items() if k != "run_name"}}
        spec = parse_sweep({"name": "fedproto_lam", "base": sweep_base, "metric": "eval/head_acc", "mode": "max",
                            "search_space": {"algorithm.lam": {"grid": [0.1, 1.0]}}, "max_concurrent_trials": 1,
                            "trial_resources": {"driver_cpus": 0.25, "server_cpus": 0.25, "client_cpus": 0.25,
                                                "client_actors": 2},
                            "storage_path": str(workdir / "tune")}, "demo.yaml", workdir)
        sweep = run_sweep(spec, verbose=0, echo=print)
        seeds_parent, comparison = None, None
        seeds_base = {**sweep_base, "tracking": {**sweep_base["tracking"], "experiment_name": "mlflow_ui_seeds",
                                                 "log_models": "none"}}
        for method in ("fedproto", "fedsa"):
            group = run_seeds(build_config({**seeds_base, "algorithm": {"name": method}}), [0, 1], progress=False,
                              echo=print, method_first=True)
            seeds_parent = seeds_parent or group.parent_run_id
        comp = compare(["mlflow_ui_seeds"], tracking_uri=uri)
        comparison = log_comparison(comp, write_outputs(comp, workdir / "compare"))
    finally:
        ray.shutdown()
    return uri, result.run_id, sweep.parent_run_id, seeds_parent, comparison


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", action="store_true", help="first log a small run and a 2-trial sweep (digits, CPU)")
    p.add_argument("--tracking-uri", help="the store of an existing run (sqlite:///...)")
    p.add_argument("--run-id", help="the run to show")
    p.add_argument("--parent-run-id", help="a sweep's parent run to show (optional)")
    p.add_argument("--seeds-run-id", help="a seed group's parent run to show (optional)")
    p.add_argument("--comparison-run-id", help="a comparison run (rayfed-proto compare) to show (optional)")
    p.add_argument("--out", default="bench/results/mlflow_ui", help="folder for the PNGs")
    p.add_argument("--workdir", help="--demo: where the store and runs go (default: a temporary folder)")
    p.add_argument("--chromium", help="the browser binary (default: chromium on PATH)")
    p.add_argument("--only", nargs="+", help="render only these pages (run_overview, sweep_runs...)")
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--height", type=int, default=1300)
    p.add_argument("--wait", type=float, default=12.0,
                   help="seconds to wait after a page appears (without Playwright: seconds of virtual page time)")
    args = p.parse_args()

    chromium = find_chromium(args.chromium)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rayfed_mlflow_ui_")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    seeds_id = comparison_id = None
    if args.demo:
        uri, run_id, parent_id, seeds_id, comparison_id = demo(workdir)
    else:
        if not (args.tracking_uri and args.run_id):
            p.error("give --demo, or --tracking-uri and --run-id")
        uri, run_id, parent_id = args.tracking_uri, args.run_id, args.parent_run_id
        seeds_id, comparison_id = args.seeds_run_id, args.comparison_run_id

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_run(run_id).info.experiment_id
    out = Path(args.out)
    # every page by the link `rayfed-proto ui` and the end of a run print (tracking/links.py): the model-training
    # view, `?workflowType=machine_learning`; a run's tab or artifact is its path before that query
    from rayfed_proto.tracking.links import ML_VIEW, compare_url, experiment_url, run_url

    def run_link(experiment: str, run: str, tab: str = "") -> str:
        return run_url("", experiment, run).replace("?", f"{tab}?", 1).lstrip("/")

    def runs_link(experiment: str) -> str:
        return experiment_url("", experiment).lstrip("/")

    def first_child(experiment: str, parent: str) -> str | None:  # its name, drawn once the rows are expanded
        runs = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'", max_results=1)
        return f"^{re.escape(runs[0].info.run_name)}$" if runs else None

    # (name, route, height, chart/run filter to type, elements to click, text to wait for)
    pages = [("experiment_runs", runs_link(exp), args.height - 400, None, None, None),
             ("run_overview", run_link(exp, run_id), args.height + 900, None, None, None),
             ("run_model_metrics_opened", run_link(exp, run_id, "/model-metrics"), args.height + 300, None, None, None),
             ("run_model_metrics", run_link(exp, run_id, "/model-metrics"), args.height + 300, "eval/", None, None),
             ("run_client_heatmap", run_link(exp, run_id, "/artifacts/plots/client_head_acc_heatmap.png"),
              args.height - 300, None, None, None),
             ("run_system_metrics", run_link(exp, run_id, "/system-metrics"), args.height, None, None, None),
             ("experiment_models", f"#/experiments/{exp}/models?{ML_VIEW}", args.height - 400, None, None, None)]
    if parent_id:
        pexp = client.get_run(parent_id).info.experiment_id
        pages += [("sweep_parent_run", run_link(pexp, parent_id), args.height, None, None, None),
                  ("sweep_runs", runs_link(pexp), args.height - 400,  # trial names end <sweep>-<id>
                   f"attributes.run_name LIKE '%{client.get_run(parent_id).info.run_name}-%'", EXPAND_RUNS,
                   first_child(pexp, parent_id))]
    if seeds_id:
        sexp = client.get_run(seeds_id).info.experiment_id
        pages += [("seeds_runs", runs_link(sexp), args.height - 400, None, EXPAND_RUNS, first_child(sexp, seeds_id)),
                  ("seeds_parent_metrics", run_link(sexp, seeds_id, "/model-metrics"), args.height, None, None, None)]
    if comparison_id:
        cexp = client.get_run(comparison_id).info.experiment_id
        children = [r.info.run_id for r in client.search_runs([cexp], f"tags.mlflow.parentRunId = '{comparison_id}'")]
        pages += [("compare_run_metrics", run_link(cexp, comparison_id, "/model-metrics"), args.height, None, None,
                   None),
                  # the methods in one chart: MLflow's Compare page of the comparison's group runs (the link its
                  # description gives)
                  ("compare_methods_page", compare_url("", cexp, children).lstrip("/"), args.height + 600, None, None,
                   None)]
    if args.only:
        pages = [pg for pg in pages if pg[0] in args.only]
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
        print("playwright not installed: plain chromium --screenshot (charts may still be loading)")
    with MlflowUi(uri, workdir) as ui:
        if sync_playwright is None:
            for name, route, height, *_ in pages:
                screenshot(chromium, f"{ui.url}/{route}", out / f"{name}.png", args.width, height, args.wait,
                           workdir / "chromium-profile")
            return 0
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS[1:])  # headless by default
            try:
                for name, route, height, search, click, expect in pages:
                    screenshot_playwright(browser, f"{ui.url}/{route}", out / f"{name}.png", args.width, height,
                                          args.wait, search, click, expect)
            finally:
                browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
