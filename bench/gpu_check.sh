#!/usr/bin/env bash
# The GPU checks in one command, for a lent GPU machine that has PyTorch but neither Ray, pydantic
# nor MLflow, and no network: the wheels travel in a git-ignored .whl/ folder (cp312 builds; ray
# trimmed of its Java jars, RLlib, Serve, LLM and the dashboard's web build to fit the 64 MiB a
# call may carry). From the repo root, with .whl carried:
#
#     bash bench/gpu_check.sh
#
# Steps, each under its own `timeout` and all under one overall budget (GPU_CHECK_BUDGET_S, default
# 530 s, under 9 minutes; a step that would start with less than 20 s left is skipped), each going
# on after the previous one failed, the newest questions first:
#   env         nvidia-smi, Python / torch / ray versions, CUDA visible to torch
#   smoke       Ray with 1 GPU: four actors on 0.25 GPU shares and one on none, each says what
#               CUDA_VISIBLE_DEVICES and torch see and multiplies two matrices on its device
#   lanes_htfe1, lanes_htfe8
#               bench/batched_clients.py --device cuda --lanes 8 --trailing-batch drop (issue 46):
#               FedProto, Dirichlet 0.1, 20 HtFE1 clients (target >= 10x the loop) and 100 HtFE8
#               clients (12-13 per architecture, target >= 3x): the sequential loop, today's
#               batched group (`on`) and 8 lanes (`lanes`) in one run each; lanes_htfe*.json.
#               Alone in one call (under 8 minutes):  STEPS="env lanes_htfe1 lanes_htfe8" bash bench/gpu_check.sh
#   layouts     the GPU test that both layouts agree (issue 36 item 2: `pytest -m gpu` on
#               tests/integration/test_gpu_layouts.py; said and skipped where the file is absent)
#   batched_htfe1, batched_htfe8
#               bench/batched_clients.py --device cuda: 20 clients of HtFE1 (target >= 10x) and of
#               HtFE8 (target >= 5x) stepping as one batched model against the sequential
#               single-process loop on the same GPU, with each mode's peak GPU memory against a
#               1/4 share (issue 36 item 4)
#   tests       the unit tests about resource plans, GPU shares and device choice
#   default     the default experiment (`rayfed-proto run`, FedTGP on digits, async), 2 server
#               versions, one actor per client on a 1/21 GPU share, evaluated every version
#   gpu_share   bench/gpu_share.py: 20 HtFE8 clients, actor per client vs packed vs a plain loop
#   round_time  bench/round_time.py --device cuda, FedProto and FedAvg
# MLflow is absent there, so every run goes with tracking.enabled=false (the bench scripts switch
# it off themselves when `mlflow` cannot be imported). Everything lands in $OUT (the device tool
# sets it; default /tmp/gpu_check_out): log.txt (the whole output), nvsmi.csv (GPU utilisation and
# memory every 2 s), layouts.txt, batched_htfe1.json, batched_htfe8.json, gpu_share.json/.md,
# round_time.json/.md, default_run.tgz.
#
# Knobs (environment): STEPS (default "env smoke lanes_htfe1 lanes_htfe8 layouts batched_htfe1
# batched_htfe8 tests default gpu_share round_time"), LANES_HTFE1_ARGS, LANES_HTFE8_ARGS,
# GPU_CHECK_BUDGET_S, PYTHON (python3), WHL (.whl), SITE (/tmp/site), GPU_CHECK_PREPEND (a path put
# before $SITE on PYTHONPATH: local validation only), GPU_CHECK_RAY_STOP (1: `ray stop --force`
# after each step, which ends EVERY Ray process of the machine, so a step that timed out leaves no
# actors holding the GPU; default 1 when OUT comes from the environment, as on the device tool's
# machine, else 0), GPU_SHARE_ARGS, ROUND_TIME_ARGS, BATCHED_ARGS (bench/batched_clients.py's,
# both groups). Dry run on a CPU machine (the GPU steps then say there is no GPU and stop):
#     GPU_CHECK_RAY_STOP=0 STEPS="layouts batched_htfe1" BATCHED_ARGS="--samples 800 --clients 4 --rounds 1" \
#       bash bench/gpu_check.sh          (never let a dry run on a shared machine stop its Ray processes)
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 PYTHONDONTWRITEBYTECODE=1
RAY_STOP=${GPU_CHECK_RAY_STOP:-$([ -n "${OUT:-}" ] && echo 1 || echo 0)}
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
PY=${PYTHON:-python3}
WHL=${WHL:-.whl}
SITE=${SITE:-/tmp/site}
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
BUDGET_S=${GPU_CHECK_BUDGET_S:-530}
STEPS=${STEPS:-env smoke lanes_htfe1 lanes_htfe8 layouts batched_htfe1 batched_htfe8 tests default gpu_share round_time}
GPU_SHARE_ARGS=${GPU_SHARE_ARGS:---rounds 3 --samples 10000}
ROUND_TIME_ARGS=${ROUND_TIME_ARGS:---rounds 4 --samples 20000}
BATCHED_ARGS=${BATCHED_ARGS:---rounds 2 --samples 6000}
LANES_HTFE1_ARGS=${LANES_HTFE1_ARGS:---clients 20 --rounds 2 --samples 6000}
LANES_HTFE8_ARGS=${LANES_HTFE8_ARGS:---clients 100 --rounds 1 --samples 20000}
RESULTS=""

echo "gpu_check: $(date -u +%FT%TZ) on $(hostname), budget ${BUDGET_S}s, steps: $STEPS"
if [ -d "$WHL" ] && ls "$WHL"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl \
    || { echo "gpu_check: installing the wheels from $WHL failed"; exit 1; }
  echo "gpu_check: wheels installed into $SITE in $(( $(date +%s) - T0 )) s: $(ls "$WHL" | tr '\n' ' ')"
else
  echo "gpu_check: no wheels in $WHL; using what $PY has"
fi
export PYTHONPATH=${GPU_CHECK_PREPEND:+$GPU_CHECK_PREPEND:}$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}

SMI_PID=""
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,memory.total --format=csv -l 2 >"$OUT/nvsmi.csv" 2>&1 &
  SMI_PID=$!
fi

ray_stop() {
  [ "$RAY_STOP" = 1 ] || return 0
  timeout -k 5 30 "$PY" -c "import sys; sys.argv = ['ray', 'stop', '--force']; from ray.scripts.scripts import main; main()" \
    >/dev/null 2>&1 || true
}

step() {  # step NAME CAP_S COMMAND...: runs COMMAND under min(CAP_S, what the budget has left)
  local name=$1 cap=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local left=$(( BUDGET_S - ($(date +%s) - T0) - 5 ))
  local t=$(( cap < left ? cap : left ))
  if [ "$t" -lt 20 ]; then
    echo "=== $name: SKIPPED, ${left}s of the budget left"
    RESULTS+="$name: skipped (budget)"$'\n'
    return 0
  fi
  echo "=== $name: start $(date +%T), timeout ${t}s"
  local s=$(date +%s)
  if declare -F "$1" >/dev/null; then  # a function of this file: in a child bash, which timeout can end
    timeout -k 10 "$t" bash -c "$1"
  else
    timeout -k 10 "$t" "$@"
  fi
  local rc=$?
  local took=$(( $(date +%s) - s ))
  local what="rc=$rc"
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && what="TIMED OUT at ${t}s (rc=$rc)"
  echo "=== $name: $what, ${took}s"
  RESULTS+="$name: $what, ${took}s"$'\n'
  ray_stop
}

env_info() {
  nvidia-smi || echo "(no nvidia-smi)"
  "$PY" - <<'EOF'
import importlib, sys, time
t = time.time()
print("python", sys.version.split()[0], sys.executable)
for m in ["torch", "torchvision", "ray", "pydantic", "pydantic_core", "numpy", "pandas", "pyarrow", "google.protobuf",
          "sklearn", "matplotlib", "yaml", "grpc", "aiohttp", "jsonschema", "typing_extensions", "mlflow"]:
    try:
        mod = importlib.import_module(m)
        print(f"  {m:18s} {getattr(mod, '__version__', '?'):14s} {getattr(mod, '__file__', '')}")
    except Exception as e:
        print(f"  {m:18s} NOT IMPORTABLE ({type(e).__name__}: {e})")
import torch
print("torch.cuda.is_available:", torch.cuda.is_available(), "| devices:", torch.cuda.device_count(),
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-", "| cuda", torch.version.cuda)
import rayfed_proto.cli  # noqa: F401  the package imports with what is there
print(f"imports took {time.time() - t:.1f} s")
EOF
}

smoke() {
  "$PY" - <<'EOF'
import os, time
import ray
t = time.time()
ray.init(num_gpus=1, include_dashboard=False)
print(f"ray.init {time.time() - t:.1f} s; cluster resources: {ray.cluster_resources()}")

@ray.remote
class Probe:
    def info(self):
        import torch
        dev = torch.device("cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu")
        x = torch.randn(1024, 1024, device=dev)
        s = float((x @ x).sum().item())
        return {"gpu_ids": ray.get_gpu_ids(), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "cuda_available": torch.cuda.is_available(), "device": str(dev), "finite": s == s,
                "mem_mib": round(torch.cuda.memory_allocated() / 2**20, 1) if dev.type == "cuda" else None}

t = time.time()
actors = [Probe.options(num_gpus=0.25, num_cpus=0.1).remote() for _ in range(4)]
actors.append(Probe.options(num_gpus=0, num_cpus=0.1).remote())
for i, info in enumerate(ray.get([a.info.remote() for a in actors], timeout=60)):
    print(f"  actor {i} ({'0.25 GPU' if i < 4 else 'no GPU'}): {info}")
print(f"5 actors up and answered in {time.time() - t:.1f} s")
ray.shutdown()
EOF
}

unit_tests() {
  # the slowest of test_lean_runtime (a local update of every method, counting reads) says nothing about a GPU
  "$PY" -m pytest -p no:cacheprovider -q -o addopts="" --timeout 60 \
    tests/unit/test_resources.py tests/unit/test_resources_per_node.py tests/unit/test_client_runner.py \
    tests/unit/test_lean_runtime.py -k "not reads_at_most_one_value_per_step"
}

default_run() {
  (cd "$WORK" && "$PY" -m rayfed_proto.cli run --no-progress --set tracking.enabled=false \
     --set resources.clients_per_actor=1 --set resources.num_gpus=1 --set federation.rounds=2 \
     --set federation.eval_every=1 --set "tracking.output_dir=$WORK/runs")
  local rc=$?
  (cd "$WORK" && tar czf "$OUT/default_run.tgz" --exclude='*.png' --exclude=checkpoints --exclude='*.npz' runs 2>/dev/null)
  return $rc
}

layouts_test() {
  local f=tests/integration/test_gpu_layouts.py
  if [ ! -f "$f" ]; then
    echo "layouts: $f is not in this tree; nothing run" | tee "$OUT/layouts.txt"
    return 0
  fi
  "$PY" -m pytest -p no:cacheprovider -q -o addopts="" -m gpu -rs "$f" 2>&1 | tee "$OUT/layouts.txt"
  return "${PIPESTATUS[0]}"
}

export PY OUT WORK BATCHED_ARGS
export -f env_info smoke unit_tests default_run layouts_test
step env 60 env_info
step smoke 90 smoke
# shellcheck disable=SC2086
step lanes_htfe1 150 "$PY" bench/batched_clients.py --device cuda --group HtFE1 --lanes 8 --trailing-batch drop \
  --actors 4 $LANES_HTFE1_ARGS --out "$OUT/lanes_htfe1"
# shellcheck disable=SC2086
step lanes_htfe8 300 "$PY" bench/batched_clients.py --device cuda --group HtFE8 --lanes 8 --trailing-batch drop \
  --actors 4 $LANES_HTFE8_ARGS --out "$OUT/lanes_htfe8"
step layouts 240 layouts_test
# shellcheck disable=SC2086
step batched_htfe1 90 "$PY" bench/batched_clients.py --device cuda --group HtFE1 --actors 4 $BATCHED_ARGS \
  --out "$OUT/batched_htfe1"
# shellcheck disable=SC2086
step batched_htfe8 150 "$PY" bench/batched_clients.py --device cuda --group HtFE8 --actors 4 $BATCHED_ARGS \
  --out "$OUT/batched_htfe8"
step tests 90 unit_tests
step default 100 default_run
# shellcheck disable=SC2086
step gpu_share 220 "$PY" bench/gpu_share.py $GPU_SHARE_ARGS --out "$OUT/gpu_share"
# shellcheck disable=SC2086
step round_time 200 "$PY" bench/round_time.py --device cuda $ROUND_TIME_ARGS --out "$OUT/round_time"

if [ -n "$SMI_PID" ]; then kill "$SMI_PID" 2>/dev/null; fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=memory.used --format=csv
rm -rf "$WORK"
echo "=== gpu_check done in $(( $(date +%s) - T0 )) s:"
printf '%s' "$RESULTS"
ls -la "$OUT"
