"""A launched rank ends with its launcher.

`composer -n N` (and torchrun's agent) starts one process per device and, when it is SIGKILLed itself
(a preemption, the OOM killer, `kill -9` of the job's leader), has no chance to stop them: the ranks
go on training and saving into the run's folder, and a rerun of the same command then writes beside a
run that is still alive. Linux delivers a signal to a process when its parent dies if the process
asked for one (prctl PR_SET_PDEATHSIG); each rank asks for SIGKILL, as Slurm's own steps do.
"""

import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_launcher() -> bool:
    """In a process a launcher started (LOCAL_RANK set), ask Linux for SIGKILL when the launcher dies,
    and exit at once if it has died already. Returns whether the request was made (Linux only)."""
    if "LOCAL_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning(
            "prctl(PR_SET_PDEATHSIG) failed (errno %d): this rank may outlive its launcher",
            ctypes.get_errno(),
        )
        return False
    if os.getppid() == 1:  # the launcher died before the request: nothing would signal it now
        sys.exit("the launcher of this rank has exited; stopping")
    return True
