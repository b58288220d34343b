"""Where specdec keeps what it makes: ``$SPECDEC_HOME`` (models, kernels, heads, tuning results), one place for
every room to ask (the kernels' cache sits below the model formats, so neither asks the other)."""
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
