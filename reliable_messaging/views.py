"""Moved to :mod:`reliable_messaging.ops.views`.

This path keeps working for a while, and warns (see :mod:`reliable_messaging.moved_modules`).
"""

from .moved_modules import forward

__getattr__, __dir__ = forward(__name__, "reliable_messaging.ops.views")
