"""Settings for ``manage.py relay`` subprocesses started by the outbox tests.

The suite's settings, plus ``RELIABLE_MESSAGING`` overrides given as JSON in the environment
variable ``RM_OUTBOX_OVERRIDES`` (e.g. ``{"OUTBOX_MAX_ATTEMPTS": 2}``), so a subprocess can run
with the same per-test settings as the test that starts it.
"""

from __future__ import annotations

import json
import os

from tests.settings import *  # noqa: F403
from tests.settings import RELIABLE_MESSAGING as _BASE

RELIABLE_MESSAGING = {**_BASE, **json.loads(os.environ.get("RM_OUTBOX_OVERRIDES") or "{}")}
