"""`python -m graphrt.worker`: one rank of a pipeline whose stages run in processes of their own.

torchrun (or `graphrt ... --procs`) starts it on every rank with RANK and WORLD_SIZE set: rank 0
runs the graphrt command line it is given (the engine, and the server), every other rank serves
its stage (graphrt.distributed.worker).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading

from graphrt.distributed.transport import stage_name
from graphrt.distributed.worker import parse_options, run_worker
from graphrt.logs import configure_logging


def main(args: list[str] | None = None) -> None:
    args = sys.argv[1:] if args is None else args
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.exit("error: python -m graphrt.worker runs under torchrun or `graphrt ... --procs`, which set RANK and WORLD_SIZE")
    if int(os.environ["RANK"]) == 0:  # rank 0 is the engine (and the server)
        from graphrt.cli import main as cli

        try:
            cli(args + ["--procs"])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        # The engine has closed or failed its cluster; skip a teardown in which the store's and
        # gloo's threads, their peers gone, can abort the process after the answer was given.
        atexit._run_exitfuncs()  # closes the cluster (its workers exit 0) if the command did not
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    options = parse_options(args)
    configure_logging(f"graphrt {stage_name(int(os.environ['RANK']), options.ep)}")
    outcome: list[int] = []
    # The loop runs on a thread, so this one stays free to handle SIGTERM/SIGINT at once.
    thread = threading.Thread(target=lambda: outcome.append(run_worker(options)), name="graphrt-worker", daemon=True)

    def stop(signum, frame):
        print(f"[graphrt] {stage_name(int(os.environ['RANK']), options.ep)} stops: got {signal.Signals(signum).name}", file=sys.stderr, flush=True)
        os._exit(1)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal: rank 0 decides, and the ring tells the rest
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    # os._exit: gloo's threads must not keep a failed worker alive, and nothing is left to flush.
    sys.stdout.flush()
    os._exit(outcome[0] if outcome else 1)


if __name__ == "__main__":
    main()
