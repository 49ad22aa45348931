"""Rewards beyond math: model-written code run against its tests in a sandbox.

sandbox  Sandbox: a program in a fresh directory under limits, isolated from the host where the OS allows
jail     the inside of a sandbox (stdlib only; run by `unshare`)
"""

from areal_hpc.reward.sandbox import Limits, Protections, Result, Sandbox

__all__ = ["Limits", "Protections", "Result", "Sandbox"]
