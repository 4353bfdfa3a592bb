"""Where the main job's Hydra tree (``conf/``) is, and the option names kept for old commands.

The repository's top-level ``conf/`` is the one source. A wheel carries a copy inside the package
(setup.py copies it to ``lightning_optim/conf``); a source checkout or an editable install reads the
repository's ``conf/`` directly. Importing this module is cheap: no Hydra, no Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from lightning_optim.catalogue import OPTIMIZER_ALIASES, STRATEGY_ALIASES

__all__ = ["OPTIMIZER_ALIASES", "STRATEGY_ALIASES", "ALIASES", "conf_dir", "deprecated_choices"]

_PACKAGE = Path(__file__).resolve().parent
# Installed wheel first, then the checkout this package sits in.
_CANDIDATES = (_PACKAGE / "conf", _PACKAGE.parent / "conf")

# Config group -> deprecated option -> the catalogue name it composes to (conf/<group>/<old>.yaml only
# includes conf/<group>/<new>.yaml). Kept so existing commands and sweeps still run.
ALIASES: dict[str, dict[str, str]] = {"optimizer": OPTIMIZER_ALIASES, "strategy": STRATEGY_ALIASES}


def conf_dir() -> Path:
    """The directory holding ``train.yaml`` and its groups (optimizer/, strategy/, ...)."""
    for path in _CANDIDATES:
        if (path / "train.yaml").is_file():
            return path
    raise FileNotFoundError(f"the Hydra configs (train.yaml) are not in any of {[str(p) for p in _CANDIDATES]}")


def deprecated_choices(choices: Mapping[str, str | None]) -> list[str]:
    """One message per deprecated option among Hydra's runtime choices (``group -> option``)."""
    messages = []
    for group, renamed in ALIASES.items():
        old = choices.get(group)
        if old is not None and old in renamed:
            messages.append(f"{group}={old} is a deprecated name; use {group}={renamed[old]} (same config)")
    return messages
