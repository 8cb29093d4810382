"""``model.weights``: a state_dict file the test writes, torch hub's cache for ``imagenet``, and the
errors (no network, no file, wrong tensors, architectures without published weights)."""

from __future__ import annotations

import logging
import urllib.error

import pytest
import torch

from rayfed_proto.cli import resolve_config_arg
from rayfed_proto.config import ConfigError, build_config, load_config
from rayfed_proto.models import WeightsUnavailableError, build_client_model, build_model, imagenet_weights
from rayfed_proto.models import weights as weights_module


@pytest.fixture(autouse=True)
def _fresh_caches():
    """Each test sees files as it wrote them: the loaded state dicts and the logged notes are per process."""
    weights_module._cached_imagenet_state.cache_clear()
    weights_module._cached_file_state.cache_clear()
    weights_module._noted.clear()
    yield
    weights_module._cached_imagenet_state.cache_clear()
    weights_module._cached_file_state.cache_clear()


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty torch hub cache whose downloads fail as they do without a network."""
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))

    def no_network(url, *args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    return tmp_path / "hub"


def _same(a: torch.nn.Module, b: torch.nn.Module, skip: tuple[str, ...] = ()) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return all(torch.equal(sa[k], sb[k]) for k in sa if k not in skip)


def _source(arch: str = "resnet18", channels: int = 3, stem: str = "imagenet", seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(arch, channels, 16, 10, 32, stem=stem)
    with torch.no_grad():  # BatchNorm statistics too, so that buffers are checked as well as parameters
        for t in model.backbone.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.rand_like(t))
    return model


def test_a_saved_extractor_loads_exactly_and_leaves_projector_and_head_alone(tmp_path):
    source = _source()
    path = tmp_path / "resnet18.pt"
    torch.save(source.backbone.state_dict(), path)
    torch.manual_seed(2)
    fresh = build_model("resnet18", 3, 16, 10, 32, projector="linear")
    torch.manual_seed(2)
    loaded = build_model("resnet18", 3, 16, 10, 32, projector="linear", weights=str(path))
    assert _same(loaded.backbone, source.backbone)
    assert not _same(fresh.backbone, source.backbone)
    assert _same(loaded.projection, fresh.projection) and _same(loaded.head, fresh.head)


def test_a_whole_model_or_a_torchvision_state_dict_loads_its_extractor(tmp_path):
    source = _source("mobilenet_v2")
    whole = tmp_path / "whole.pth"
    torch.save(source.state_dict(), whole)  # backbone.*, projection.*, head.*
    torchvision_style = tmp_path / "tv.pth"  # the torchvision model's own keys, its classifier included
    torch.save({**source.backbone.state_dict(), "classifier.1.weight": torch.zeros(1000, 1280),
                "classifier.1.bias": torch.zeros(1000)}, torchvision_style)
    for path in (whole, torchvision_style):
        assert _same(build_model("mobilenet_v2", 3, 16, 10, 32, weights=str(path)).backbone, source.backbone), path


def test_build_client_model_loads_the_weights_after_the_shared_init(tmp_path):
    source = _source("resnet10", stem="cifar")
    path = tmp_path / "r10.pt"
    torch.save(source.backbone.state_dict(), path)
    model = build_client_model("ResNet10", 3, 3, 16, 10, 32, shared_seed=0, stem="cifar", weights=str(path))
    assert _same(model.backbone, source.backbone)


@pytest.mark.parametrize("channels,stem", [(1, "imagenet"), (3, "cifar")], ids=["one-channel", "cifar-stem"])
def test_a_first_conv_of_another_shape_keeps_its_init_with_one_logged_note(tmp_path, caplog, channels, stem):
    source = _source("resnet18", 3, "imagenet")  # the published geometry: 3 channels, conv7x7
    path = tmp_path / "rgb.pt"
    torch.save(source.backbone.state_dict(), path)
    torch.manual_seed(3)
    fresh = build_model("resnet18", channels, 16, 10, 32, stem=stem)
    with caplog.at_level(logging.WARNING, logger="rayfed_proto.models.weights"):
        torch.manual_seed(3)
        loaded = build_model("resnet18", channels, 16, 10, 32, stem=stem, weights=str(path))
        build_model("resnet18", channels, 16, 10, 32, stem=stem, weights=str(path))  # a second client: no second note
    assert torch.equal(loaded.backbone.conv1.weight, fresh.backbone.conv1.weight)
    assert _same(loaded.backbone, source.backbone, skip=("conv1.weight",))
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "first convolution conv1.weight" in notes[0] and "keeps its fresh init" in notes[0]


def test_the_wrong_architectures_file_is_an_error_naming_the_tensors(tmp_path):
    path = tmp_path / "r34.pt"
    torch.save(_source("resnet34").backbone.state_dict(), path)
    with pytest.raises(WeightsUnavailableError, match=r"does not fit the extractor of 'resnet18': unexpected \(\d+\): "
                       r"layer1\.2\."):
        build_model("resnet18", 3, 16, 10, weights=str(path))
    torch.save(_source("resnet18").backbone.state_dict(), path)
    with pytest.raises(WeightsUnavailableError, match=r"'resnet34': missing \(\d+\): layer1\.2\."):
        build_model("resnet34", 3, 16, 10, weights=str(path))


def test_a_missing_or_foreign_file_is_a_clear_error(tmp_path):
    with pytest.raises(WeightsUnavailableError, match="nope.pt'?: no such file; allowed: none, imagenet .* or the path"):
        build_model("resnet18", 3, 16, 10, weights=str(tmp_path / "nope.pt"))
    path = tmp_path / "list.pt"
    torch.save([torch.zeros(1)], path)
    with pytest.raises(WeightsUnavailableError, match="holds a list, not a state_dict"):
        build_model("resnet18", 3, 16, 10, weights=str(path))
    path.write_text("not a torch file")
    with pytest.raises(WeightsUnavailableError, match="not a torch state_dict file"):
        build_model("resnet18", 3, 16, 10, weights=str(path))


def test_imagenet_offline_says_so_and_names_the_cache_file_and_the_path_option(offline_hub):
    with pytest.raises(WeightsUnavailableError) as err:
        build_model("resnet18", 3, 32, 10, weights="imagenet")
    text = str(err.value)
    assert "could not get torchvision's ResNet18_Weights.IMAGENET1K_V1" in text and "URLError" in text
    assert str(offline_hub / "checkpoints" / "resnet18-f37072fd.pth") in text
    assert "or set model.weights to the path of a state_dict file" in text
    assert isinstance(err.value, ValueError)


def test_imagenet_reads_torch_hubs_cache_without_a_network(offline_hub):
    # the published file is the torchvision model's state dict, fc included: stand one in, in the cache
    source = _source("resnet18")
    file = weights_module.hub_file("ResNet18_Weights.IMAGENET1K_V1")
    file.parent.mkdir(parents=True)
    torch.save({**source.backbone.state_dict(), "fc.weight": torch.zeros(1000, 512), "fc.bias": torch.zeros(1000)}, file)
    assert _same(build_model("resnet18", 3, 16, 10, weights="imagenet").backbone, source.backbone)


def test_imagenet_needs_an_architecture_with_published_weights():
    assert [imagenet_weights(a) for a in ("resnet18", "resnet50", "googlenet", "mobilenet_v2")] == [
        "ResNet18_Weights.IMAGENET1K_V1", "ResNet50_Weights.IMAGENET1K_V1", "GoogLeNet_Weights.IMAGENET1K_V1",
        "MobileNet_V2_Weights.IMAGENET1K_V1"]
    assert imagenet_weights("resnet10") is imagenet_weights("cnn") is None
    with pytest.raises(WeightsUnavailableError, match="'cnn' has no published ImageNet weights .* none, or the path"):
        build_model("cnn", 3, 32, 10, weights="imagenet")


# --- config: validation names the key, the value and what is allowed; it never downloads --------


def _issue(raw: dict) -> str:
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    assert len(err.value.issues) == 1, err.value.issues
    return str(err.value.issues[0])


def test_config_rejects_weights_and_stems_the_groups_architectures_cannot_take(tmp_path):
    text = _issue({"model": {"group": "HtFE5", "weights": "imagenet"}, "federation": {"num_clients": 5}})
    assert text.startswith("model.weights = 'imagenet': none or a path: cnn, resnet10 (group 'HtFE5') have no published")
    text = _issue({"model": {"group": "HtFE2", "weights": str(tmp_path)}, "federation": {"num_clients": 2}})
    assert "a weights file holds one extractor" in text and "(cnn, resnet18)" in text
    text = _issue({"model": {"group": "ResNet18", "weights": str(tmp_path / "none.pt")}})
    assert text.startswith("model.weights = ") and "existing state_dict file" in text and "no file there" in text
    text = _issue({"model": {"group": "small_hetero", "stem": "cifar"}})
    assert text.startswith("model.stem = 'cifar': imagenet: group 'small_hetero'") and "resnet18" in text
    assert _issue({"model": {"stem": "32px"}}) == "model.stem = '32px': Input should be 'imagenet' or 'cifar'"


def test_config_accepts_them_where_they_apply_and_only_the_used_architectures_count(tmp_path, offline_hub):
    path = tmp_path / "w.pt"
    torch.save({}, path)
    cfg = build_config({"model": {"group": "ResNet18", "weights": str(path), "stem": "cifar"}})
    assert (cfg.model.weights, cfg.model.stem) == (str(path), "cifar")
    # HtFE2 with one client uses only the CNN... which has no stem; with two, resnet18 takes it
    assert "model.stem" in _issue({"model": {"group": "HtFE2", "stem": "cifar"}, "federation": {"num_clients": 1, "mode": "sync"}})
    build_config({"model": {"group": "HtFE2", "stem": "cifar"}, "federation": {"num_clients": 2}})
    # imagenet validates offline (the download fails in this fixture): weights load when a model is built
    assert build_config({"model": {"group": "ResNet18", "weights": "imagenet"}}).model.weights == "imagenet"
    sap = load_config(resolve_config_arg("fedsap_cifar10"))  # FedSAP Sec. 4.1 and appendix Table 5 (CIFAR-10)
    assert (sap.model.weights, sap.model.group) == ("imagenet", "ResNet18")
    p = sap.data.partition
    assert (p.n_way, p.n_way_std, p.k_shot, p.k_shot_std, p.k_shot_distribution) == (3, 1, 100, 1.0, "normal")
    fedsc = load_config(resolve_config_arg("fedsc_cifar10"))  # FedSC's ResNet-10 with its CIFAR stem
    assert (fedsc.model.group, fedsc.model.stem, fedsc.model.weights) == ("ResNet10", "cifar", "none")
    assert not list(offline_hub.rglob("*"))
