"""SIGINT and SIGTERM as stop requests, for runs and sweep workers alike.

A run stops cleanly at the end of its current step: the first signal is recorded (`signum`), the
loop checkpoints the step and raises `Interrupted`; a second signal raises at once. A sweep worker
also waits on storage and locks, where a signal must raise at once (`interruptible`), except while
it writes a trial's state (`deferred`: raised after the write).
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager

_STOPS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run.

    Args:
        signum: the signal.
        step: the step a resume starts at, when the run checkpointed it; None when the current
            step was abandoned (a resume starts at the last periodic checkpoint).
    """

    def __init__(self, signum: int, step: int | None = None) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.step = signum, step

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process ended by this signal


class StopSignals:
    """Catch SIGINT and SIGTERM; `signum` is the first one caught (0: none yet).

    What a signal does depends on where the process is:
    - inside `graceful()` (a run's steps): the first is only recorded, so the run finishes its
      step and checkpoints it; a second raises `Interrupted` at once;
    - inside `interruptible()`: it raises `Interrupted` at once, except inside `deferred()`
      (a storage write), after which it is raised;
    - elsewhere it is recorded.

    Args:
        take_all: take both signals whatever handles them now (a sweep worker). False (a run):
            take only signals left at their default handler, so that the run of a sweep worker
            keeps the worker's handlers; and only in the main thread, where Python runs handlers.
    """

    def __init__(self, take_all: bool = False) -> None:
        self.signum = 0
        self._armed = self._graceful = False
        self._previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
        for sig in _STOPS:
            if take_all or signal.getsignal(sig) is defaults[sig]:
                self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def stop(self) -> bool:
        return self.signum != 0

    def _handle(self, signum, frame) -> None:
        first = not self.signum
        self.signum = self.signum or signum
        if self._graceful and first:
            return  # the run stops after this step (it reads `signum`)
        if self._armed or self._graceful:
            self._armed = False
            raise Interrupted(signum)

    @contextmanager
    def interruptible(self):
        if self.stop:
            raise Interrupted(self.signum)
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    @contextmanager
    def graceful(self):
        """Around a run's steps: a first signal ends the run after its step, which it checkpoints;
        a second one at once."""
        if self.stop:
            raise Interrupted(self.signum)
        self._graceful = True
        try:
            yield
        finally:
            self._graceful = False

    @contextmanager
    def deferred(self):
        armed, self._armed = self._armed, False
        try:
            yield
        finally:
            self._armed = armed and not self.stop
        if armed and self.stop and not self._graceful:
            raise Interrupted(self.signum)

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.stop and time.monotonic() < end:
            time.sleep(0.2)

    def restore(self) -> None:
        """Give the signals back to the handlers they had."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
