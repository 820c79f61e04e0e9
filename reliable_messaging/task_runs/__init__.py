"""``django.tasks`` tasks run as messages: their result rows, their names on the broker, the
handler that runs them. The backend users name in ``TASKS`` is
:class:`reliable_messaging.contrib.task_backend.ReliableTaskBackend`; ``docs/tasks.md`` tells
the whole story. Nothing here imports the framework at import time but :mod:`.framework`."""
