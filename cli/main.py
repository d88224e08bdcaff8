"""The `dynabatch` command: one subcommand per role, each imported only when chosen.

Roles never import each other; this dispatcher names them by module path, so
`dynabatch ps` loads the shard and nothing of the worker or scheduler.
"""

from __future__ import annotations

import faulthandler
import importlib
import signal
import sys
from collections.abc import Sequence

from dynabatch.common.atomic_file import storage_error

COMMANDS = {
    "run": ("dynabatch.cluster.main", "run a whole job on this machine (scheduler, shards, workers, evaluator)"),
    "scheduler": ("dynabatch.scheduler.main", "run a job's scheduler"),
    "ps": ("dynabatch.ps.main", "run a parameter-server shard"),
    "worker": ("dynabatch.worker.main", "run a training worker (or --evaluator)"),
    "export": ("dynabatch.cluster.export_command", "write a run's trained model as a plain PyTorch state_dict"),
    "check": ("dynabatch.cluster.check_command", "dry-run a task offline: parameters, chunks, step time, bytes"),
    "plan": ("dynabatch.cluster.plan_command", "predict each method's time to target on a measured cluster"),
    "preload": (
        "dynabatch.cluster.preload_command",
        "import torch once for many jobs' shards and workers (--preloader)",
    ),
    "keys": ("dynabatch.common.net.curve", "make the ZeroMQ CURVE keys that encrypt and authenticate a job"),
}


def usage() -> str:
    lines = ["usage: dynabatch COMMAND [flags]   (dynabatch COMMAND --help for its flags)", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def dump_stacks(signum: int, frame: object) -> None:
    """`kill -USR1 PID` writes every thread's stack to stderr (the process's log) and the process goes on.

    How a process that stopped answering is read without stopping it (`kubectl exec POD -- kill -USR1 1`).
    The dump runs as a Python handler, in the main thread with the GIL held, not from the C signal
    handler that `faulthandler.register` installs: that one walks the other threads' frames while they
    run and can crash a busy process (CPython gh-116008; it killed a scheduler in CI). Every loop here
    polls with a bounded timeout, so the handler runs within one poll.
    """
    faulthandler.dump_traceback(all_threads=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)  # asked for, or the usage error of no command
        return 0 if args else 2
    if args[0] == "--version":
        from importlib.metadata import version

        print(version("dynabatch"))
        return 0
    if args[0] not in COMMANDS:
        print(f"dynabatch: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGUSR1, dump_stacks)
    module = importlib.import_module(COMMANDS[args[0]][0])
    try:
        code: int = module.main(args[1:])
        return code
    except OSError as exc:
        # A full or read-only disk: one line, and exit 2, so that `dynabatch run` does not restart a
        # process that would only fail again (cluster/restart_policy.py).
        if (line := storage_error(exc)) is None:
            raise
        try:
            print(f"dynabatch {args[0]}: {line}", file=sys.stderr)
        except OSError:
            pass  # stderr is a log on the full disk: the exit code still says it
        return 2


if __name__ == "__main__":
    sys.exit(main())
