"""SIGINT and SIGTERM while `graphrt serve` starts: both stop it at once, in one line, exit 0
(graphrt.cli and graphrt.server.runner); once serving, the server's own handlers take over."""

from __future__ import annotations

import signal
from contextlib import contextmanager


class StartUpStopped(BaseException):
    """SIGINT or SIGTERM while `graphrt serve` starts (`stop_start_up_on_signals`). Not a
    KeyboardInterrupt: one that passed through an extension's import would make Python end the
    process by SIGINT even after it was handled (exit -2 instead of 0)."""


@contextmanager
def stop_start_up_on_signals():
    """While in this block, SIGINT and SIGTERM raise StartUpStopped; the handlers before it come back after."""

    def stop(signum, frame):
        raise StartUpStopped(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def stop_requests_noted():
    """While in this block, SIGINT and SIGTERM are only noted, and its end raises StartUpStopped if
    one came: an exception raised in the middle of an import can abort the process (inside a C
    extension's init) or leave a module half imported for another thread, so imports run whole."""
    came: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: came.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if came:
        raise StartUpStopped(signal.Signals(came[0]).name)
