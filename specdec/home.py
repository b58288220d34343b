"""Where specdec keeps what it makes: ``$SPECDEC_HOME`` (models, kernels, heads, tuning results). A room of its
own at the bottom of the house, so every room can ask it: the kernels' build cache without importing the model
formats above them."""
from __future__ import annotations

import os
from pathlib import Path


def specdec_home() -> Path:
    """``$SPECDEC_HOME``, else ``$XDG_CACHE_HOME/specdec``, else ``~/.cache/specdec``."""
    if os.environ.get("SPECDEC_HOME"):
        return Path(os.environ["SPECDEC_HOME"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "specdec"
    return Path.home() / ".cache" / "specdec"
