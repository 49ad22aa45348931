"""Rewards: each answer scored by its prompt's task; code answers run against their tests in a sandbox.

rewards  TaskRewards: the task's scorer for each answer (math and stem: the math verifier; code: its tests)
code     CodeVerifier: an answer's last Python block against every test case, the original's rule
sandbox  Sandbox: a program as one process under limits that are its own, isolated from the host (or refused:
         reward.code_isolation)
jail     the inside of a sandbox (stdlib only; run by `unshare`) and its seccomp filter
"""

from areal_hpc.reward.code import CodeVerifier, extract_code, outputs_match
from areal_hpc.reward.rewards import TaskRewards
from areal_hpc.reward.sandbox import IsolationError, Limits, Protections, Result, Sandbox, own_uids_available

__all__ = [
    "CodeVerifier",
    "IsolationError",
    "Limits",
    "Protections",
    "Result",
    "Sandbox",
    "TaskRewards",
    "extract_code",
    "outputs_match",
    "own_uids_available",
]
