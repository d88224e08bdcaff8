"""What `dynabatch run` does about a child process that exited with an error: one rule for every role.

A distributed trainer should ride out a machine that dies (a worker is one of many,
the job goes on with the rest, as the scheduler drops a silent member anyway), but
must not loop for ever on a process that dies at every start (a bad flag, a missing
file): every process is started again at most `--restarts` times, and past that the
run either goes on without it (a worker, while the job can) or ends with its log.
A shard or worker forked by a preloading process ends with it (cluster/preloaded.py): that is the preloader's
failure, not its own, so it is started again without spending one of its restarts, as long as the preloader has
ended no more than `--restarts` times in the run.
A process that exits 2 said why in one line: its configuration (a flag, a task, the
data) or its storage (a full disk) is wrong, which a restart would only repeat, so
the run ends at once with that line.
"""

from __future__ import annotations

from typing import Literal

Action = Literal["rebind", "again", "restart", "leave_out", "fail", "refused"]
CONFIG_ERROR_EXIT = 2  # what every dynabatch command exits with after its one-line reason


def after_exit(
    role: str,
    restarts: int,
    limit: int,
    port_taken: bool,
    job_goes_on_without: bool,
    returncode: int = 1,
    preloader_ends: int = 0,
) -> Action:
    """The action for a child of `role` that exited with an error after `restarts` restarts (of `limit`).

    `port_taken`: its fixed port was taken before it could bind at its first start, so
    a start on a fresh port (`rebind`) fixes it and is not counted. `job_goes_on_without`:
    other workers train (or can start training without it). A shard, the scheduler and
    the evaluator (the job awaits its final evaluation) are each the only one of their
    kind: past `limit`, the run fails. `returncode` CONFIG_ERROR_EXIT: `refused`, the run ends now.
    `preloader_ends`: it ended with the preloading process it was forked from, whose `preloader_ends`-th end in
    the run that was (0: it ended on its own); up to `limit` of them, it is started again uncounted (`again`).
    """
    if port_taken:
        return "rebind"
    if 0 < preloader_ends <= limit:
        return "again"
    if returncode == CONFIG_ERROR_EXIT:
        return "refused"
    if restarts < limit:
        return "restart"
    if role == "worker" and job_goes_on_without:
        return "leave_out"
    return "fail"
