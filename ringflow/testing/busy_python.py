"""BusyPython: a thread running Python bytecode while something else is measured, as an engine's
scheduler runs Python while the GPU computes a step (Note [Host node]: a worker that needs the
GIL between its ops waits for it beside such a thread)."""

from __future__ import annotations

import threading
import time


class BusyPython:
    """Context manager: a daemon thread that runs Python bytecode until the block ends."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy-python", daemon=True)

    def _run(self) -> None:
        table: dict[int, int] = {}
        while not self._stop.is_set():
            for i in range(1000):
                table[i] = table.get(i, 0) + 1

    def __enter__(self) -> BusyPython:
        self._thread.start()
        time.sleep(0.05)  # running before the measurement starts
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
