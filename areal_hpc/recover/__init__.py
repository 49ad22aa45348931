"""Recovery: attempts of a run, recover checkpoints, what a resume must agree with, and the notices that stop
a run with a checkpoint (USR2, SIGTERM).

attempt     begin an attempt (its log folder, the last attempt's coordination state cleared)
checkpoint  Checkpoints: written atomically with a manifest, the newest valid one found
rewind      cut a run directory back to the step a resume starts from
state       the settings a checkpoint must agree with; whether an attempt resumes (recover_mode)
signals     PreemptNotice (USR2, SIGTERM), Preempted, the trainers' grace after SIGTERM
"""

from areal_hpc.recover.attempt import ATTEMPT_ENV, begin_attempt, current_attempt, next_attempt
from areal_hpc.recover.checkpoint import Checkpoints
from areal_hpc.recover.rewind import rewind, save_into
from areal_hpc.recover.signals import EXIT_PREEMPTED, Interrupted, Preempted, PreemptNotice, outlive_term
from areal_hpc.recover.state import RecoverError, check_compatible, identity, resumes

__all__ = [
    "ATTEMPT_ENV",
    "EXIT_PREEMPTED",
    "Checkpoints",
    "Interrupted",
    "PreemptNotice",
    "Preempted",
    "RecoverError",
    "begin_attempt",
    "check_compatible",
    "current_attempt",
    "identity",
    "next_attempt",
    "outlive_term",
    "resumes",
    "rewind",
    "save_into",
]
