"""A MODEL of the loop HtFLlib / PFLlib run (FedProto, FedAvg): their code re-written over this
repo's workload in one process, every per-sample Python loop of theirs kept. It is not their
code; ``bench/results/htfllib_calibration.md`` gives how far its round time is from the real
HtFLlib code's on the same partition and model. ``bench/_plain.py`` stays the primary reference
(vectorised, the fairer and faster one); this one answers "against the loop people actually use",
on the same workload (cfg, partition, initial models, lambda).

Two flavours (``run_htfllib(..., flavour=)``):

- ``"htfllib"`` (FedProto's default): HtFLlib's FedProto as its code runs it, every difference
  from PFLlib below kept; calibrated against the real code.
- ``"pfllib"`` (FedAvg's only one: FedAvg exists in PFLlib, not HtFLlib; FedProto's before issue
  24): PFLlib's in-memory clients. For FedProto this flavour did more work per round than
  HtFLlib does (``train_metrics``, a no-grad pass over every client's training set, in every
  ``evaluate()``) and less (no disk round trips, no ``.npz`` reads); measured against the real
  HtFLlib FedProto loop it was 1.4x slower per round (issue 24; the calibration file).

Followed for ``"htfllib"``, read in the stored copies of github.com/TsingZ0/HtFLlib ``system/``:

- ``main.py``: no ``torch.set_num_threads``: torch's default intra-op thread count (every core);
  this module sets none either, so it runs at the thread count of the process calling it.
  ``eval_gap`` 1: ``evaluate()`` every round.
- ``flcore/servers/serverproto.py`` ``FedProto.train``: per round ``select_clients``;
  ``evaluate()`` *before* training (``i % eval_gap == 0``); every selected client's ``train()``
  in turn (the thread version is commented out); ``receive_protos`` (each client's prototypes
  ``load_item``'d from disk, ``proto_aggregation``, the result ``save_item``'d as the server's
  ``global_protos``). The round time (``Budget``) spans all of it, evaluation included.
- ``flcore/servers/serverbase.py`` ``Server.evaluate``: every client's ``test_metrics()`` only
  (``train_metrics`` is commented out there); ``select_clients``:
  ``np.random.choice(clients, n, replace=False)``.
- ``flcore/clients/clientbase.py``: ``load_train_data`` = ``DataLoader(read_client_data(...),
  batch_size, drop_last=True, shuffle=False)``, ``load_test_data`` the same with
  ``drop_last=False, shuffle=False``, both rebuilt at every call; ``save_item`` / ``load_item``
  = ``torch.save`` / ``torch.load`` of whole objects (the model, the prototypes) in a folder per
  run; ``Client.__init__`` builds the model and ``save_item``s it.
- ``utils/data_utils.py`` ``read_client_data``: ``np.load(allow_pickle=True)['data'].tolist()``
  of the client's ``.npz`` (written by ``np.savez_compressed(f, data={'x', 'y'})``, PFLlib's
  ``dataset/utils/dataset_utils.py`` ``save_file``), ``torch.Tensor(x).type(float32)``, then a
  list of per-sample ``(x, y)`` tuples: at every loader build.
- ``flcore/clients/clientproto.py`` ``clientProto.train``: ``load_train_data``, ``load_item`` of
  its model and of the global prototypes, a new ``SGD`` each call, ``rep = model.base(x)``,
  ``output = model.head(rep)``, CE; with global prototypes ``proto_new =
  copy.deepcopy(rep.detach())``, row i replaced by the global prototype of ``y[i].item()`` (one
  sample at a time, classes without one left as they are), ``+ lamda * MSELoss(proto_new,
  rep)``; every ``rep[i, :].detach().data`` appended to a ``defaultdict(list)`` one sample at a
  time; ``save_item`` of ``agg_func(protos)`` and of the model. ``test_metrics``: loader, model
  and global prototypes loaded (also in round 1, which has none: ``(0, 1e-5, 0)``), else
  ``output[i, j] = MSELoss(rep[i], proto_j)`` for every test sample i and class j, argmin.

Followed for ``"pfllib"``, read in the stored copies of github.com/TsingZ0/PFLlib ``system/``:

- ``flcore/clients/clientbase.py`` ``Client``: one model and one SGD optimizer per client, kept
  in memory across rounds; ``load_train_data`` = ``DataLoader(batch_size, drop_last=True,
  shuffle=True)``, ``load_test_data`` = ``DataLoader(batch_size, drop_last=False,
  shuffle=True)``, both rebuilt at every call over ``read_client_data``'s list of per-sample
  ``(x, y)`` tuples; ``set_parameters`` (``param.data = new.data.clone()``); ``test_metrics``
  (argmax accuracy plus the micro AUC: ``label_binarize`` and ``metrics.roc_auc_score`` over the
  numpy'd outputs); ``train_metrics`` (the no-grad forward over the whole training loader,
  ``loss.item() * len(y)``).
- ``flcore/clients/clientavg.py`` ``clientAVG.train``: ``model(x)``, CE, zero_grad, backward, step.
- ``flcore/servers/serverbase.py`` ``Server``: ``select_clients``, ``send_models``,
  ``receive_models`` (``random.sample`` of the selected, weights ``train_samples / total``),
  ``aggregate_parameters`` / ``add_parameters`` (``deepcopy`` of the first upload, parameters
  zeroed, ``+= clone() * w``), ``evaluate`` (``test_metrics()`` of every client, then
  ``train_metrics()`` of every client).
- ``flcore/servers/serveravg.py`` ``FedAvg.train``: per round ``select_clients``,
  ``send_models``, ``evaluate`` (before training), every selected client's ``train``,
  ``receive_models``, ``aggregate_parameters``; ``Budget`` spans all of it.
- ``flcore/clients/clientproto.py`` / ``flcore/servers/serverproto.py`` (FedProto, pfllib flavour):
  the same per-sample loops as HtFLlib's, in memory, plus ``train_metrics`` (CE plus the same
  per-sample prototype loss, no grad) in every ``evaluate()``.

Where both flavours depart, necessarily or by choice:

- Models: our ``ProtoModel`` (built by ``build_client_model`` with ``_plain.py``'s initial
  weights; FedAvg's global model from the platform's server spec), its ``features()`` standing for
  ``BaseHeadSplit.base`` and its ``head`` for ``.head``. HtFLlib seeds every client's model with
  ``torch.manual_seed(0)``: ``model.init: shared`` (the default) is that rule with the run's seed;
  we follow ``model.init`` as ``_plain.py`` does so accuracies compare.
- SGD takes the config's lr / momentum / weight decay (theirs: lr only; equal at the workload's
  momentum 0, weight decay 0); lr decay off, as their default.
- Data: ``"pfllib"`` takes the client's tensors from ``load_dataset`` / ``make_partition`` in
  memory and skips the ``.npz`` read (it rebuilds the per-call list of tuples and the
  ``DataLoader``); ``"htfllib"`` writes each client's split as HtFLlib's ``.npz`` files at setup
  (untimed, HtFLlib's offline dataset generation) and reads them at every loader build.
- ``"htfllib"`` keeps its items in a temporary folder (HtFLlib: ``system/temp/...``) and loads
  them with ``weights_only=False`` (HtFLlib's bare ``torch.load`` fails on torch >= 2.6 without it).
- Their per-client ``print`` lines, slow-client simulation, DLG and time-threshold bookkeeping
  are left out; clients train in ``select_clients``' (seeded) random order.
- Reported accuracy: the timed ``evaluate()`` of round r sees the state after r-1 rounds (and
  FedProto's gives the prototype accuracy only), so after each timed round an untimed, vectorised
  evaluation (as ``_plain.py``'s) records head and prototype accuracy after r rounds.
- ``startup_s``: from the call to the end of the first client's ``train()``, not counting the
  round-0 ``evaluate()`` that precedes it there (nor, for ``"htfllib"``, the ``.npz`` writing).
"""

from __future__ import annotations

import copy
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from _plain import PlainResult
from sklearn import metrics
from sklearn.preprocessing import label_binarize
from torch import nn
from torch.utils.data import DataLoader

from rayfed_proto.config import ExperimentConfig
from rayfed_proto.data import load_dataset, make_partition
from rayfed_proto.models import build_client_model


class _Client:
    """PFLlib's ``Client``: its model and optimizer live across rounds; loaders are rebuilt per call."""

    def __init__(self, cid, model, opt, x, y, tx, ty, batch_size, local_epochs, num_classes, device):
        self.id, self.model, self.optimizer = cid, model, opt
        self.x, self.y, self.tx, self.ty = x, y, tx, ty
        self.train_samples, self.test_samples = len(y), len(ty)
        self.batch_size, self.local_epochs, self.num_classes = batch_size, local_epochs, num_classes
        self.device = device
        self.loss = nn.CrossEntropyLoss()

    def load_train_data(self):  # read_client_data's list of (x, y) tuples, then their loader
        return DataLoader([(a, b) for a, b in zip(self.x, self.y, strict=True)], self.batch_size,
                          drop_last=True, shuffle=True)

    def load_test_data(self):
        return DataLoader([(a, b) for a, b in zip(self.tx, self.ty, strict=True)], self.batch_size,
                          drop_last=False, shuffle=True)

    def set_parameters(self, model):
        for new_param, old_param in zip(model.parameters(), self.model.parameters(), strict=True):
            old_param.data = new_param.data.clone()


class _ClientAVG(_Client):
    def train(self):  # clientavg.py clientAVG.train
        trainloader = self.load_train_data()
        self.model.train()
        for _ in range(self.local_epochs):
            for x, y in trainloader:
                x, y = x.to(self.device), y.to(self.device)
                output = self.model(x)
                loss = self.loss(output, y)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()

    def test_metrics(self):  # clientbase.py Client.test_metrics
        testloaderfull = self.load_test_data()
        self.model.eval()
        test_acc = test_num = 0
        y_prob, y_true = [], []
        with torch.no_grad():
            for x, y in testloaderfull:
                x, y = x.to(self.device), y.to(self.device)
                output = self.model(x)
                test_acc += (torch.sum(torch.argmax(output, dim=1) == y)).item()
                test_num += y.shape[0]
                y_prob.append(output.detach().cpu().numpy())
                nc = self.num_classes + 1 if self.num_classes == 2 else self.num_classes
                lb = label_binarize(y.detach().cpu().numpy(), classes=np.arange(nc))
                y_true.append(lb[:, :2] if self.num_classes == 2 else lb)
        auc = metrics.roc_auc_score(np.concatenate(y_true, axis=0), np.concatenate(y_prob, axis=0), average="micro")
        return test_acc, test_num, auc

    def train_metrics(self):  # clientbase.py Client.train_metrics
        trainloader = self.load_train_data()
        self.model.eval()
        train_num = losses = 0
        with torch.no_grad():
            for x, y in trainloader:
                x, y = x.to(self.device), y.to(self.device)
                loss = self.loss(self.model(x), y)
                train_num += y.shape[0]
                losses += loss.item() * y.shape[0]
        return losses, train_num


class _ClientProto(_Client):
    def __init__(self, *args, lamda: float):
        super().__init__(*args)
        self.protos = self.global_protos = None
        self.loss_mse = nn.MSELoss()
        self.lamda = lamda

    def _proto_loss(self, rep, y):  # proto_new: rep with each row replaced by its class's global prototype
        proto_new = copy.deepcopy(rep.detach())
        for i, yy in enumerate(y):
            y_c = yy.item()
            if not isinstance(self.global_protos[y_c], list):  # defaultdict(list): [] where no prototype
                proto_new[i, :] = self.global_protos[y_c].data
        return self.loss_mse(proto_new, rep) * self.lamda

    def train(self):  # clientproto.py clientProto.train
        trainloader = self.load_train_data()
        self.model.train()
        protos = defaultdict(list)
        for _ in range(self.local_epochs):
            for x, y in trainloader:
                x, y = x.to(self.device), y.to(self.device)
                rep = self.model.features(x)  # model.base(x)
                output = self.model.head(rep)
                loss = self.loss(output, y)
                if self.global_protos is not None:
                    loss += self._proto_loss(rep, y)
                for i, yy in enumerate(y):
                    y_c = yy.item()
                    protos[y_c].append(rep[i, :].detach().data)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
        self.protos = agg_func(protos)

    def set_protos(self, global_protos):
        self.global_protos = global_protos

    def test_metrics(self):  # clientproto.py clientProto.test_metrics: nearest global prototype by MSE
        testloaderfull = self.load_test_data()
        self.model.eval()
        if self.global_protos is None:
            return 0, 1e-5, 0
        test_acc = test_num = 0
        with torch.no_grad():
            for x, y in testloaderfull:
                x, y = x.to(self.device), y.to(self.device)
                rep = self.model.features(x)
                output = float("inf") * torch.ones(y.shape[0], self.num_classes).to(self.device)
                for i, r in enumerate(rep):
                    for j, pro in self.global_protos.items():
                        if not isinstance(pro, list):
                            output[i, j] = self.loss_mse(r, pro)
                test_acc += (torch.sum(torch.argmin(output, dim=1) == y)).item()
                test_num += y.shape[0]
        return test_acc, test_num, 0

    def train_metrics(self):  # clientproto.py clientProto.train_metrics
        trainloader = self.load_train_data()
        self.model.eval()
        train_num = losses = 0
        with torch.no_grad():
            for x, y in trainloader:
                x, y = x.to(self.device), y.to(self.device)
                rep = self.model.features(x)
                loss = self.loss(self.model.head(rep), y)
                if self.global_protos is not None:
                    loss += self._proto_loss(rep, y)
                train_num += y.shape[0]
                losses += loss.item() * y.shape[0]
        return losses, train_num


def agg_func(protos):  # clientproto.py agg_func (from yuetan031/fedproto lib/utils.py)
    for label, proto_list in protos.items():
        if len(proto_list) > 1:
            proto = 0 * proto_list[0].data
            for i in proto_list:
                proto += i.data
            protos[label] = proto / len(proto_list)
        else:
            protos[label] = proto_list[0]
    return protos


def proto_aggregation(local_protos_list):  # serverproto.py proto_aggregation
    agg_protos_label = defaultdict(list)
    for local_protos in local_protos_list:
        for label in local_protos.keys():
            agg_protos_label[label].append(local_protos[label])
    for label, proto_list in agg_protos_label.items():
        if len(proto_list) > 1:
            proto = 0 * proto_list[0].data
            for i in proto_list:
                proto += i.data
            agg_protos_label[label] = proto / len(proto_list)
        else:
            agg_protos_label[label] = proto_list[0].data
    return agg_protos_label


def evaluate(clients) -> tuple[float, float]:
    """serverbase.py ``Server.evaluate`` (serverproto's override drops only the AUC): every client's
    test_metrics, then every client's train_metrics; (test accuracy, train loss)."""
    stats = [c.test_metrics() for c in clients]
    stats_train = [c.train_metrics() for c in clients]
    test_acc = sum(s[0] for s in stats) * 1.0 / sum(s[1] for s in stats)
    train_loss = sum(s[0] for s in stats_train) * 1.0 / sum(s[1] for s in stats_train)
    return test_acc, train_loss


def aggregate_parameters(uploads):
    """serverbase.py receive_models + aggregate_parameters: weights train_samples / total."""
    tot = sum(c.train_samples for c in uploads)
    global_model = copy.deepcopy(uploads[0].model)
    for param in global_model.parameters():
        param.data.zero_()
    for c in uploads:
        w = c.train_samples / tot
        for server_param, client_param in zip(global_model.parameters(), c.model.parameters(), strict=True):
            server_param.data += client_param.data.clone() * w
    return global_model


def _clients(cfg: ExperimentConfig, ds, part, dev) -> list[_Client]:
    """Per-client models as ``_plain.py`` builds them (same ``model.init``), contiguous, as HtFLlib's."""
    m, t = cfg.model, cfg.training
    proto = cfg.algorithm.name != "fedavg"
    out = []
    for split in part.clients:
        torch.manual_seed(cfg.seed * 100_003 + split.client_id)
        model = build_client_model(m.group, split.client_id, ds.channels, ds.image_size, ds.num_classes, m.feature_dim,
                                   m.projector, m.normalize_features,
                                   shared_seed=cfg.seed if m.init == "shared" else None).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
        args = (split.client_id, model, opt, *ds.tensors(split.train_idx), *ds.tensors(split.test_idx),
                t.batch_size, t.local_epochs, ds.num_classes, dev)
        out.append(_ClientProto(*args, lamda=float(cfg.algorithm_options().lam)) if proto else _ClientAVG(*args))
    return out


def _global_model(cfg: ExperimentConfig, ds, dev):
    """FedAvg's initial global model: the platform server's (same seed, same builder), as ``_plain.py``."""
    from rayfed_proto.runtime.core import federation_spec

    torch.manual_seed(cfg.seed)
    return federation_spec(cfg, ds.num_classes, ds.channels, ds.image_size).build_model().to(dev)


def _accuracy(clients, global_model, global_protos) -> tuple[float, float]:
    """Untimed, vectorised: head accuracy (FedAvg: the global model) and prototype accuracy."""
    head = proto = n = 0
    bank = None
    if global_protos:
        keys = [k for k, v in global_protos.items() if not isinstance(v, list)]
        bank = (torch.stack([global_protos[k] for k in keys]), torch.tensor(keys))
    with torch.no_grad():
        for c in clients:
            model = global_model if global_model is not None else c.model
            model.eval()
            feats, logits = model.forward_features(c.tx.to(c.device))
            ty = c.ty.to(c.device)
            head += int((logits.argmax(1) == ty).sum())
            if bank is not None:
                proto += int((bank[1].to(c.device)[torch.cdist(feats, bank[0]).argmin(1)] == ty).sum())
            n += len(ty)
    return head / n, (proto / n if bank is not None else float("nan"))


# ------------------------------------------------------------------ the "htfllib" flavour (FedProto)


class _Disk:
    """HtFLlib's disk: ``clientbase.py`` ``save_item`` / ``load_item`` and ``data_utils.py``
    ``read_client_data`` over the client's ``.npz`` files, all in one folder per run."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def save_item(self, item, role, item_name):
        torch.save(item, self.root / f"Client{role}_{item_name}.pt")

    def load_item(self, role, item_name):
        try:
            return torch.load(self.root / f"Client{role}_{item_name}.pt", weights_only=False)
        except FileNotFoundError:
            return None

    def _npz(self, cid: int, is_train: bool) -> Path:
        return self.root / ("train" if is_train else "test") / f"{cid}.npz"

    def write_client_data(self, cid: int, is_train: bool, x: torch.Tensor, y: torch.Tensor):
        """PFLlib/HtFLlib ``dataset/utils/dataset_utils.py`` ``save_file`` (offline, untimed)."""
        path = self._npz(cid, is_train)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            np.savez_compressed(f, data={"x": x.numpy(), "y": y.numpy()})

    def read_client_data(self, cid: int, is_train: bool):
        """``data_utils.py`` ``read_data`` + ``read_client_data`` (image datasets)."""
        with open(self._npz(cid, is_train), "rb") as f:
            data = np.load(f, allow_pickle=True)["data"].tolist()
        x = torch.Tensor(data["x"]).type(torch.float32)
        y = torch.Tensor(data["y"]).type(torch.int64)
        return [(a, b) for a, b in zip(x, y)]  # noqa: B905 (theirs)


class _HtClientProto:
    """HtFLlib's ``clientProto``: model, prototypes and global prototypes live on disk."""

    def __init__(self, cid, disk: _Disk, train_samples, test_samples, batch_size, local_epochs, num_classes, opt_kw,
                 lamda, device):
        self.id, self.role, self.disk = cid, f"Client_{cid}", disk
        self.train_samples, self.test_samples = train_samples, test_samples
        self.batch_size, self.local_epochs, self.num_classes = batch_size, local_epochs, num_classes
        self.opt_kw, self.lamda, self.device = opt_kw, lamda, device
        self.loss, self.loss_mse = nn.CrossEntropyLoss(), nn.MSELoss()

    def load_train_data(self):
        return DataLoader(self.disk.read_client_data(self.id, True), self.batch_size, drop_last=True, shuffle=False)

    def load_test_data(self):
        return DataLoader(self.disk.read_client_data(self.id, False), self.batch_size, drop_last=False, shuffle=False)

    def train(self):  # clientproto.py clientProto.train
        trainloader = self.load_train_data()
        model = self.disk.load_item(self.role, "model")
        global_protos = self.disk.load_item("Server", "global_protos")
        optimizer = torch.optim.SGD(model.parameters(), **self.opt_kw)
        model.train()
        protos = defaultdict(list)
        for _ in range(self.local_epochs):
            for x, y in trainloader:
                x, y = x.to(self.device), y.to(self.device)
                rep = model.features(x)  # model.base(x)
                output = model.head(rep)
                loss = self.loss(output, y)
                if global_protos is not None:
                    proto_new = copy.deepcopy(rep.detach())
                    for i, yy in enumerate(y):
                        y_c = yy.item()
                        if not isinstance(global_protos[y_c], list):
                            proto_new[i, :] = global_protos[y_c].data
                    loss += self.loss_mse(proto_new, rep) * self.lamda
                for i, yy in enumerate(y):
                    y_c = yy.item()
                    protos[y_c].append(rep[i, :].detach().data)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        self.disk.save_item(agg_func(protos), self.role, "protos")
        self.disk.save_item(model, self.role, "model")

    def test_metrics(self):  # clientproto.py clientProto.test_metrics
        testloader = self.load_test_data()
        model = self.disk.load_item(self.role, "model")
        global_protos = self.disk.load_item("Server", "global_protos")
        model.eval()
        test_acc = test_num = 0
        if global_protos is None:
            return 0, 1e-5, 0
        with torch.no_grad():
            for x, y in testloader:
                x, y = x.to(self.device), y.to(self.device)
                rep = model.features(x)
                output = float("inf") * torch.ones(y.shape[0], self.num_classes).to(self.device)
                for i, r in enumerate(rep):
                    for j, pro in global_protos.items():
                        if not isinstance(pro, list):
                            output[i, j] = self.loss_mse(r, pro)
                test_acc += (torch.sum(torch.argmin(output, dim=1) == y)).item()
                test_num += y.shape[0]
        return test_acc, test_num, 0


def _ht_evaluate(clients) -> float:
    """HtFLlib serverbase.py ``Server.evaluate``: every client's ``test_metrics()`` (``train_metrics``
    is commented out there); the prints left out."""
    stats = [c.test_metrics() for c in clients]
    accs = [s[0] / s[1] for s in stats]
    np.std(accs)  # printed there, as the test AUC
    return sum(s[0] for s in stats) * 1.0 / sum(s[1] for s in stats)


# ------------------------------------------------------------------------------------- the loops


def _workload(cfg: ExperimentConfig):
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, cfg.federation.num_clients, cfg.seed, cfg.data.test_fraction,
                          global_test_fraction=cfg.data.global_test_fraction, public_size=cfg.data.public_size,
                          long_tail_ratio=cfg.data.long_tail_ratio)
    return ds, part


class _PflLoop:
    """PFLlib's FedProto / FedAvg round (``"pfllib"``), in memory."""

    flavour = "pfllib"

    def __init__(self, cfg: ExperimentConfig, device: str = "cpu"):
        self.dev = torch.device(device)
        ds, part = _workload(cfg)
        self.clients = _clients(cfg, ds, part, self.dev)
        self.fedavg = cfg.algorithm.name == "fedavg"
        self.global_model = _global_model(cfg, ds, self.dev) if self.fedavg else None
        self.global_protos = None
        self.np_rng, self.py_rng = np.random.RandomState(cfg.seed), random.Random(cfg.seed)
        torch.manual_seed(cfg.seed)  # the loaders' shuffles
        self.n_join = max(1, int(len(self.clients) * cfg.federation.participation))
        self.untimed_s = 0.0

    def round(self) -> float:
        r0 = time.perf_counter()
        clients = self.clients
        selected = [clients[i] for i in self.np_rng.choice(len(clients), self.n_join, replace=False)]  # select_clients
        if self.fedavg:
            for c in clients:  # send_models
                c.set_parameters(self.global_model)
        evaluate(clients)
        for c in selected:
            c0 = time.perf_counter()
            c.train()
            if c is selected[0]:
                self.first_train_s = time.perf_counter() - c0
        if self.fedavg:
            self.global_model = aggregate_parameters(self.py_rng.sample(selected, len(selected)))  # receive_models
        else:
            self.global_protos = proto_aggregation([c.protos for c in selected])  # receive_protos
            for c in clients:  # send_protos
                c.set_protos(self.global_protos)
        return time.perf_counter() - r0

    def accuracy(self) -> tuple[float, float]:
        return _accuracy(self.clients, self.global_model, self.global_protos)

    def close(self):
        pass


class _HtLoop:
    """HtFLlib's FedProto round (``"htfllib"``): items and data on disk, evaluate = test_metrics."""

    flavour = "htfllib"

    def __init__(self, cfg: ExperimentConfig, device: str = "cpu", root: str | None = None):
        if cfg.algorithm.name != "fedproto":
            raise ValueError(f"the htfllib flavour models HtFLlib's FedProto only, not {cfg.algorithm.name!r}")
        self.dev = torch.device(device)
        self._tmp = tempfile.TemporaryDirectory(prefix="htfllib_model_", dir=root)
        self.disk = disk = _Disk(Path(self._tmp.name))
        ds, part = _workload(cfg)
        w0 = time.perf_counter()
        self.eval_sets = []
        for split in part.clients:  # HtFLlib's offline dataset generation: untimed
            (x, y), (tx, ty) = ds.tensors(split.train_idx), ds.tensors(split.test_idx)
            disk.write_client_data(split.client_id, True, x, y)
            disk.write_client_data(split.client_id, False, tx, ty)
            self.eval_sets.append((split.client_id, tx.to(self.dev), ty.to(self.dev)))
        self.untimed_s = time.perf_counter() - w0
        t, lam = cfg.training, float(cfg.algorithm_options().lam)
        opt_kw = {"lr": t.lr, "momentum": t.momentum, "weight_decay": t.weight_decay}
        self.clients = []
        for c in _clients(cfg, ds, part, self.dev):  # serverbase.set_clients + Client.__init__: save_item(model)
            n_train, n_test = len(disk.read_client_data(c.id, True)), len(disk.read_client_data(c.id, False))
            disk.save_item(c.model, f"Client_{c.id}", "model")
            self.clients.append(_HtClientProto(c.id, disk, n_train, n_test, t.batch_size, t.local_epochs,
                                               ds.num_classes, opt_kw, lam, self.dev))
        self.np_rng = np.random.RandomState(cfg.seed)
        self.n_join = max(1, int(len(self.clients) * cfg.federation.participation))

    def round(self) -> float:  # serverproto.py FedProto.train, one iteration
        r0 = time.perf_counter()
        clients = self.clients
        selected = [clients[i] for i in self.np_rng.choice(len(clients), self.n_join, replace=False)]  # select_clients
        self.eval_acc = _ht_evaluate(clients)  # eval_gap 1; what HtFLlib appends to rs_test_acc
        for c in selected:
            c0 = time.perf_counter()
            c.train()
            if c is selected[0]:
                self.first_train_s = time.perf_counter() - c0
        uploaded = [self.disk.load_item(c.role, "protos") for c in selected]  # receive_protos
        self.disk.save_item(proto_aggregation(uploaded), "Server", "global_protos")
        return time.perf_counter() - r0

    def accuracy(self) -> tuple[float, float]:
        views = [SimpleNamespace(model=self.disk.load_item(f"Client_{cid}", "model"), tx=tx, ty=ty, device=self.dev)
                 for cid, tx, ty in self.eval_sets]
        return _accuracy(views, None, self.disk.load_item("Server", "global_protos"))

    def close(self):
        self._tmp.cleanup()


FLAVOURS = ("htfllib", "pfllib")


def default_flavour(cfg: ExperimentConfig) -> str:
    """``"htfllib"`` for FedProto (HtFLlib's own), ``"pfllib"`` for FedAvg (only PFLlib has it)."""
    return "htfllib" if cfg.algorithm.name == "fedproto" else "pfllib"


def make_loop(cfg: ExperimentConfig, device: str = "cpu", flavour: str | None = None):
    """The round loop of ``flavour`` (default: ``default_flavour(cfg)``) over ``cfg``'s workload,
    set up; each ``.round()`` runs and times one round as their ``Budget`` does."""
    flavour = flavour or default_flavour(cfg)
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    return _HtLoop(cfg, device) if flavour == "htfllib" else _PflLoop(cfg, device)


def run_htfllib(cfg: ExperimentConfig, device: str = "cpu", echo=print, flavour: str | None = None) -> PlainResult:
    """The model of HtFLlib's (``"htfllib"``, FedProto's default) or PFLlib's (``"pfllib"``) round
    loop over ``cfg``'s workload, one process, torch's thread count as the caller left it."""
    t0 = time.perf_counter()
    loop = make_loop(cfg, device, flavour)
    out = PlainResult(startup_s=float("nan"))
    out.flavour, out.threads = loop.flavour, torch.get_num_threads()
    try:
        setup_s = time.perf_counter() - t0 - loop.untimed_s
        for rnd in range(cfg.federation.rounds):
            out.round_s.append(loop.round())
            if rnd == 0:
                out.startup_s = setup_s + loop.first_train_s
            head, proto = loop.accuracy()
            out.head_acc.append(head)
            out.proto_acc.append(proto)
            echo(f"  htfllib model ({loop.flavour}) round {rnd + 1}: {out.round_s[-1]:.1f} s, head acc {head:.4f}")
    finally:
        loop.close()
    return out
