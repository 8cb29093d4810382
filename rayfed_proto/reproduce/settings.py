"""What ``rayfed-proto reproduce`` runs for each published table: a data table, no logic.

A :class:`Reproduction` is one (paper, table): the methods it runs (each an algorithm of this
platform and the published rows its run fills), the settings (one run configuration per group of
columns: FedLSA's four Digits domains and their average come from one run) and the columns. Each
setting names a preset and ``--set`` overrides per scale:

* ``full``: the paper's scale (its preset, its dataset, its rounds and clients), for a GPU
  cluster; None where the paper's setting cannot be built here (a dataset or partition the
  platform lacks), with the reason;
* ``small``: minutes on a 2-core CPU: a CPU preset on an embedded dataset of the same shape (the
  ``digits`` family for the papers' CIFAR / Digits), :data:`SMALL_RUN` rounds and clients. It is
  NOT the paper's experiment, and every small table says so (``small_note``).

The paper's own method keeps its preset's ``algorithm`` section; a baseline gets its own
(``Method.options``), since one method's options are not another's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rayfed_proto.reproduce.published import TABLES, published_table

SCALES = ("small", "full")
DEFAULT_SEEDS = (0, 1, 2)  # three trials, as FedSA, FedSAP (and HtFLlib's -t 3) report them

# small scale: a handful of rounds and clients, every round evaluated (a best-over-rounds metric needs them)
SMALL_RUN = ("federation.rounds=6", "federation.num_clients=6", "federation.participation=1.0",
             "federation.eval_every=1", "tracking.log_models=none")
# small scale of the papers that report a global model (FedSC, FedLSA): FedAvg's global model on the
# embedded digits is at chance for the first rounds (22.5 % at round 5, 82 % at round 20 in
# docs/benchmarks.md's domain-skew study), so 6 rounds would compare nothing
SMALL_GLOBAL_ROUNDS = "federation.rounds=20"
# full scale: every round evaluated where the paper reports the best over rounds (HtFLlib's eval_gap 1)
EVERY_ROUND = ("federation.eval_every=1",)

# FedProto as FedSA's and FedTGP's scripts run it (lokinko/FedSA, TsingZ0/HtFLlib: -lam 10)
FEDPROTO_HTFLLIB = {"lam": 10.0}


@dataclass(frozen=True)
class Method:
    """One method of the table: ``algorithm`` (ours), the published ``rows`` its run fills, each
    with its metric ``(key, 'best'|'final')`` or None for :func:`paper_metric` of the algorithm;
    ``options``: the algorithm section of a baseline (None: the preset's, the paper's own method);
    ``overrides``: ``--set`` items for this method only, with ``why`` (``small_overrides``: at
    ``--scale small`` only)."""

    algorithm: str
    rows: dict[str, Optional[tuple[str, str]]]
    options: Optional[dict] = None
    overrides: tuple[str, ...] = ()
    why: str = ""
    small_overrides: tuple[str, ...] = ()  # this method's, at --scale small only


@dataclass(frozen=True)
class Scaled:
    """A run configuration at one scale: a preset and ``--set`` overrides."""

    preset: str
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Setting:
    full: Optional[Scaled]
    small: Scaled
    unavailable: str = ""  # why full is None


@dataclass(frozen=True)
class Column:
    """A published column and the setting whose run gives it; ``domain``: a per-domain column
    (the server model's accuracy on that domain's global test data, ``eval/global_acc_<domain>``;
    ``mean`` for the domains' average), named per scale by :attr:`Reproduction.domains`."""

    name: str
    setting: str
    domain: Optional[str] = None


@dataclass(frozen=True)
class Reproduction:
    paper: str
    table: str
    methods: tuple[Method, ...]
    settings: dict[str, Setting]
    columns: tuple[Column, ...]
    small_columns: tuple[str, ...]  # what --scale small runs unless --columns says otherwise: the main setting
    small_note: str
    notes: tuple[str, ...] = ()
    domains: dict[str, dict[str, str]] = field(default_factory=dict)  # scale -> paper domain -> our domain name

    @property
    def published(self):
        return published_table(self.paper, self.table)

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)


def _cols(names, settings=None, domains=None) -> tuple[Column, ...]:
    return tuple(Column(n, (settings or {}).get(n, n), (domains or {}).get(n)) for n in names)


# ------------------------------------------------------------------------------ FedSA

_FEDSA_METHODS = (
    Method("fedproto", {"FedProto": None}, FEDPROTO_HTFLLIB, why="lam 10: the FedSA and FedTGP run scripts"),
    Method("fedtgp", {"FedTGP": None}, {}),
)
_FEDSA_SMALL = Scaled("fedsa_digits", SMALL_RUN)

FEDSA_T1 = Reproduction(
    "fedsa", "table1",
    methods=(*_FEDSA_METHODS, Method("fedsa", {"FedSA": None}, overrides=("algorithm.lambda2=0.01",),
                                     why="lambda2 0.01 for statistical heterogeneity (FedSA, Implementation details)")),
    settings={
        **{f"{where}/{name}": Setting(
            Scaled(preset, (*EVERY_ROUND, "model.group=HtFE1", f"data.name={data}")),
            Scaled("fedsa_digits", (*SMALL_RUN, "model.group=HtFE1", *(("federation.participation=0.5",)
                                                                      if where == "cross-device" else ()))))
           for where, preset in (("cross-silo", "fedsa_cross_silo"), ("cross-device", "fedsa_cross_device"))
           for name, data in (("Cifar10", "cifar10"), ("Cifar100", "cifar100"))},
        **{f"{where}/Tiny-ImageNet": Setting(None, Scaled("fedsa_digits", (*SMALL_RUN, "model.group=HtFE1")),
                                             "Tiny-ImageNet is not a dataset of this platform")
           for where in ("cross-silo", "cross-device")},
    },
    columns=_cols(TABLES[("fedsa", "table1")].columns),
    small_columns=("cross-device/Cifar10",),
    small_note="small scale: the embedded digits (10 classes, like Cifar10) instead of Cifar10, 6 clients (cross-device: "
               "half of them per round instead of 10 of 100), 6 rounds instead of 1000; every client the 4-layer CNN "
               "(HtFE1) as in the paper",
    notes=("all clients the 4-layer CNN (homogeneous models, FedSA Setup: statistical heterogeneity)",),
)

FEDSA_T2 = Reproduction(
    "fedsa", "table2",
    methods=(*_FEDSA_METHODS, Method("fedsa", {"FedSA": None})),
    settings={g: Setting(Scaled("fedsa_cross_device", (*EVERY_ROUND, f"model.group={g}")),
                         Scaled("fedsa_digits", (*SMALL_RUN, "model.group=small_hetero", "federation.participation=0.5")))
              for g in ("HtFE2", "HtFE3", "HtFE5", "HtFE8")},
    columns=_cols(("HtFE2", "HtFE3", "HtFE5", "HtFE8")),
    small_columns=("HtFE8",),
    small_note="small scale: the embedded digits instead of Cifar100, 6 clients (half of them per round instead of 10 "
               "of 100), 6 rounds instead of 1000, and the four small CPU models of small_hetero instead of the HtFE "
               "group's ResNets (every column the same small group)",
)

# ------------------------------------------------------------------------------ FedLSA

_LSA_DIGITS = ("Digits/MNIST", "Digits/USPS", "Digits/SVHN", "Digits/SYN", "Digits/AVERAGE")
_LSA_OFFICE = ("Office Caltech/CALTECH", "Office Caltech/AMAZON", "Office Caltech/WEBCAM", "Office Caltech/DSLR",
               "Office Caltech/AVERAGE")

FEDLSA_T2 = Reproduction(
    "fedlsa", "table2",
    methods=(Method("fedavg", {"FedAvg": None}, {}),
             Method("fedlsa", {"FedLSA": None}, small_overrides=("algorithm.server_epochs=20",))),
    settings={
        "digits": Setting(Scaled("fedlsa_digits"), Scaled("fedlsa_domains", (
            *SMALL_RUN, SMALL_GLOBAL_ROUNDS, "data.partition.clients_per_domain=[1,2,1,2]"))),
        "office_caltech": Setting(None, Scaled("fedlsa_domains", SMALL_RUN),
                                  "no preset for Office Caltech: the paper gives its client split in the supplementary "
                                  "material, not in the text"),
    },
    columns=(*_cols(_LSA_DIGITS, {c: "digits" for c in _LSA_DIGITS},
                    dict(zip(_LSA_DIGITS, ("mnist", "usps", "svhn", "synth", "mean"), strict=True))),
             *_cols(_LSA_OFFICE, {c: "office_caltech" for c in _LSA_OFFICE})),
    small_columns=_LSA_DIGITS,
    small_note="small scale: the embedded digits_domains (original, inverted, rotated, noisy) stand in for MNIST, USPS, "
               "SVHN and SYN, dealt to 1, 2, 1, 2 of 6 clients (the paper: 1, 4, 2, 3 of 10), 20 rounds instead of 100, "
               "20 anchor epochs instead of 500",
    notes=("FedProto and FedTGP (published rows) have no global model here, so no per-domain accuracy to set beside "
           "these columns; they are not run",),
    domains={"full": {"mnist": "mnist", "usps": "usps", "svhn": "svhn", "synth": "synth"},
             "small": {"mnist": "original", "usps": "inverted", "svhn": "rotated", "synth": "noisy"}},
)

# ------------------------------------------------------------------------------ FedProtoKD

_KD_COLS = TABLES[("fedprotokd", "table2")].columns


def _kd_setting(column: str) -> Setting:
    split, data = column.split("/")
    full = {"CIFAR-10": "cifar10", "CIFAR-100": "cifar100"}[data]
    if split.startswith("alpha="):
        part = (f"data.partition.beta={split[len('alpha='):]}",)
        small_part = part
    else:  # k=3|20: 3 classes per client on CIFAR-10, 20 on CIFAR-100
        k10, k100 = split[len("k="):].split("|")
        part = ("data.partition.name=pathological", f"data.partition.classes_per_client={k10 if full == 'cifar10' else k100}")
        small_part = ("data.partition.name=pathological", f"data.partition.classes_per_client={k10}")
    return Setting(Scaled("fedprotokd_cifar10", (*EVERY_ROUND, f"data.name={full}", *part)),
                   Scaled("fedprotokd_digits", (*SMALL_RUN, *small_part)))


_KD_SETTINGS = {c: _kd_setting(c) for c in _KD_COLS}
_KD_SMALL = ("algorithm.generator_epochs=10", "algorithm.server_epochs=2")  # the server step dominates a CPU run
_KD_NOTE = ("small scale: the embedded digits (300 public samples) instead of CIFAR, 6 clients instead of 10, 6 rounds "
            "instead of 100, small CPU models (small_hetero) and a small CNN server model instead of HtFE8 and "
            "ResNet34, 2 server and 10 generator epochs instead of 10 and 100; a CIFAR-100 column keeps CIFAR-10's classes per client")

FEDPROTOKD_T1 = Reproduction(
    "fedprotokd", "table1",
    methods=(Method("fedprotokd", {"FedProtoKD": ("eval/global_acc", "best")}, small_overrides=_KD_SMALL),),
    settings=_KD_SETTINGS, columns=_cols(_KD_COLS), small_columns=("alpha=0.1/CIFAR-10",), small_note=_KD_NOTE,
    notes=("the server model's accuracy on the global test set (eval/global_acc), the best over rounds",),
)
FEDPROTOKD_T2 = Reproduction(
    "fedprotokd", "table2",
    methods=(Method("fedproto", {"FedProto": None}, FEDPROTO_HTFLLIB, why="lam 10: the FedSA and FedTGP run scripts"),
             Method("fedtgp", {"FedTGP": None}, {}),
             # TABLE II is the clients' personalised accuracy (Sec. IV-E), not the server accuracy of
             # FedProtoKD's paper metric (TABLE I): each client's own model, its head
             Method("fedprotokd", {"FedProtoKD": ("eval/head_acc", "best")}, small_overrides=_KD_SMALL)),
    settings=_KD_SETTINGS, columns=_cols(_KD_COLS), small_columns=("alpha=0.1/CIFAR-10",), small_note=_KD_NOTE,
    notes=("FedProtoKD's row: the clients' personalised accuracy (eval/head_acc, best over rounds), as TABLE II "
           "reports it; the server model's accuracy is TABLE I (`reproduce fedprotokd table1`)",),
)

# ------------------------------------------------------------------------------ FedSC


def _fedsc_setting(column: str, long_tail: bool) -> Setting:
    data, split = column.split("/")
    name = {"CIFAR10": "cifar10", "CIFAR100": "cifar100", "CIFAR10-LT": "cifar10", "CIFAR100-LT": "cifar100"}.get(data)
    if long_tail:
        rho = split[len("rho="):]
        part, small_part = (f"data.long_tail_ratio={rho}",), (f"data.long_tail_ratio={rho}",)
    elif split.startswith("NID1_"):
        part = small_part = (f"data.partition.beta={split[len('NID1_'):]}",)
    else:
        part = small_part = None
    small = Scaled("fedsc_domains", (*SMALL_RUN, SMALL_GLOBAL_ROUNDS, "data.name=digits", "data.partition.name=dirichlet",
                                     *(small_part or ("data.partition.beta=0.2",))))
    if name is None:
        return Setting(None, small, f"{data.removesuffix('-LT')} is not a dataset of this platform")
    if part is None:
        return Setting(None, small, "NID2 (5 clients of |C|/5 classes and 1 client with all) is not a partitioner here")
    return Setting(Scaled("fedsc_cifar10", (f"data.name={name}", *part)), small)


_FEDSC_METHODS = (Method("fedavg", {"FedAvg": None}, {}), Method("fedproto", {"FedProto": None}, {}),
                  Method("fedsc", {"FedSC": None}))
_FEDSC_NOTE = ("small scale: the embedded digits (16x16) with Dirichlet label skew instead of CIFAR, the FedAvg CNN "
               "(HtFE1) instead of ResNet-10, 6 clients instead of 10, 20 rounds instead of 100")
FEDSC_T1 = Reproduction(
    "fedsc", "table1", methods=_FEDSC_METHODS,
    settings={c: _fedsc_setting(c, False) for c in TABLES[("fedsc", "table1")].columns},
    columns=_cols(TABLES[("fedsc", "table1")].columns), small_columns=("CIFAR10/NID1_0.2",), small_note=_FEDSC_NOTE,
)
FEDSC_T2 = Reproduction(
    "fedsc", "table2", methods=_FEDSC_METHODS,
    settings={c: _fedsc_setting(c, True) for c in TABLES[("fedsc", "table2")].columns},
    columns=_cols(TABLES[("fedsc", "table2")].columns), small_columns=("CIFAR10-LT/rho=10",),
    small_note=_FEDSC_NOTE + "; the long tail cut from the digits",
)

# ------------------------------------------------------------------------------ FedSAP


def _fedsap_setting(column: str) -> Setting:
    data, n = column.split("/")
    n_way = int(n[len("n="):])
    small = Scaled("fedsap_digits", (*SMALL_RUN, f"data.partition.n_way={min(n_way, 5)}"))
    if data == "FEMNIST":
        return Setting(None, small, "FEMNIST is not a packaged dataset (data.name: hf with a FEMNIST copy could serve)")
    if data == "CIFAR-10":
        return Setting(Scaled("fedsap_cifar10", (f"data.partition.n_way={n_way}",)), small)
    # CIFAR-100: mu_k 50 (FedSAP appendix Table 5)
    return Setting(Scaled("fedsap_cifar10", ("data.name=cifar100", f"data.partition.n_way={n_way}",
                                             "data.partition.k_shot=50")), small)


_HEAD, _PROTO = ("eval/head_acc", "final"), ("eval/proto_acc", "final")
FEDSAP_T1 = Reproduction(
    "fedsap", "table1",
    methods=(Method("fedavg", {"FedAvg (head)": _HEAD}, {}, small_overrides=("model.group=HtFE1",),
                    why="one architecture for every client (weights are averaged); small scale: the FedAvg CNN"),
             Method("fedproto", {"FedProto (head)": _HEAD, "FedProto (proto)": _PROTO}, {}),
             Method("fedsap", {"FedSAP (head)": _HEAD, "FedSAP (proto)": _PROTO})),
    settings={c: _fedsap_setting(c) for c in TABLES[("fedsap", "table1")].columns},
    columns=_cols(TABLES[("fedsap", "table1")].columns), small_columns=("CIFAR-10/n=3",),
    small_note="small scale: the embedded digits instead of CIFAR-10, 20 training shots per class instead of the "
               "paper's, 6 clients instead of 20, 6 rounds instead of 100, small CPU models from scratch instead of an "
               "ImageNet-initialised ResNet-18",
    notes=("the head rows are classifier-head accuracy (eval/head_acc), the proto rows nearest-prototype accuracy "
           "(eval/proto_acc); the paper does not say best or final: final (its curves end at round 100)",
           "the n and k spread across clients follow the preset; a CIFAR-100 column sets k_shot 50 (appendix Table 5)"),
)

REPRODUCTIONS: dict[tuple[str, str], Reproduction] = {(r.paper, r.table): r for r in (
    FEDSA_T2, FEDSA_T1, FEDLSA_T2, FEDPROTOKD_T2, FEDPROTOKD_T1, FEDSC_T1, FEDSC_T2, FEDSAP_T1)}
# the paper's main table: what `reproduce PAPER` runs without a TABLE
MAIN_TABLE = {"fedsa": "table2", "fedlsa": "table2", "fedprotokd": "table2", "fedsc": "table1", "fedsap": "table1"}
