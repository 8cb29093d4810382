"""The packaged presets (``rayfed_proto/presets/*.yaml``): where they are, their names, and how a
``config`` argument (a YAML path or a preset name) becomes a file.

Used by the CLI (``rayfed-proto run NAME``, ``list``) and by sweep files (``base: NAME``); it
imports only ``rayfed_proto.config``, so the Tune layer does not depend on the CLI.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from rayfed_proto.config import ConfigError, ConfigIssue


def presets_dir() -> Path:
    return Path(str(resources.files("rayfed_proto") / "presets"))


def default_config_path() -> Path:
    return presets_dir() / "default.yaml"


def preset_names() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def resolve_config_arg(config: str | None) -> Path:
    """A YAML path, or the name of a packaged preset (``rayfed-proto run fedsa_digits``)."""
    if config is None:
        return default_config_path()
    path = Path(config)
    if not path.exists() and path.suffix == "" and config in preset_names():
        return presets_dir() / f"{config}.yaml"
    if not path.exists() and path.suffix not in (".yaml", ".yml") and "/" not in config:
        import difflib

        close = difflib.get_close_matches(config, preset_names(), n=3, cutoff=0.5)
        raise ConfigError([ConfigIssue(key="<config>", value=config, allowed=(
            "an existing YAML file or a preset name" + (f" (did you mean {', '.join(close)}?)" if close else "")
            + "; presets: " + ", ".join(preset_names())))])
    return path
