"""A second reference loop: FedProto and FedAvg run the way HtFLlib / PFLlib run them, in one
process, every per-sample Python loop of theirs kept. ``bench/_plain.py`` stays the primary
reference (vectorised, the fairer and faster one); this one answers "against the loop people
actually use", on the same workload (cfg, partition, per-client initial models, lambda).

Followed, read in the stored copies of github.com/TsingZ0/PFLlib and github.com/TsingZ0/HtFLlib:

- ``PFLlib system/flcore/clients/clientbase.py`` ``Client``: one model and one SGD optimizer per
  client, kept across rounds; ``load_train_data`` = ``DataLoader(batch_size, drop_last=True,
  shuffle=True)``, ``load_test_data`` = ``DataLoader(batch_size, drop_last=False, shuffle=True)``,
  both rebuilt at every call over ``read_client_data``'s list of per-sample ``(x, y)`` tuples
  (``system/utils/data_utils.py``); ``set_parameters`` (``param.data = new.data.clone()``);
  ``test_metrics`` (argmax accuracy plus the micro AUC: ``label_binarize`` and
  ``metrics.roc_auc_score`` over the numpy'd outputs); ``train_metrics`` (the no-grad forward
  over the whole training loader, ``loss.item() * len(y)``).
- ``PFLlib system/flcore/clients/clientavg.py`` ``clientAVG.train``: ``model(x)``, CE, zero_grad,
  backward, step.
- ``PFLlib system/flcore/servers/serverbase.py`` ``Server``: ``select_clients``
  (``np.random.choice(clients, n, replace=False)``), ``send_models``, ``receive_models``
  (``random.sample`` of the selected, weights ``train_samples / total``), ``aggregate_parameters``
  / ``add_parameters`` (``deepcopy`` of the first upload, parameters zeroed, ``+= clone() * w``),
  ``evaluate`` (``test_metrics()`` of every client, then ``train_metrics()`` of every client).
- ``PFLlib system/flcore/servers/serveravg.py`` ``FedAvg.train``: per round ``select_clients``,
  ``send_models``, ``evaluate`` (*before* training: round i evaluates the state after i-1 rounds),
  every selected client's ``train``, ``receive_models``, ``aggregate_parameters``; the round time
  (``Budget``) spans all of it.
- ``PFLlib system/flcore/clients/clientproto.py`` (= ``HtFLlib system/flcore/clients/clientproto.py``)
  ``clientProto.train``: ``rep = model.base(x)``, ``output = model.head(rep)``, CE; with global
  prototypes ``proto_new = copy.deepcopy(rep.detach())``, row i replaced by the global prototype
  of ``y[i].item()`` (one sample at a time, classes without one left as they are), ``+ lamda *
  MSELoss(proto_new, rep)``; every ``rep[i, :].detach().data`` appended to a
  ``defaultdict(list)`` one sample at a time; ``agg_func`` (the Python-loop mean per class);
  ``test_metrics`` (no global prototypes: ``(0, 1e-5, 0)``; else ``output[i, j] =
  MSELoss(rep[i], proto_j)`` for every test sample i and every global class j, argmin);
  ``train_metrics`` (CE plus the same per-sample prototype loss, no grad).
- ``PFLlib system/flcore/servers/serverproto.py`` ``FedProto.train`` / ``evaluate`` /
  ``receive_protos`` / ``send_protos`` and ``proto_aggregation`` (= HtFLlib's): evaluate before
  training, every client trains, the per-class mean over the clients holding the class (uniform
  over clients), the same ``defaultdict`` handed to every client.

Where this departs, necessarily or by choice:

- Models: our ``ProtoModel`` (built by ``build_client_model`` with ``_plain.py``'s per-client
  seeds; FedAvg's global model from the platform's server spec), its ``features()`` standing for
  HtFLlib's ``BaseHeadSplit.base`` and its ``head`` for ``.head``. HtFLlib seeds every client's
  model with ``torch.manual_seed(0)``; we keep ``_plain.py``'s seeds so accuracies compare.
- SGD takes the config's lr / momentum / weight decay (theirs: lr only; equal at the workload's
  momentum 0, weight decay 0); lr decay off, as their default.
- Data: the client's tensors come from ``load_dataset`` / ``make_partition`` in memory; the
  per-call list of ``(x, y)`` tuples and ``DataLoader`` are rebuilt as ``read_client_data`` does,
  but the ``.npz`` file read and decompression it starts with are skipped (favours this loop).
- HtFLlib (not PFLlib) keeps models, prototypes and the global prototypes on disk
  (``save_item`` / ``load_item``: ``torch.save`` / ``torch.load`` at every train, test_metrics
  and train_metrics call), loads training data with ``shuffle=False`` and has ``train_metrics``
  commented out of ``serverbase.evaluate``; we follow PFLlib's in-memory clients, shuffled
  loader and evaluate (FedAvg exists only in PFLlib), so the two methods share one loop.
- Their per-client ``print`` lines, slow-client simulation, DLG and time-threshold bookkeeping
  are left out; clients train in ``select_clients``' (seeded) random order.
- Reported accuracy: the timed ``evaluate()`` of round r sees the state after r-1 rounds (and
  FedProto's gives the prototype accuracy only), so after each timed round an untimed, vectorised
  evaluation (as ``_plain.py``'s) records head and prototype accuracy after r rounds.
- ``startup_s``: from the call to the end of the first client's ``train()``, not counting the
  round-0 ``evaluate()`` that precedes it there.
"""

from __future__ import annotations

import copy
import random
import time
from collections import defaultdict

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
    """Per-client models as ``_plain.py`` builds them (same seeds), contiguous, as HtFLlib's."""
    m, t = cfg.model, cfg.training
    proto = cfg.algorithm.name != "fedavg"
    out = []
    for split in part.clients:
        torch.manual_seed(cfg.seed * 100_003 + split.client_id)
        model = build_client_model(m.group, split.client_id, ds.channels, ds.image_size, ds.num_classes, m.feature_dim,
                                   m.projector, m.normalize_features).to(dev)
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


def run_htfllib(cfg: ExperimentConfig, device: str = "cpu", echo=print) -> PlainResult:
    """HtFLlib/PFLlib's FedProto or FedAvg round loop over ``cfg``'s workload, one process."""
    t0 = time.perf_counter()
    dev = torch.device(device)
    ds = load_dataset(cfg.data, cfg.seed)
    part = make_partition(ds, cfg.data.partition, cfg.federation.num_clients, cfg.seed, cfg.data.test_fraction,
                          global_test_fraction=cfg.data.global_test_fraction, public_size=cfg.data.public_size,
                          long_tail_ratio=cfg.data.long_tail_ratio)
    clients = _clients(cfg, ds, part, dev)
    fedavg = cfg.algorithm.name == "fedavg"
    global_model = _global_model(cfg, ds, dev) if fedavg else None
    global_protos = None
    np_rng, py_rng = np.random.RandomState(cfg.seed), random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)  # the loaders' shuffles
    n_join = max(1, int(len(clients) * cfg.federation.participation))
    out = PlainResult(startup_s=float("nan"))
    setup_s = time.perf_counter() - t0
    for rnd in range(cfg.federation.rounds):
        r0 = time.perf_counter()
        selected = [clients[i] for i in np_rng.choice(len(clients), n_join, replace=False)]  # select_clients
        if fedavg:
            for c in clients:  # send_models
                c.set_parameters(global_model)
        evaluate(clients)
        for c in selected:
            c0 = time.perf_counter()
            c.train()
            if rnd == 0 and c is selected[0]:
                out.startup_s = setup_s + time.perf_counter() - c0
        if fedavg:
            global_model = aggregate_parameters(py_rng.sample(selected, len(selected)))  # receive_models
        else:
            global_protos = proto_aggregation([c.protos for c in selected])  # receive_protos
            for c in clients:  # send_protos
                c.set_protos(global_protos)
        out.round_s.append(time.perf_counter() - r0)
        head, proto = _accuracy(clients, global_model, global_protos)
        out.head_acc.append(head)
        out.proto_acc.append(proto)
        echo(f"  htfllib round {rnd + 1}: {out.round_s[-1]:.1f} s, head acc {head:.4f}")
    return out
