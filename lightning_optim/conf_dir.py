"""Where the main job's Hydra tree (``conf/``) is, and the optimizer option names kept for old commands.

The repository's top-level ``conf/`` is the one source. A wheel carries a copy inside the package
(setup.py copies it to ``lightning_optim/conf``); a source checkout or an editable install reads the
repository's ``conf/`` directly. Importing this module is cheap: no Hydra, no Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

__all__ = ["OPTIMIZER_ALIASES", "conf_dir", "deprecated_choices"]

_PACKAGE = Path(__file__).resolve().parent
# Installed wheel first, then the checkout this package sits in.
_CANDIDATES = (_PACKAGE / "conf", _PACKAGE.parent / "conf")

# Deprecated optimizer option -> the catalogue name it composes to (conf/optimizer/<old>.yaml only
# includes conf/optimizer/<new>.yaml). Kept so existing commands and sweeps still run.
OPTIMIZER_ALIASES: dict[str, str] = {"signsgd": "sign_sgd", "stableadamw": "stable_adamw"}


def conf_dir() -> Path:
    """The directory holding ``train.yaml`` and its groups (optimizer/, strategy/, ...)."""
    for path in _CANDIDATES:
        if (path / "train.yaml").is_file():
            return path
    raise FileNotFoundError(f"the Hydra configs (train.yaml) are not in any of {[str(p) for p in _CANDIDATES]}")


def deprecated_choices(choices: Mapping[str, str | None]) -> list[str]:
    """One message per deprecated option among Hydra's runtime choices (``group -> option``)."""
    old = choices.get("optimizer")
    if old in OPTIMIZER_ALIASES:
        return [f"optimizer={old} is a deprecated name; use optimizer={OPTIMIZER_ALIASES[old]} (same config)"]
    return []
