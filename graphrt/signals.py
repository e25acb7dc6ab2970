"""SIGINT, SIGTERM and SIGHUP while `graphrt serve` starts: each stops it in one line with exit 0
(graphrt.cli while the server stack imports, graphrt.server.runner while the engine loads); once
serving, the server's own handlers take over."""

from __future__ import annotations

import signal
from contextlib import contextmanager

# What stops `graphrt serve` cleanly: Ctrl+C, a process manager's SIGTERM, and SIGHUP (the
# terminal it ran in closed), which ended the process at once, resetting every connection; but not
# SIGHUP where the process started with it ignored (`nohup graphrt serve`: keep running).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM) + (() if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,))


class StartUpStopped(BaseException):
    """A STOP_SIGNALS signal while `graphrt serve` starts. Not a KeyboardInterrupt: one that passed
    through an extension's import would make Python end the process by SIGINT even after it was
    handled (exit -2 instead of 0)."""


@contextmanager
def stop_start_up_on_signals():
    """While in this block, the STOP_SIGNALS raise StartUpStopped at once."""

    def stop(signum, frame):
        raise StartUpStopped(signal.Signals(signum).name)

    with _handled_by(stop):
        yield


@contextmanager
def stop_requests_noted():
    """While in this block, the STOP_SIGNALS are only noted, and its end raises StartUpStopped if
    one came: an exception raised in the middle of an import can abort the process (inside a C
    extension's init) or leave a module half imported for another thread, so imports run whole."""
    came: list[int] = []
    with _handled_by(lambda signum, frame: came.append(signum)):
        yield
    if came:
        raise StartUpStopped(signal.Signals(came[0]).name)


@contextmanager
def _handled_by(handler):
    """The STOP_SIGNALS go to `handler` in this block; the handlers before it come back after."""
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)
