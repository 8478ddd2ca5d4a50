"""raypar: an elastic Ray runtime for pipeline- and expert-parallel training."""
from __future__ import annotations

import os as _os

# `raypar.actors`, `raypar.checkpoint` and `raypar.kernels` live in top-level folders of
# the checkout (the layout DESIGN.md fixes). An installed wheel maps them under `raypar/`;
# a bare checkout (e.g. the working_dir of `ray job submit`) finds them here instead, so
# both import the same code.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "actors", "__init__.py")) and _checkout not in __path__:
    __path__.append(_checkout)

__version__ = "0.1.0"

from raypar.config import Config, ConfigError, load_config  # noqa: E402

__all__ = ["Callback", "Config", "ConfigError", "Trainer", "load_config", "__version__"]


def __getattr__(name: str):
    # The driver pulls in Ray and the actors; keep `import raypar` light for pure users.
    if name in ("Trainer", "Callback"):
        import raypar.driver

        return getattr(raypar.driver, name)
    raise AttributeError(f"module 'raypar' has no attribute {name!r}")
