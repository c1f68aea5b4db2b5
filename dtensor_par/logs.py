"""The ``dtensor_par`` logger and its one verbosity switch (or ``DTENSOR_PAR_LOG=debug``)."""

from __future__ import annotations

import contextlib
import logging
import os

logger = logging.getLogger("dtensor_par")


def set_verbosity(level: str | int) -> None:
    """``"debug"`` (every pass, timed), ``"info"`` (one line per graph), ``"warning"`` (default)."""
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[dtensor_par] %(levelname)s %(message)s"))
        logger.addHandler(handler)


@contextlib.contextmanager
def quiet():
    """Nothing logged inside: a plan run again for what it finds, whose warnings were logged once."""
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


if os.environ.get("DTENSOR_PAR_LOG"):
    set_verbosity(os.environ["DTENSOR_PAR_LOG"])
