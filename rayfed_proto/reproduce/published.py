"""The five seed papers' published numbers, typed in from their tables (``rayfed-proto reproduce``).

Each :class:`PublishedTable` is one table of one paper as printed: its id and caption, where it
is (``source``: the paper, table and the copy read, ``../shared/papers/<paper>.md``), what it
reports (``metric``: the paper's words), its columns (dataset / setting / model group, as the
header names them) and its rows (method -> one cell per column: ``(mean, std)`` where the paper
prints ``mean ± std``, ``(value, None)`` where it prints one number, ``None`` where the row has
no number in that column). Only the columns and rows printed are here: nothing is computed
(FedLSA's ``AVERAGE`` is the paper's own column). Percentages, as printed.

Rows of methods this platform does not implement (LG-FedAvg, FedGen, FML, FedKD, FedDistill,
MOON, FedProx...) are kept: the reproduced table shows them as the paper's context, with no
number of ours.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

Cell = Optional[tuple[float, Optional[float]]]

PAPERS = {
    "fedsa": "FedSA: A Unified Representation Learning via Semantic Anchors for Prototype-based Federated Learning "
             "(Zhou et al.)",
    "fedlsa": "Beyond Federated Prototype Learning: Learnable Semantic Anchors with Hyperspherical Contrast for "
              "Domain-Skewed Data (Fu et al.)",
    "fedprotokd": "Dual-Distilled Heterogeneous Federated Learning with Adaptive Margins for Trainable Global "
                  "Prototypes (Siddika et al.)",
    "fedsc": "FedSC: Federated Learning with Semantic-Aware Collaboration (Wang et al.)",
    "fedsap": "Closing the Alignment-Maturity Gap in Federated Prototype Learning (arXiv:2606.02172)",
}


@dataclass(frozen=True)
class PublishedTable:
    paper: str
    table: str  # our id: "table2"
    label: str  # as the paper names it: "Table 2", "TABLE II"
    caption: str
    metric: str  # what the paper says it reports
    columns: tuple[str, ...]
    rows: dict[str, tuple[Cell, ...]]

    @property
    def source(self) -> str:
        return f"{PAPERS[self.paper]}, {self.label} (../shared/papers/{self.paper}.md)"

    def cell(self, row: str, column: str) -> Cell:
        return self.rows[row][self.columns.index(column)]


@dataclass(frozen=True)
class Entry:
    """One published number, with everything that names it."""

    paper: str
    table: str
    column: str
    row: str
    value: float
    std: Optional[float]
    metric: str
    source: str


def _pm(*pairs: float) -> tuple[Cell, ...]:
    """``_pm(90.76, 0.05, 53.26, 0.11)``: cells printed as mean ± std."""
    return tuple((pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2))


def _one(*values: Optional[float]) -> tuple[Cell, ...]:
    """Cells printed as one number (no std)."""
    return tuple(None if v is None else (v, None) for v in values)


_FEDSA_T1 = ("cross-silo/Cifar10", "cross-silo/Cifar100", "cross-silo/Tiny-ImageNet",
             "cross-device/Cifar10", "cross-device/Cifar100", "cross-device/Tiny-ImageNet")
_FEDPROTOKD_COLS = ("alpha=0.1/CIFAR-10", "alpha=0.1/CIFAR-100", "k=3|20/CIFAR-10", "k=3|20/CIFAR-100",
                    "alpha=0.3/CIFAR-10", "alpha=0.3/CIFAR-100", "k=5|40/CIFAR-10", "k=5|40/CIFAR-100")
_FEDSC_T1 = ("CIFAR10/NID1_0.05", "CIFAR10/NID1_0.2", "CIFAR10/NID2", "CIFAR100/NID1_0.05", "CIFAR100/NID1_0.2",
             "CIFAR100/NID2", "TinyImageNet/NID1_0.05", "TinyImageNet/NID1_0.2", "TinyImageNet/NID2",
             "FC100/NID1_0.05", "FC100/NID1_0.2", "FC100/NID2")
_FEDSAP_T1 = ("FEMNIST/n=3", "FEMNIST/n=4", "FEMNIST/n=5", "CIFAR-10/n=3", "CIFAR-10/n=4", "CIFAR-10/n=5",
              "CIFAR-100/n=10", "CIFAR-100/n=20", "CIFAR-100/n=30")

TABLES: dict[tuple[str, str], PublishedTable] = {(t.paper, t.table): t for t in [
    PublishedTable(
        "fedsa", "table1", "Table 1",
        "The test accuracy (%) on three datasets in both cross-silo and cross-device settings under statistical "
        "heterogeneity.",
        "test accuracy (%), mean ± std over three trials (each client's test split, 25 % of its data)",
        _FEDSA_T1,
        {"LG-FedAvg": _pm(89.32, 0.04, 48.97, 0.07, 35.08, 0.06, 87.27, 0.05, 43.41, 0.10, 28.54, 0.05),
         "FedGen": _pm(89.13, 0.05, 48.25, 0.06, 32.68, 0.08, 86.99, 0.07, 42.70, 0.08, 27.76, 0.08),
         "FML": _pm(89.42, 0.03, 48.73, 0.22, 34.75, 0.13, 87.42, 0.07, 42.13, 0.14, 27.63, 0.04),
         "FedKD": _pm(90.21, 0.06, 53.14, 0.10, 37.14, 0.16, 87.94, 0.13, 46.03, 0.15, 30.58, 0.19),
         "FedDistill": _pm(89.61, 0.03, 49.27, 0.18, 35.45, 0.07, 87.57, 0.05, 42.15, 0.16, 28.57, 0.12),
         "FedProto": _pm(90.76, 0.05, 53.26, 0.11, 36.23, 0.12, 87.49, 0.11, 44.46, 0.32, 28.73, 0.21),
         "FedTGP": _pm(90.23, 0.08, 53.71, 0.13, 36.43, 0.08, 87.98, 0.16, 47.41, 0.11, 29.96, 0.17),
         "FedSA": _pm(90.88, 0.04, 54.39, 0.12, 37.30, 0.13, 88.78, 0.08, 48.42, 0.17, 30.82, 0.14)}),
    PublishedTable(
        "fedsa", "table2", "Table 2",
        "The test accuracy (%) on Cifar100 in the cross-device setting under both statistical and model heterogeneity.",
        "test accuracy (%), mean ± std over three trials (each client's test split, 25 % of its data)",
        ("HtFE2", "HtFE3", "HtFE5", "HtFE8"),
        {"LG-FedAvg": _pm(41.22, 0.13, 40.59, 0.42, 39.66, 0.23, 35.24, 0.13),
         "FedGen": _pm(40.05, 0.18, 38.47, 0.29, 39.48, 0.28, 34.63, 0.44),
         "FML": _pm(40.62, 0.06, 40.19, 0.09, 36.39, 0.13, 34.47, 0.09),
         "FedKD": _pm(42.19, 0.09, 40.53, 0.07, 37.47, 0.21, 35.08, 0.12),
         "FedDistill": _pm(41.58, 0.15, 40.92, 0.36, 39.98, 0.13, 35.26, 0.48),
         "FedProto": _pm(35.63, 0.22, 29.89, 0.48, 27.75, 0.64, 16.31, 0.32),
         "FedTGP": _pm(42.14, 0.29, 37.97, 0.57, 38.66, 0.42, 32.04, 0.74),
         "FedSA": _pm(43.54, 0.21, 41.75, 0.16, 40.96, 0.12, 35.68, 0.17)}),
    PublishedTable(
        "fedlsa", "table2", "Table 2",
        "Performance comparison (%) of all compared methods on Digits and Office Caltech datasets, where AVERAGE and "
        "Δ denote the average performance of all domains and the improvements over FedAvg, respectively.",
        "accuracy (%) per test domain and their average, one number per method (no std printed)",
        ("Digits/MNIST", "Digits/USPS", "Digits/SVHN", "Digits/SYN", "Digits/AVERAGE",
         "Office Caltech/CALTECH", "Office Caltech/AMAZON", "Office Caltech/WEBCAM", "Office Caltech/DSLR",
         "Office Caltech/AVERAGE"),
        {"FedAvg": _one(79.11, 79.07, 63.20, 22.19, 60.89, 56.70, 66.32, 43.10, 46.67, 53.20),
         "FedProx": _one(80.91, 78.97, 61.32, 25.37, 61.64, 55.80, 65.79, 50.00, 46.67, 54.57),
         "MOON": _one(83.18, 79.42, 61.25, 23.78, 61.91, 60.27, 68.95, 51.72, 50.00, 57.74),
         "FedSR": _one(75.41, 79.42, 62.49, 24.08, 60.35, 58.93, 64.74, 44.83, 53.33, 55.46),
         "FedProto": _one(79.87, 78.13, 60.83, 25.97, 61.20, 54.02, 62.63, 41.38, 50.00, 52.01),
         "FedGA": _one(80.17, 81.22, 49.27, 31.69, 60.59, 53.12, 57.89, 62.07, 66.67, 59.94),
         "FPL": _one(79.98, 79.47, 62.68, 26.22, 62.09, 58.93, 68.42, 53.45, 53.33, 58.53),
         "FedTGP": _one(80.20, 78.67, 61.22, 26.97, 61.77, 56.25, 65.79, 50.00, 53.33, 56.34),
         "FedLSA": _one(81.50, 76.63, 65.17, 30.95, 63.56, 55.80, 64.74, 60.34, 60.00, 60.22)}),
    PublishedTable(
        "fedprotokd", "table1", "TABLE I",
        "Server Test Accuracy (%) under Extreme and Moderate Heterogeneity on Heterogeneous Models",
        "the server model's test accuracy (%), mean of two runs (no std printed)",
        _FEDPROTOKD_COLS,
        {"Fed2PKD": _one(54.84, 24.98, 27.81, 15.70, 42.53, 31.20, 55.47, 19.10),
         "FedPKD": _one(62.58, 29.11, 60.58, 29.69, 68.52, 30.04, 70.12, 29.23),
         "FedProtoKD-zeta": _one(62.11, 30.23, 60.61, 29.05, 68.61, 31.76, 69.50, 30.15),
         "FedProtoKD": _one(63.49, 31.80, 61.97, 30.88, 69.45, 32.63, 71.31, 30.29)}),
    PublishedTable(
        "fedprotokd", "table2", "TABLE II",
        "Clients Test Accuracy (%) under Extreme and Moderate Heterogeneity on Heterogeneous Models",
        "the clients' test accuracy (%), mean of two runs (no std printed)",
        _FEDPROTOKD_COLS,
        {"FedProto": _one(87.16, 59.98, 89.38, 59.13, 79.51, 44.22, 82.54, 60.31),
         "FedTGP": _one(87.32, 60.42, 91.95, 60.03, 80.58, 44.74, 83.33, 60.65),
         "Fed2PKD": _one(78.95, 47.72, 76.37, 48.90, 71.57, 35.30, 78.48, 43.85),
         "FedPKD": _one(85.27, 59.92, 90.05, 60.27, 79.52, 42.04, 83.91, 59.80),
         "FedProtoKD-zeta": _one(86.09, 60.34, 91.54, 61.57, 80.51, 44.04, 83.66, 61.02),
         "FedProtoKD": _one(88.52, 61.44, 92.27, 61.87, 81.82, 45.58, 84.72, 61.94)}),
    PublishedTable(
        "fedsc", "table1", "Table 1",
        "Accuracy comparisons on several heterogeneous settings and datasets, NID1 α means Dirichlet distribution "
        "with ratio α.",
        "test accuracy (%), one number per method (no std printed)",
        _FEDSC_T1,
        {"FedAvg": _one(78.27, 84.65, 75.60, 55.97, 60.08, 54.56, 40.41, 42.84, 37.15, 47.40, 50.24, 45.21),
         "FedProx": _one(79.33, 84.59, 76.01, 56.27, 60.21, 54.29, 40.20, 42.16, 37.66, 47.06, 50.43, 45.86),
         "MOON": _one(80.23, 86.10, 77.35, 56.79, 61.48, 55.81, 40.23, 44.03, 38.25, 47.82, 51.12, 46.17),
         "FedNTD": _one(80.34, 86.23, 76.75, 57.12, 61.74, 56.33, 41.19, 43.92, 38.37, 48.23, 51.22, 47.14),
         "FedProto": _one(76.86, 83.90, 73.84, 52.48, 58.26, 52.60, 38.29, 41.02, 35.86, 45.31, 47.23, 43.37),
         "FedNH": _one(79.34, 85.25, 75.66, 57.64, 60.43, 55.70, 40.63, 43.20, 38.26, 48.54, 50.82, 46.06),
         "FedRCL": _one(81.30, 86.89, 78.32, 58.35, 62.36, 56.51, 41.48, 44.34, 38.81, 48.13, 51.35, 47.21),
         "FedCDA": _one(80.79, 87.11, 77.81, 58.12, 61.95, 56.62, 41.56, 44.27, 38.92, 47.95, 51.10, 46.97),
         "FedSC": _one(82.41, 88.13, 79.61, 59.18, 63.25, 57.83, 42.63, 45.10, 40.09, 49.62, 52.28, 48.03)}),
    PublishedTable(
        "fedsc", "table2", "Table 2",
        "Accuracy comparisons on several unbalanced settings and datasets, ρ means the ratio between sample sizes of "
        "the most frequent and least frequent class; all under NID1_0.2.",
        "test accuracy (%), one number per method (no std printed)",
        ("CIFAR10-LT/rho=10", "CIFAR10-LT/rho=50", "CIFAR10-LT/rho=100", "CIFAR10-LT/rho=200",
         "CIFAR100-LT/rho=10", "CIFAR100-LT/rho=50", "CIFAR100-LT/rho=100", "CIFAR100-LT/rho=200",
         "TinyImageNet-LT/rho=10", "TinyImageNet-LT/rho=50", "TinyImageNet-LT/rho=100", "TinyImageNet-LT/rho=200"),
        {"FedAvg": _one(75.94, 63.25, 52.97, 49.69, 45.88, 35.31, 32.48, 28.57, 28.80, 23.87, 21.33, 19.49),
         "FedProx": _one(75.17, 63.09, 52.45, 50.03, 45.49, 36.25, 31.67, 29.12, 29.21, 23.66, 20.82, 20.25),
         "MOON": _one(76.02, 63.65, 53.10, 49.93, 46.15, 37.81, 33.43, 30.75, 30.95, 24.89, 22.19, 20.68),
         "FedNTD": _one(76.10, 63.87, 52.79, 50.15, 46.52, 38.07, 33.64, 31.25, 30.17, 24.27, 22.58, 21.45),
         "FedProto": _one(72.49, 58.77, 49.54, 45.82, 42.26, 34.20, 31.80, 25.79, 25.35, 20.54, 19.65, 16.23),
         "FedNH": _one(75.31, 62.50, 52.38, 49.17, 45.59, 35.39, 32.35, 29.08, 28.18, 23.93, 21.19, 20.14),
         "FedRCL": _one(76.45, 64.11, 53.92, 50.08, 47.37, 38.70, 34.95, 32.76, 31.43, 25.26, 23.31, 22.16),
         "FedCDA": _one(76.26, 64.58, 54.49, 50.33, 47.56, 38.51, 35.28, 33.62, 31.22, 25.53, 23.42, 22.91),
         "FedSC": _one(77.31, 65.30, 56.34, 51.12, 49.10, 40.16, 36.52, 34.93, 32.57, 26.22, 25.15, 24.78)}),
    PublishedTable(
        "fedsap", "table1", "Table 1",
        "Top-1 accuracy (%, mean ± std, over 3 runs). Results are grouped by inference strategy.",
        "top-1 accuracy (%), mean ± std over 3 runs (seeds 1234-1236); classifier-head rows and prototype "
        "(nearest-centroid) rows",
        _FEDSAP_T1,
        {"FedAvg (head)": _pm(33.60, 15.12, 43.35, 14.93, 47.26, 18.05, 89.32, 0.79, 91.60, 0.88, 93.02, 0.48,
                              71.34, 0.55, 76.15, 0.80, 78.07, 0.75),
         "FedProto (head)": _pm(92.22, 2.08, 90.81, 1.46, 90.06, 0.65, 89.04, 1.84, 86.36, 0.75, 83.42, 1.06,
                                79.91, 0.59, 73.04, 0.97, 68.26, 0.82),
         "FedMPS (head)": _pm(92.65, 1.51, 91.10, 1.93, 90.15, 0.39, 87.63, 1.54, 84.08, 0.68, 81.71, 1.25,
                              77.75, 1.03, 72.41, 1.13, 67.63, 0.59),
         "FedSAP (head)": _pm(93.01, 1.97, 90.71, 1.76, 89.58, 0.58, 92.68, 1.29, 90.58, 0.56, 89.46, 0.63,
                              87.59, 0.26, 82.55, 0.75, 78.95, 0.88),
         "FedProto (proto)": _pm(92.19, 2.00, 90.68, 1.43, 89.56, 0.70, 89.84, 1.70, 87.01, 0.67, 84.11, 0.89,
                                 80.98, 0.43, 73.65, 0.88, 68.45, 0.87),
         "FedMPS (proto)": _pm(92.67, 1.52, 91.06, 1.99, 90.11, 0.35, 88.11, 1.60, 84.97, 0.73, 82.87, 1.42,
                               79.70, 0.64, 72.72, 1.11, 65.97, 0.54),
         "FedSAP (proto)": _pm(93.13, 1.96, 90.83, 1.74, 89.46, 0.45, 86.98, 2.65, 86.78, 0.67, 87.00, 0.38,
                               84.68, 0.22, 79.40, 0.66, 75.43, 0.89)}),
]}


def published_table(paper: str, table: str) -> PublishedTable:
    return TABLES[(paper, table)]


def entries() -> Iterator[Entry]:
    """Every published number, each with its paper, table, column, row, metric and source."""
    for t in TABLES.values():
        for row, cells in t.rows.items():
            for column, cell in zip(t.columns, cells, strict=True):
                if cell is not None:
                    yield Entry(t.paper, t.table, column, row, cell[0], cell[1], t.metric, t.source)
