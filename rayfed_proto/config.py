"""One typed experiment config: YAML in, validated object out, every error naming the key.

The same object drives a single run, a Tune trial and a cluster job. Validation happens in
two layers, both before Ray starts:

* field types, ranges and allowed literals (pydantic, ``extra="forbid"`` so a typo is an error);
* cross-field rules and registry lookups (unknown algorithm, buffer larger than concurrency,
  heterogeneous models with an algorithm that averages weights, ...).

Every problem becomes a :class:`ConfigIssue` (key, value, what is allowed) and all of them are
raised together as one :class:`ConfigError`, which the CLI turns into exit code 2.

This module imports nothing of ``rayfed_proto.data`` or ``rayfed_proto.system``: the rules that need
their registries or files are registered by them with :func:`register_check`, and importing the
package (``rayfed_proto/__init__.py``, which runs before any ``rayfed_proto.*`` module) registers
them, so every caller of :func:`build_config` gets them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rayfed_proto.numbers import STRICT_NUMBER, StrictNumbers
from rayfed_proto.runtime.policies import POLICIES

Auto = Literal["auto"]


class ConfigIssue(BaseModel):
    key: str
    value: Any = None
    allowed: str

    def __str__(self) -> str:
        return f"{self.key} = {self.value!r}: {self.allowed}"


class ConfigError(ValueError):
    """One or more invalid config entries; ``issues`` lists them."""

    def __init__(self, issues: list[ConfigIssue], source: str | None = None):
        self.issues = issues
        self.source = source
        head = f"invalid config{f' {source}' if source else ''}"
        super().__init__(head + ":\n" + "\n".join(f"  - {i}" for i in issues))


class InputError(ValueError):
    """Bad input found before training (dataset, partition, resources, output folder)."""


class _Section(StrictNumbers):  # numbers: no booleans, no infinity or NaN (rayfed_proto.numbers)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# --------------------------------------------------------------------------- sections


# FedProto's test shots per class and dataset (yuetan031/fedproto lib/sampling.py, the *_noniid_lt
# samplers, as issue 35 reports them; that file is not readable here, so no line is given);
# every other dataset: 15, FedProto's --test_shots default
KSHOT_TEST_SHOTS = {"mnist": 40, "cifar10": 15, "femnist": 15, "cifar100": 5}
KSHOT_TEST_SHOTS_DEFAULT = 15


def kshot_test_shots(dataset_name: str) -> int:
    """FedProto's n-way k-shot test samples per class for ``dataset_name`` (15 for others)."""
    return KSHOT_TEST_SHOTS.get(dataset_name, KSHOT_TEST_SHOTS_DEFAULT)


class PartitionConfig(_Section):
    """How the dataset is split over clients (see rayfed_proto.data.partition)."""

    name: str = "dirichlet"
    beta: float = Field(0.1, gt=0, description="Dirichlet concentration; smaller = more skew")
    min_samples: int = Field(10, ge=1, description="Dirichlet: resample until every client has this many")
    classes_per_client: int = Field(2, ge=1, description="pathological: k classes per client")
    n_way: int = Field(5, ge=1, description="n-way k-shot: classes per client (the mean with n_way_std)")
    n_way_std: int = Field(
        0, ge=0, description="n-way k-shot: per client n drawn uniformly from [max(2, n_way - n_way_std), "
        "min(C - 1, n_way + n_way_std)] (FedProto's --stdev, exps/federated_main.py n_list); 0: n_way for every client")
    n_way_distribution: Literal["uniform", "normal"] = Field(
        "uniform", description="n-way k-shot: per client n uniform as n_way_std says (FedProto's n_list, default) or "
        "round(N(n_way, n_way_std)) clipped to [1, C] (FedSAP appendix Table 5)")
    k_shot: int = Field(20, ge=1, description="n-way k-shot: labelled training samples per class per client")
    k_shot_std: float = Field(0.0, ge=0, description="n-way k-shot: spread of k across clients (see k_shot_distribution)")
    k_shot_distribution: Literal["uniform", "normal"] = Field(
        "uniform", description="n-way k-shot: per client k uniform in [k_shot - k_shot_std, k_shot + k_shot_std] "
        "(FedProto's k_list, default) or round(N(k_shot, k_shot_std)) (at least 1)")
    test_shots: Optional[int] = Field(
        None, ge=1, description="n-way k-shot: test samples per class of each client's classes, none of them a training "
        "sample; None: FedProto's value for data.name (mnist 40, cifar10 and femnist 15, cifar100 5, others 15)")
    clients_per_domain: Optional[list[int]] = Field(
        None, description="by_domain: clients given to each domain, in the dataset's domain order (None: spread evenly)")
    within_domain: str = Field("iid", description="by_domain: partitioner used inside each domain (label skew composes)")
    unlabelled_per_client: int = Field(
        0, ge=0, description="size |U| of each client's separate unlabelled pool: samples of its classes that no client "
        "holds, labels hidden (FedSAP's semi-supervised regime, Table 3: 600); 0: none")
    percent: Optional[dict[str, float]] = Field(
        None, description="by_domain: per domain name, the percentage in (0, 100] of the domain's samples each of its "
        "clients gets, a random subset drawn with the partition seed, the rest unused (FPL's protocol, which FedLSA "
        "follows: WenkeHuang/RethinkFL datasets/digits.py percent_dict, 1 % of each Digits domain per client); a "
        "domain not named: its clients share all of it; None: off")

    @field_validator("percent")
    @classmethod
    def _percent_range(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        bad = {k: x for k, x in (v or {}).items() if not 0 < x <= 100}
        if bad:
            raise ValueError(f"percentages in (0, 100] (a percentage: 1 is 1 %, FPL's 0.01); out of range: {bad}")
        return v


class HFDataConfig(_Section):
    """``data.name: hf``: a Hugging Face ``datasets`` dataset (see rayfed_proto.data.datasets.load_hf)."""

    hub_name: Optional[str] = Field(
        None, description="a dataset on the Hugging Face Hub, fetched with datasets.load_dataset into "
        "<data.root>/huggingface (needs data.download: true); None: data.path, a folder written by save_to_disk")
    image_column: str = Field("image", min_length=1, description="column of the images: an Image feature or numeric arrays")
    label_column: str = Field("label", min_length=1, description="column of the labels: ClassLabel, integers or strings "
                              "(strings become class ids in sorted order)")
    client_column: Optional[str] = Field(
        None, min_length=1, description="column naming each sample's client (e.g. a writer id): the natural partition; "
        "None: no client ids")
    train_split: Optional[str] = Field(None, min_length=1, description="split of a DatasetDict whose samples train; "
                                       "None: 'train', or the only split")
    test_split: Optional[str] = Field(None, min_length=1, description="split of a DatasetDict whose samples test "
                                      "(the is_train column); None: 'test' when there is one, else no fixed split")
    merge_splits: bool = Field(False, description="merge the train and test splits without a fixed split (the "
                               "per-client split applies, as for the torchvision sets)")


# data.augment's transforms (rayfed_proto.data.augment), FedSC's main_fedsc.py order
AUGMENTATIONS = ("crop", "flip")


class DataConfig(_Section):
    name: str = "digits"
    root: str = "./data"
    download: bool = False
    path: Optional[str] = Field(None, description="npz file, image folder or save_to_disk folder for name=npz/folder/hf")
    image_size: int = Field(32, ge=4, le=512, description="images are resized to this side")
    # synthetic only
    num_samples: int = Field(2000, ge=1, description="synthetic: number of images")
    num_classes: int = Field(10, ge=2, description="synthetic: number of classes")
    channels: Literal[1, 3] = Field(1, description="synthetic: image channels")
    test_fraction: float = Field(0.25, gt=0, lt=1, description="per-client stratified test share")
    domains: Optional[list[str]] = Field(None, description="multi-domain sets: the domains to use (None: all)")
    long_tail_ratio: Optional[float] = Field(
        None, ge=1, description="imbalance rho = n_max / n_min: keep an exponentially long-tailed subset (FedSC Table 2)")
    global_test_fraction: Optional[float] = Field(
        None, ge=0, lt=1, description="share held out (stratified by domain and class) as the global test set; "
        "None: the algorithm's default (methods with a global model use one)")
    public_size: Optional[int] = Field(
        None, ge=0, description="samples held out as the public unlabelled proxy set; None: the algorithm's default")
    augment: list[str] = Field(
        default_factory=list, description="train-time augmentation of every client's training batches, in order: crop "
        "(pad 4 zeros, random window of image_size), flip (horizontal, p 0.5); [] or none: off (FedSC's main_fedsc.py: "
        "RandomCrop(32, padding=4), RandomHorizontalFlip; rayfed_proto.data.augment)")
    augment_per: Literal["sample", "batch"] = Field(
        "sample", description="data.augment's random draws: one per image (sample) or one for the whole batch (batch: "
        "what FedSC's main_fedsc.py computes, its torchvision transforms being applied to the 4-d batch tensor)")
    partition: PartitionConfig = PartitionConfig()
    hf: HFDataConfig = HFDataConfig()

    @field_validator("augment", mode="before")
    @classmethod
    def _augment_names(cls, v: Any) -> list[str]:
        """None, [] or 'none': off; a name or a list of names from AUGMENTATIONS, each at most once."""
        if v is None or v == "none":
            return []
        names = [v] if isinstance(v, str) else v
        allowed = f"a list of {', '.join(AUGMENTATIONS)} (each at most once; [] or none: off)"
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"expected {allowed}")
        unknown = [n for n in names if n not in AUGMENTATIONS]
        if unknown:
            raise ValueError(f"unknown augmentation {', '.join(map(repr, unknown))}; allowed: {allowed}")
        if len(set(names)) != len(names):
            raise ValueError(f"a name is listed twice; allowed: {allowed}")
        return list(names)

    @model_validator(mode="after")
    def _fedproto_test_shots(self) -> DataConfig:
        """An unset ``partition.test_shots`` becomes FedProto's value for this dataset, so the
        resolved config holds the number the partition uses."""
        if self.partition.test_shots is None:
            self.partition.test_shots = kshot_test_shots(self.name)
        return self


class ModelConfig(_Section):
    group: str = "small_hetero"
    feature_dim: int = Field(512, ge=2)
    projector: Literal["pool", "linear", "mlp"] = Field(
        "pool", description="extractor -> feature_dim: pool = nn.AdaptiveAvgPool1d(feature_dim) over the extractor's "
        "flat output, no parameters (HtFLlib's BaseHeadSplit, the reference models of FedProto, FedTGP and FedSA); "
        "linear = one learnable Linear; mlp = Linear-ReLU-Linear (FedLSA's phi)")
    init: Literal["shared", "per_client"] = Field(
        "shared", description="initial weights: shared = every client of one architecture starts from the same "
        "weights, drawn from the run's seed (HtFLlib seeds torch with 0 before building each client's model; PFLlib "
        "copies one model to every client); per_client = each client's own draw (seeded with its id)")
    normalize_features: bool = Field(False, description="L2-normalise features before the head (hyperspherical methods)")
    stem: Literal["imagenet", "cifar"] = Field(
        "imagenet", description="the ResNets' stem (other architectures have none): imagenet = torchvision's conv7x7 "
        "stride 2 + max-pool (HtFLlib's, a 32x32 image is 8x8 at the first block); cifar = conv3x3 stride 1, no pool "
        "(FedSC's model/resnet_base.py, 32x32 stays 32x32)")
    weights: str = Field(
        "none", min_length=1, description="the extractor's initial weights: none (random init, model.init); imagenet "
        "(torchvision's published IMAGENET1K_V1 weights, downloaded into the torch hub cache when the model is built; "
        "ResNets 18-152, GoogLeNet, MobileNetV2); or the path of a state_dict file (.pt/.pth) of the extractor. A "
        "first conv of another shape (data channels, stem: cifar) keeps its init")


class TrainingConfig(_Section):
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(10, ge=1)
    trailing_batch: Literal["fold", "drop"] = Field(
        "fold", description="an epoch's incomplete last batch: fold = joins the previous batch (batches of batch_size "
        "to 2 x batch_size - 1); drop = dropped, as HtFLlib's drop_last=True (every batch holds batch_size samples; "
        "a client with fewer samples than one batch trains on one batch of all it has)")
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: Optional[float] = Field(None, gt=0, description="clip local gradients to this norm (none: no clipping, as the papers)")
    keep_optimizer_state: bool = Field(
        False, description="keep momentum / Adam state from one local update to the next (default: every local "
        "update starts with a fresh optimizer state, as every method's reference code builds its optimizer per round)")
    memory_format: Literal["auto", "channels_last", "contiguous"] = Field(
        "auto", description="layout of the clients' convolution weights: channels_last (NHWC) runs oneDNN's faster "
        "CPU convolutions; auto = channels_last on CPU, contiguous (NCHW) on GPU. Changes float rounding, not the model")


class FederationConfig(_Section):
    mode: str = Field("async", description="the federation policy (runtime/policies.py POLICIES): async (FedBuff-style "
                      "versions every buffer_size accepted updates) or sync (rounds); a registered policy's name")
    num_clients: int = Field(20, ge=1)
    rounds: int = Field(50, ge=1, description="number of server versions to produce")
    participation: float = Field(1.0, description="sync: fraction rho of clients sampled per round")
    concurrency: Union[Auto, int] = Field(
        "auto", description="client updates in flight (async); with a virtual clock (system:) simulated ones, "
        "auto = ceil(participation x num_clients)")
    buffer_size: int = Field(2, ge=1, description="async: updates aggregated per server version (K)")
    staleness_exponent: float = Field(0.5, ge=0, description="weight (1 + staleness)^(-a)")
    max_staleness: int = Field(20, ge=0, description="async: older updates are dropped and counted")
    eval_every: int = Field(5, ge=1, description="evaluate all clients every this many versions")
    eval_clients: Union[Literal["all"], int, float] = Field(
        "all", description="clients an evaluation covers: all, a number, or a fraction (0, 1] of num_clients, sampled "
        "once from the run's seed (the same clients at every version); training is never changed")
    round_deadline_s: Optional[float] = Field(
        None, gt=0, allow_inf_nan=False, description="sync with a virtual clock (system:): updates that would finish "
        "later than this many simulated seconds after the round started are dropped and counted; null: no deadline")
    over_selection: float = Field(
        1.0, ge=1, allow_inf_nan=False, description="sync with a virtual clock (system:): select ceil(this x "
        "ceil(participation x num_clients)) clients per round and keep the first ceil(participation x num_clients) "
        "to finish, the rest dropped and counted (FedScale's over-commitment); 1: no over-selection")

    @field_validator("eval_clients", mode="wrap")
    @classmethod
    def _eval_clients(cls, v, handler):
        v = handler(v) if not isinstance(v, bool) else v  # a bool is neither a count nor a fraction
        if isinstance(v, bool) or (isinstance(v, int) and v < 1) or (isinstance(v, float) and not 0 < v <= 1):
            raise ValueError("must be all, a number of clients >= 1 or a fraction in (0, 1]")
        return v

    @field_validator("participation")
    @classmethod
    def _participation(cls, v: float) -> float:
        if not (0 < v <= 1):
            raise ValueError("must be in (0, 1]")
        return v

    @field_validator("concurrency")
    @classmethod
    def _concurrency(cls, v):
        return _auto_or_positive(v)


def _auto_or_positive(v):
    if v != "auto" and v < 1:
        raise ValueError("must be 'auto' or an integer >= 1")
    return v


class ResourcesConfig(_Section):
    address: Optional[str] = Field(None, description="Ray address (None: start a local instance)")
    num_cpus: Optional[int] = Field(None, ge=1, description="local Ray instance: CPUs to declare")
    num_gpus: Optional[float] = Field(None, ge=0, description="local Ray instance: GPUs to declare")
    clients_per_actor: Union[Auto, int] = Field(
        "auto", description="clients hosted by one worker actor; auto: one worker per useful parallel slot (CPUs), "
        "clients spread over them; 1: one actor per client (fractional GPU shares)")
    park_idle_clients: Union[Auto, bool] = Field(
        "auto", description="keep a client's model only while it trains or is evaluated, its state parked as tensors "
        "otherwise; auto: when federation.num_clients > 100")
    park_to: Literal["auto", "memory", "disk"] = Field(
        "auto", description="where parked client states live: memory, or disk (one file per state on the worker's "
        "node, so memory follows the clients training, not the clients hosted: 10,000 clients); auto: disk when "
        "federation.num_clients > 1000")
    park_dir: Optional[str] = Field(
        None, min_length=1, description="park_to=disk: local folder on every worker node for the parked states "
        "(a subfolder per worker, removed when it ends); None: the node's temp folder")
    batch_clients: Literal["auto", "on", "lanes", "off"] = Field(
        "off", description="on: clients of one architecture hosted by one worker and dispatched together (a sync "
        "round) step as one vmapped model, when their method allows it (rayfed-proto list); results equal the "
        "one-after-another ones within float tolerance, not bit for bit. lanes: the same clients queue for "
        "resources.lanes rows of the vmapped model (continuous batching: a client that finishes its update leaves "
        "its lane to the next). auto: on for workers on an accelerator, off on the CPU (slower there, "
        "docs/benchmarks.md). off: one client after another")
    lanes: int = Field(8, ge=1, description="batch_clients=lanes: clients of one architecture stepping at once on a "
                       "worker (the rows of the vmapped model); more clients wait for a free lane")
    client_num_cpus: Union[Auto, float] = "auto"
    client_num_gpus: Union[Auto, float] = "auto"
    server_num_cpus: Union[Auto, float] = "auto"
    server_num_gpus: Union[Auto, float] = "auto"
    torch_threads: Union[Auto, int] = "auto"
    placement_timeout_s: float = Field(600.0, gt=0, description="fail if actors are not placed and started within this time")
    cluster_cpus: Optional[float] = Field(
        None, gt=0, description="plan the shares for a cluster of this many CPUs (an autoscaling cluster that starts "
        "without workers: what its workers will bring); None: the cluster's CPUs now, or its launcher config's node types")
    cluster_gpus: Optional[float] = Field(None, ge=0, description="like cluster_cpus, for GPUs")
    deterministic: bool = Field(
        False, description="deterministic kernels in every process that trains or evaluates a model: "
        "torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8, no cuDNN benchmark; slower "
        "on a GPU, no measurable cost on the CPU")

    @field_validator("clients_per_actor")
    @classmethod
    def _per_actor(cls, v):
        return _auto_or_positive(v)

    @field_validator("batch_clients", mode="before")
    @classmethod
    def _batch_clients(cls, v):
        return {False: "off", True: "on"}.get(v, v) if isinstance(v, bool) else v  # YAML reads bare off/on as bools

    @field_validator("park_to")
    @classmethod
    def _park_to(cls, v, info):
        if v == "disk" and info.data.get("park_idle_clients") is False:
            raise ValueError("'disk' parks idle clients' states on disk, but resources.park_idle_clients=false keeps "
                             "every client live; set park_idle_clients to auto or true, or park_to to auto or memory")
        return v

    def parks_clients(self, num_clients: int) -> bool:
        """Idle clients are parked: ``park_idle_clients``, whose ``auto`` is above 100 clients or
        whenever ``park_to: disk`` asks for states on disk."""
        if self.park_idle_clients == "auto":
            return num_clients > 100 or self.park_to == "disk"
        return bool(self.park_idle_clients)

    def parks_on_disk(self, num_clients: int) -> bool:
        return num_clients > 1000 if self.park_to == "auto" else self.park_to == "disk"

    @field_validator("client_num_cpus", "client_num_gpus", "server_num_cpus", "server_num_gpus")
    @classmethod
    def _share(cls, v):
        if v != "auto" and v < 0:
            raise ValueError("must be 'auto' or a number >= 0")
        return v


class TrackingConfig(_Section):
    enabled: bool = True
    tracking_uri: Optional[str] = Field(
        None, description="None: $MLFLOW_TRACKING_URI, else MLflow's default sqlite:///mlflow.db"
    )
    experiment_name: str = "rayfed_proto"
    run_name: Optional[str] = None
    parent_run_id: Optional[str] = Field(None, description="nest this run under an MLflow parent run (a Tune sweep sets it)")
    output_dir: str = Field("runs", description="local folder for artifacts before upload")
    log_models: Literal["auto", "none", "server", "per_architecture", "all"] = Field(
        "auto", description="models logged with mlflow.pytorch.log_model at the end of the run; auto: the server's "
                            "model when the method has one, otherwise one client per architecture")
    per_client_metrics: bool = Field(
        False, description="log each client's series as MLflow metrics zz_client/<series>/client_<id> (one chart per "
                           "client); off: they are in client_history.parquet and two plots only")
    client_series_limit: int = Field(
        100, ge=0, description="with per_client_metrics: up to this many clients, every client gets "
                               "zz_client/<series>/client_<id> series; above, a seeded sample")
    client_series_sample: int = Field(
        20, ge=0, description="above client_series_limit: clients in the seeded sample (plus the final worst and best)")
    system_metrics: bool = Field(True, description="MLflow system metrics (CPU, memory, GPU) of the driver process")
    system_metrics_interval_s: float = Field(10.0, gt=0, description="longest sampling interval of the system metrics "
                                             "(they sample every 1 s at first, about 60 times over the run so far)")
    target_accuracy: Optional[float] = Field(
        None, gt=0, le=1, description="the summary reports the simulated (virtual clock) and wall time to reach this "
        "head accuracy, and the accuracy-vs-time plots draw it (a fraction in (0, 1]; none: not reported)")


class CheckpointConfig(_Section):
    every: int = Field(10, ge=0, description="checkpoint every this many server versions (0: only on a clean stop)")
    keep: int = Field(2, ge=1, description="complete checkpoints kept (older ones are deleted)")
    dir: Optional[str] = Field(None, description="None: <run output folder>/checkpoints")


class ReliabilityConfig(_Section):
    max_client_failures: int = Field(
        3, ge=0, description="a client whose actor died more than this many times is excluded from sampling")
    max_server_failures: int = Field(3, ge=0, description="server actor deaths survived before the run fails")
    drain_timeout_s: float = Field(
        300.0, gt=0, description="on interrupt or checkpoint: how long running updates may take to finish")
    max_consecutive_refusals: int = Field(
        100, ge=0, description="stop the run (FAILED) after this many submitted updates in a row were refused or dropped "
                               "with none accepted in between (0: never)")
    no_progress_timeout_s: float = Field(
        3600.0, ge=0, description="stop the run (FAILED) when no new server version came for this many seconds "
                                  "(not counting checkpoint drains; 0: never)")


class EvaluationConfig(_Section):
    """How a client's evaluation scores (the papers' protocols as options; docs/configuration.md)."""

    proto_candidates: Literal["all", "own_classes"] = Field(
        "all", description="nearest-prototype accuracy (eval/proto_acc): every class of the bank competes (all), or "
        "only the classes of the client's training data (own_classes: FedProto's test, yuetan031/FedProto "
        "lib/update.py test_inference_new_het_lt)")


class FaultsConfig(_Section):
    """Fault injection for tests and chaos drills; empty by default."""

    corrupt_clients: list[int] = Field(default_factory=list, description="these clients upload garbage")
    corrupt_kind: Literal["nan", "inf", "shape", "unknown_class", "future_version"] = "nan"
    stop_at_version: Optional[int] = Field(
        None, ge=1, description="behave as if interrupted (SIGINT) once this version exists")
    fail_trial_at_version: Optional[int] = Field(
        None, ge=1, description="a Tune trial fails (and loses its local run folder, as with its node) at this "
        "version's evaluation, once: not in an attempt restored from a Tune checkpoint")


class ConstantSpeed(_Section):
    kind: Literal["constant"] = "constant"
    value: float = Field(1.0, gt=0, allow_inf_nan=False, description="every client's speed")


class LognormalSpeed(_Section):
    kind: Literal["lognormal"]
    sigma: float = Field(1.0, ge=0, allow_inf_nan=False,
                         description="speed_i = exp(N(0, sigma^2)), drawn once per client from the run seed (median 1)")


class CsvSpeed(_Section):
    kind: Literal["csv"]
    path: str = Field(description="CSV file with header client_id,speed; every client exactly once, speed > 0")


class FedScaleSpeed(_Section):
    kind: Literal["fedscale"]
    path: str = Field(description="FedScale device-capacity trace (pickle {client: {computation, communication}}, or CSV / "
                                  "Parquet with columns client_id,computation,communication); speed = the trace's median "
                                  "computation / the client's (ms per sample), trace clients mapped to run clients by the seed")


class AlwaysOnline(_Section):
    kind: Literal["always"] = "always"


class ProbabilityOnline(_Section):
    kind: Literal["probability"]
    p: float = Field(0.8, description="each dispatch decision: every idle candidate is online with this probability")
    retry_s: float = Field(60.0, gt=0, allow_inf_nan=False,
                           description="when no candidate is online, the scheduler retries this many simulated seconds later")

    @field_validator("p")
    @classmethod
    def _p(cls, v: float) -> float:
        if not (0 < v <= 1):
            raise ValueError("must be in (0, 1]")
        return v


class CsvOnline(_Section):
    kind: Literal["csv"]
    path: str = Field(description="CSV file with header client_id,start_s,end_s: online windows [start_s, end_s) in "
                                  "simulated seconds; clients not listed are always online")


class FedScaleOnline(_Section):
    kind: Literal["fedscale"]
    path: str = Field(description="FedScale behaviour trace (pickle {client: {active, inactive, finish_time}}, or CSV / "
                                  "Parquet with columns client_id,active,inactive,finish_time): online from active[k] to "
                                  "inactive[k], repeating every finish_time; trace clients mapped to run clients by the seed")


class ConstantBandwidth(_Section):
    kind: Literal["constant"] = "constant"  # upload_bytes_per_s / download_bytes_per_s, the same for every client


class LognormalBandwidth(_Section):
    kind: Literal["lognormal"]
    sigma: float = Field(1.0, ge=0, allow_inf_nan=False,
                         description="client c's bandwidths = upload_bytes_per_s and download_bytes_per_s x exp(N(0, "
                                     "sigma^2)), one factor per client drawn from the run seed (median: the set values)")


class FedScaleBandwidth(_Section):
    kind: Literal["fedscale"]
    path: str = Field(description="FedScale device-capacity trace (as system.speed.kind=fedscale): each client's "
                                  "communication (kbit/s) is its upload and its download bandwidth")


class FreeServer(_Section):
    kind: Literal["free"]  # server steps take no simulated time (the clock before system.server existed)


ServerSpeedConfig = Annotated[Union[ConstantSpeed, LognormalSpeed, FreeServer], Field(discriminator="kind")]
SpeedConfig = Annotated[Union[ConstantSpeed, LognormalSpeed, CsvSpeed, FedScaleSpeed], Field(discriminator="kind")]
AvailabilityConfig = Annotated[Union[AlwaysOnline, ProbabilityOnline, CsvOnline, FedScaleOnline],
                               Field(discriminator="kind")]
BandwidthConfig = Annotated[Union[ConstantBandwidth, LognormalBandwidth, FedScaleBandwidth], Field(discriminator="kind")]
_UNION_KINDS = {"system.speed": "constant, lognormal, csv, fedscale",
                "system.server": "constant, lognormal, free",
                "system.availability": "always, probability, csv, fedscale",
                "system.bandwidth": "constant, lognormal, fedscale"}


class SystemConfig(_Section):
    """Simulated client systems (speed, bandwidth, availability); setting it turns the virtual clock on
    (see rayfed_proto.system and docs/simulation.md)."""

    speed: SpeedConfig = ConstantSpeed()
    upload_bytes_per_s: Optional[float] = Field(
        None, gt=0, description="client -> server bandwidth (bytes/s), the same for every client; None: transfers take no time")
    download_bytes_per_s: Optional[float] = Field(
        None, gt=0, description="server -> client bandwidth (bytes/s), the same for every client; None: transfers take no time")
    availability: AvailabilityConfig = AlwaysOnline()
    bandwidth: BandwidthConfig = Field(
        default_factory=ConstantBandwidth,
        description="per-client bandwidth: constant (the two values above), lognormal (them x a seeded factor per "
                    "client) or fedscale (each client's communication from the device-capacity trace)")
    reference_flops: float = Field(
        1e9, gt=0, allow_inf_nan=False,
        description="FLOP/s a speed-1.0 client sustains; an architecture's seconds per training sample = 6 x MACs / this")
    cost_per_sample: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(
        default_factory=dict, description="architecture -> seconds per training sample at speed 1.0 (overrides the "
                                          "MAC-based estimate, e.g. measured on real devices)")
    server: ServerSpeedConfig = Field(
        default_factory=ConstantSpeed,
        description="the server's speed for the work each method declares for a server step: constant (default "
                    "1.0, the median client), lognormal (one draw from the run seed) or free (no simulated time)")


class AlgorithmConfig(BaseModel):
    """``name`` plus that algorithm's own options, validated against its Options model."""

    model_config = ConfigDict(extra="allow")
    name: str = "fedtgp"

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


SEED_MAX = 2**32 - 1  # numpy's and most libraries' seed range; the derived per-client seeds stay in torch's


class ExperimentConfig(_Section):
    seed: int = Field(0, description="the run's seed (0 to 2**32 - 1): data, partition, models, sampling, clock")
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    training: TrainingConfig = TrainingConfig()
    federation: FederationConfig = FederationConfig()
    resources: ResourcesConfig = ResourcesConfig()
    tracking: TrackingConfig = TrackingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    reliability: ReliabilityConfig = ReliabilityConfig()
    faults: FaultsConfig = FaultsConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    system: Optional[SystemConfig] = Field(
        None, description="simulated client systems and the virtual clock; None: wall-clock mode")

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int) -> int:
        if not 0 <= v <= SEED_MAX:
            raise ValueError(f"an integer from 0 to {SEED_MAX} (2**32 - 1)")
        return v

    # ------------------------------------------------------------------ derived
    def algorithm_options(self):
        """The algorithm's typed Options object (validated)."""
        from rayfed_proto.algorithms import ALGORITHMS

        return ALGORITHMS.get(self.algorithm.name).Options(**self.algorithm.options())

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """Flattened ``a.b.c -> value`` view (for MLflow params)."""
        return flatten(self.to_dict())


# --------------------------------------------------------------------------- helpers


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    """``d['a']['b']['c'] = value`` for ``'a.b.c'``, creating missing (or null) sections; a scalar
    where a section is needed is a ConfigError naming the key."""
    parts = dotted.split(".")
    cur = d
    for p in parts[:-1]:
        nxt = cur.get(p)
        if nxt is None:
            nxt = cur[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError([ConfigIssue(key=dotted, value=value, allowed=f"{p!r} is not a section")])
        cur = nxt
    cur[parts[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """``federation.mode=sync`` -> ('federation.mode', 'sync'); values parsed as YAML scalars."""
    if "=" not in item:
        raise ConfigError([ConfigIssue(key=item, value=None, allowed="overrides look like KEY=VALUE")])
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError([ConfigIssue(key=item, value=raw, allowed="overrides look like KEY=VALUE")])
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def _loc_to_key(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and p.startswith("function-")))


def _dig(d: Any, loc: tuple) -> Any:
    cur = d
    for p in loc:
        if isinstance(cur, dict) and p in cur:
            cur = cur[p]
        else:
            return None
    return cur


def _drop_union_tags(loc: tuple, raw: Any) -> tuple:
    """A discriminated union (``kind: ...``) puts the chosen tag in the location
    (``system.speed.lognormal.sigma``); drop it where the raw mapping has no such key but has
    ``kind`` equal to it, so the key is the one the user wrote (``system.speed.sigma``)."""
    out = []
    cur = raw
    for p in loc:
        if isinstance(cur, dict) and p not in cur and cur.get("kind") == p:
            continue
        out.append(p)
        if isinstance(cur, dict):
            cur = cur.get(p)
        elif isinstance(cur, list) and isinstance(p, int) and 0 <= p < len(cur):
            cur = cur[p]
        else:
            cur = None
    return tuple(out)


def _issues_from_validation(err: ValidationError, raw: dict, prefix: str = "") -> list[ConfigIssue]:
    issues = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if p not in ("literal", "int", "float", "str", "bool"))
        # pydantic reports a union's branch names ('function-after[...]', 'literal[...]'): drop them
        loc = tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p.startswith("function"))))
        loc = _drop_union_tags(loc, raw)
        msg = e["msg"]
        if e["type"] == STRICT_NUMBER:  # a boolean or non-finite number, found by the section (rayfed_proto.numbers)
            loc, msg = (*loc, e["ctx"]["field"]), e["ctx"]["problem"]
            issues.append(ConfigIssue(key=prefix + _loc_to_key(loc), value=_dig(raw, loc), allowed=msg))
            continue
        key = prefix + _loc_to_key(loc)
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if e["type"] in ("union_tag_invalid", "union_tag_not_found"):  # a bad or missing 'kind'
            kinds = _UNION_KINDS.get(key) or e.get("ctx", {}).get("expected_tags", "?")
            issues.append(ConfigIssue(key=f"{key}.kind", value=e.get("ctx", {}).get("tag"),
                                      allowed=f"{'one of' if e['type'] == 'union_tag_invalid' else 'required, one of'} {kinds}"))
            continue
        value = e.get("input", _dig(raw, loc))
        if isinstance(value, dict):
            value = _dig(raw, loc)
        issues.append(ConfigIssue(key=key, value=value, allowed=msg))
    # a union of 'auto' and a number reports both branches; keep one line per key
    seen: dict[str, ConfigIssue] = {}
    for i in issues:
        if i.key in seen:
            seen[i.key].allowed = f"{seen[i.key].allowed}; or {i.allowed}"
        else:
            seen[i.key] = i
    return list(seen.values())


# --------------------------------------------------------------------------- loading


def build_config(raw: dict[str, Any] | None, overrides: list[str] | None = None, source: str | None = None) -> ExperimentConfig:
    """Validate a raw dict (plus ``KEY=VALUE`` overrides) into an :class:`ExperimentConfig`."""
    raw = copy.deepcopy(raw or {})
    if not isinstance(raw, dict):
        raise ConfigError([ConfigIssue(key="<root>", value=type(raw).__name__, allowed="a mapping")], source)
    for item in overrides or []:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    _apply_algorithm_defaults(raw)
    try:
        cfg = ExperimentConfig(**raw)
    except ValidationError as err:
        issues = _issues_from_validation(err, raw)
        algo = raw.get("algorithm")
        if isinstance(algo, dict):  # report the algorithm's own options in the same pass
            issues += _algorithm_issues(str(algo.get("name", AlgorithmConfig().name)), {k: v for k, v in algo.items() if k != "name"})
        mode = _dig(raw, ("federation", "mode"))  # and an unknown federation mode (a name checked against POLICIES)
        if isinstance(mode, str) and not any(i.key == "federation.mode" for i in issues):
            issues += unknown_name_issues("federation.mode", mode, POLICIES)
        raise ConfigError(issues, source) from None
    issues = semantic_issues(cfg)
    if issues:
        raise ConfigError(issues, source)
    # Resolve the algorithm's defaults into the config, so that logged params, the saved
    # config.yaml and `validate --show` hold every value the run uses (typed, not as written).
    cfg.algorithm = AlgorithmConfig(name=cfg.algorithm.name, **cfg.algorithm_options().model_dump(mode="json"))
    return cfg


def resolved_config(cfg_dict: dict[str, Any]) -> ExperimentConfig:
    """A config that :func:`build_config` already validated and resolved (``cfg.to_dict()``), typed
    again in another process (an actor's copy) without the cross-field checks: those ran in the
    driver, whose registries may hold what this process's do not (a policy registered in a script)."""
    return ExperimentConfig(**copy.deepcopy(cfg_dict))


def _apply_algorithm_defaults(raw: dict[str, Any]) -> None:
    """Fill the chosen algorithm's ``config_defaults`` (dotted keys outside ``algorithm.``, e.g.
    ``model.normalize_features`` for FedLSA) wherever the user left the key unset, so a method's
    requirements are on by default yet stay overridable, plus its ``roundless_config_defaults`` when
    the federation's policy runs without rounds (``async``, the default); unset ``Optional`` data holdouts fall back to 0 here."""
    from rayfed_proto.algorithms import ALGORITHMS
    from rayfed_proto.algorithms.base import SameAs

    algo = raw.get("algorithm")
    name = algo.get("name", AlgorithmConfig().name) if isinstance(algo, dict) else AlgorithmConfig().name
    defaults: dict[str, Any] = {"data.global_test_fraction": 0.0, "data.public_size": 0}
    if isinstance(name, str) and name in ALGORITHMS:
        mode = _dig(raw, ("federation", "mode"))
        mode = FederationConfig().mode if mode is None else mode
        options = {k: v for k, v in algo.items() if k != "name"} if isinstance(algo, dict) else {}
        # an unknown mode gets no mode defaults here; validation names the registered ones
        in_rounds = POLICIES.get(mode).in_rounds if isinstance(mode, str) and mode in POLICIES else True
        defaults.update(ALGORITHMS.get(name).defaults_for(options, in_rounds=in_rounds))
    copies = {dotted: value for dotted, value in defaults.items() if isinstance(value, SameAs)}
    for dotted, value in defaults.items():
        if dotted not in copies:
            _set_unset(raw, dotted, value)
    for dotted, same in copies.items():  # after the plain defaults, which they may copy
        value = _dig(raw, tuple(same.key.split(".")))
        _set_unset(raw, dotted, flatten(ExperimentConfig().to_dict()).get(same.key) if value is None else value)


def _set_unset(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """``raw[dotted] = value`` unless the user set the key."""
    if _dig(raw, tuple(dotted.split("."))) is None:
        try:
            set_dotted(raw, dotted, copy.deepcopy(value))
        except ConfigError:
            pass  # a section given as a non-mapping: validation reports it


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError([ConfigIssue(key="<file>", value=str(p), allowed=(
                "a YAML file; this is a directory, not a config (to continue a run from its folder: "
                "rayfed-proto run --resume DIR)"))])
        if not p.is_file():
            raise ConfigError([ConfigIssue(key="<file>", value=str(p), allowed="an existing YAML file")])
        raw = read_yaml_file(p) or {}
    return build_config(raw, overrides, str(path) if path else None)


def read_yaml_file(p: Path, key: str = "<file>") -> Any:
    """The parsed YAML of file ``p``; a binary / non-UTF-8 file or invalid YAML raises a
    ConfigError naming ``key`` and the file (config files, sweep files, a sweep's ``base:``)."""
    try:
        return yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError([ConfigIssue(key=key, value=str(p), allowed=(
            f"a UTF-8 text YAML file; this one is binary or not UTF-8 (byte {e.object[e.start]:#04x} at offset "
            f"{e.start})"))]) from None
    except yaml.YAMLError as e:
        raise ConfigError([ConfigIssue(key=key, value=str(p), allowed=f"valid YAML ({e})")]) from None


def _algorithm_issues(name: str, options: dict[str, Any]) -> list[ConfigIssue]:
    """Problems with ``algorithm.*`` options, checked against the named algorithm's Options."""
    from rayfed_proto.algorithms import ALGORITHMS

    if name not in ALGORITHMS:
        return [ConfigIssue(key="algorithm.name", value=name, allowed="one of " + ", ".join(ALGORITHMS.names()))]
    try:
        ALGORITHMS.get(name).Options(**options)
    except ValidationError as err:
        issues = _issues_from_validation(err, options, prefix="algorithm.")
        for issue in issues:
            if issue.allowed == "unknown key":
                key = issue.key[len("algorithm."):]
                owners = [a for a in ALGORITHMS.names() if key in ALGORITHMS.get(a).Options.model_fields]
                known = ", ".join(ALGORITHMS.get(name).Options.model_fields)
                issue.allowed = (f"not an option of {name}" + (f" (it belongs to {', '.join(owners)})" if owners else "")
                                 + f"; {name} accepts: {known}")
        return issues
    return []


# --------------------------------------------------------------------------- registered checks

ConfigCheck = Callable[[ExperimentConfig], list[ConfigIssue]]
# where each section's registered checks run in semantic_issues: "data" where the names are checked
# (dataset, then partitioner: the order rayfed_proto.data imports its modules), "system" last
CHECK_SECTIONS = ("data", "system")
_CHECKS: dict[str, dict[str, ConfigCheck]] = {section: {} for section in CHECK_SECTIONS}


def register_check(section: str) -> Callable[[ConfigCheck], ConfigCheck]:
    """Decorator: ``fn(cfg) -> list[ConfigIssue]`` becomes part of :func:`semantic_issues`.

    The module that owns a section's names or files registers its rules (``rayfed_proto.data``:
    dataset and partitioner names; ``rayfed_proto.system``: the profile CSVs and
    ``cost_per_sample``), so this module never imports it. A check is known by its module and
    name: registering it again (a reloaded module) replaces it."""
    if section not in _CHECKS:
        raise ValueError(f"config check section {section!r}: one of {', '.join(CHECK_SECTIONS)}")

    def decorator(fn: ConfigCheck) -> ConfigCheck:
        _CHECKS[section][f"{fn.__module__}.{fn.__qualname__}"] = fn
        return fn

    return decorator


def registered_checks(section: str) -> list[ConfigCheck]:
    """The checks registered for ``section``, in registration order."""
    return list(_CHECKS[section].values())


def _registered_issues(section: str, cfg: ExperimentConfig) -> list[ConfigIssue]:
    checks = registered_checks(section)
    if not checks:  # never silently accept unknown names: the registering modules were not imported
        raise RuntimeError(f"no config checks registered for {section!r}: they are registered when the "
                           "rayfed_proto package is imported (rayfed_proto/__init__.py)")
    return [issue for check in checks for issue in check(cfg)]


def unknown_name_issues(key: str, value: Any, registry) -> list[ConfigIssue]:
    """``[issue]`` naming every allowed name when ``value`` is not in ``registry`` (anything with
    ``in`` and ``names()``, e.g. a :class:`rayfed_proto.registry.Registry`); ``[]`` when it is."""
    if value in registry:
        return []
    return [ConfigIssue(key=key, value=value, allowed="one of " + ", ".join(registry.names()))]


def _federation_issues(cfg: ExperimentConfig) -> list[ConfigIssue]:
    """federation.* rules that span fields; the mode's own rules are its policy's (``config_issues``)."""
    fed = cfg.federation
    issues = unknown_name_issues("federation.mode", fed.mode, POLICIES)
    if fed.concurrency != "auto" and fed.concurrency > fed.num_clients:
        issues.append(ConfigIssue(key="federation.concurrency", value=fed.concurrency,
                                  allowed=f"at most federation.num_clients ({fed.num_clients})"))
    if not issues:
        issues += [ConfigIssue(key=k, value=v, allowed=a)
                   for k, v, a in POLICIES.get(fed.mode).config_issues(fed, virtual_clock=cfg.system is not None)]
    if fed.eval_every > fed.rounds:
        issues.append(ConfigIssue(key="federation.eval_every", value=fed.eval_every,
                                  allowed=f"at most federation.rounds ({fed.rounds})"))
    if isinstance(fed.eval_clients, int) and fed.eval_clients > fed.num_clients:
        issues.append(ConfigIssue(key="federation.eval_clients", value=fed.eval_clients,
                                  allowed=f"all, at most federation.num_clients ({fed.num_clients}), or a fraction in (0, 1]"))
    return issues


def _round_scope_issues(cfg: ExperimentConfig) -> list[ConfigIssue]:
    """``aggregation_scope: latest`` in a federation of rounds that samples part of the clients:
    the uploads of clients not sampled this round (stale) would enter the round, which no paper
    does (their S_t is the round's sampled clients); refused (docs/configuration.md)."""
    fed = cfg.federation
    in_rounds = fed.mode in POLICIES and POLICIES.get(fed.mode).in_rounds
    scope = getattr(cfg.algorithm_options(), "aggregation_scope", None)
    if not (in_rounds and scope == "latest" and fed.participation < 1):
        return []
    return [ConfigIssue(key="algorithm.aggregation_scope", value=scope, allowed=(
        f"buffer (this round's uploads, the default when the federation runs in rounds) with federation.mode "
        f"{fed.mode} and participation {fed.participation} < 1: latest would aggregate the last uploads of clients "
        "not sampled this round; latest is for async mode or full participation"))]


def semantic_issues(cfg: ExperimentConfig) -> list[ConfigIssue]:
    """Rules that span fields or need the registries (plus the checks registered per section)."""
    from rayfed_proto.algorithms import ALGORITHMS
    from rayfed_proto.models import MODEL_GROUPS

    issues: list[ConfigIssue] = []

    def check_name(key: str, value: str, registry) -> bool:
        found = unknown_name_issues(key, value, registry)
        issues.extend(found)
        return not found

    option_issues = _algorithm_issues(cfg.algorithm.name, cfg.algorithm.options())
    issues.extend(option_issues)
    algo_cls = ALGORITHMS.get(cfg.algorithm.name) if cfg.algorithm.name in ALGORITHMS else None
    if algo_cls is not None and not option_issues:  # the algorithm's own cross-field rules
        for key, value, allowed in cfg.algorithm_options().run_issues(cfg.federation.rounds):
            issues.append(ConfigIssue(key=f"algorithm.{key}", value=value, allowed=allowed))
        issues.extend(_round_scope_issues(cfg))
    issues.extend(_registered_issues("data", cfg))  # data.name, data.partition.name
    group_ok = check_name("model.group", cfg.model.group, MODEL_GROUPS)
    if group_ok:
        issues.extend(model_issues(cfg))

    if algo_cls is not None and group_ok and algo_cls.requires_homogeneous_models:
        if not group_is_homogeneous(cfg.model.group, cfg.federation.num_clients):
            issues.append(ConfigIssue(
                key="model.group", value=cfg.model.group,
                allowed=f"{cfg.algorithm.name} averages model weights, so every client needs the same "
                f"architecture; use a single-architecture group ({', '.join(g for g in MODEL_GROUPS.names() if len(set(MODEL_GROUPS.get(g))) == 1)})",
            ))

    if algo_cls is not None and algo_cls.config_defaults.get("data.public_size") and not cfg.data.public_size:
        issues.append(ConfigIssue(key="data.public_size", value=cfg.data.public_size,
                                  allowed=f"at least 1: {cfg.algorithm.name} distils through a public proxy set "
                                  f"(default {algo_cls.config_defaults['data.public_size']})"))

    if cfg.data.name in ("npz", "folder") and not cfg.data.path:
        issues.append(ConfigIssue(key="data.path", value=None, allowed=f"a path is required when data.name is {cfg.data.name!r}"))

    issues.extend(_federation_issues(cfg))
    fed = cfg.federation
    bad_ids = [c for c in cfg.faults.corrupt_clients if not 0 <= c < fed.num_clients]
    if bad_ids:
        issues.append(ConfigIssue(key="faults.corrupt_clients", value=cfg.faults.corrupt_clients,
                                  allowed=f"client ids in 0..{fed.num_clients - 1}"))
    res = cfg.resources
    if res.clients_per_actor != "auto" and res.clients_per_actor > fed.num_clients:
        issues.append(ConfigIssue(key="resources.clients_per_actor", value=res.clients_per_actor,
                                  allowed=f"at most federation.num_clients ({fed.num_clients})"))
    if res.client_num_gpus != "auto" and res.client_num_gpus > 1 and not float(res.client_num_gpus).is_integer():
        issues.append(ConfigIssue(key="resources.client_num_gpus", value=res.client_num_gpus,
                                  allowed="a fraction <= 1 or a whole number of GPUs (Ray's rule)"))
    # system.*: profile CSVs read now, so `validate` refuses a bad file before Ray starts
    issues.extend(_registered_issues("system", cfg))
    return issues


def model_issues(cfg: ExperimentConfig) -> list[ConfigIssue]:
    """``model.stem`` and ``model.weights`` against the architectures of this run's clients
    (client i gets archs[i % len]). Nothing is downloaded or read here: weights load when a model
    is built (rayfed_proto.models.weights), so a config with ``imagenet`` validates offline."""
    from rayfed_proto.models import ARCHITECTURES, MODEL_GROUPS, imagenet_weights, takes_stem

    m = cfg.model
    used = list(dict.fromkeys(MODEL_GROUPS.get(m.group)[:cfg.federation.num_clients]))
    issues: list[ConfigIssue] = []
    if m.stem != "imagenet" and not any(takes_stem(a) for a in used):
        with_stem = ", ".join(a for a in ARCHITECTURES.names() if takes_stem(a))
        issues.append(ConfigIssue(key="model.stem", value=m.stem, allowed=(
            f"imagenet: group {m.group!r} ({', '.join(used)}) has no architecture with a stem choice (those that "
            f"have one: {with_stem})")))
    if m.weights == "imagenet":
        lacking = [a for a in used if imagenet_weights(a) is None]
        if lacking:
            having = ", ".join(a for a in ARCHITECTURES.names() if imagenet_weights(a))
            issues.append(ConfigIssue(key="model.weights", value=m.weights, allowed=(
                f"none or a path: {', '.join(lacking)} (group {m.group!r}) have no published ImageNet weights in "
                f"torchvision (those that have: {having})")))
    elif m.weights != "none":
        if len(used) > 1:
            issues.append(ConfigIssue(key="model.weights", value=m.weights, allowed=(
                f"none or imagenet: a weights file holds one extractor, and group {m.group!r} gives this run's "
                f"clients {len(used)} architectures ({', '.join(used)})")))
        elif not Path(m.weights).expanduser().is_file():
            issues.append(ConfigIssue(key="model.weights", value=m.weights, allowed=(
                "none, imagenet (torchvision's published weights, downloaded into the torch hub cache) or the path "
                "of an existing state_dict file (.pt/.pth) of the extractor: no file there")))
    return issues


def group_is_homogeneous(group: str, num_clients: int) -> bool:
    """Whether the clients of this run (client i gets archs[i % len]) share one architecture."""
    from rayfed_proto.models import MODEL_GROUPS

    archs = MODEL_GROUPS.get(group)
    return len(set(archs[:num_clients])) == 1  # the first min(num_clients, len(archs)) are every one used


# With --resume, --set may change how a run goes on, not what it is: the model, data, method and
# optimizer settings are fixed by the saved config and by the checkpoint (a restored optimizer
# keeps its saved learning rate, so a changed training.lr would be silently ignored).
RESUME_SETTABLE = ("resources.", "tracking.", "checkpoint.", "reliability.", "faults.",
                   "federation.rounds", "federation.eval_every")


def check_resume_overrides(overrides: list[str] | None) -> None:
    """``--set`` items given with ``--resume`` (or ``resume=`` in the API): only keys of
    :data:`RESUME_SETTABLE`, else a ConfigError naming each key and what may be set."""
    issues = []
    for item in overrides or []:
        key, value = parse_override(item)
        if not any(key == p or (p.endswith(".") and key.startswith(p)) for p in RESUME_SETTABLE):
            issues.append(ConfigIssue(key=key, value=value, allowed=(
                "with --resume only how the run goes on: " + ", ".join(p + "*" if p.endswith(".") else p for p in RESUME_SETTABLE)
                + "; the rest is fixed by the saved config and checkpoint (start a new run to change it)")))
    if issues:
        raise ConfigError(issues, "--resume --set")
