"""Agents of the user's: for the checks before submit (tests/test_agent_config.py), one that may be trained and
two that may not; for the rollout, agents that return no number, and one that counts the calls running at once."""

import asyncio
import threading


async def solve(base_url, api_key, record):
    return 1.0


NOT_A_FUNCTION = 1.0


async def takes_two(base_url, record):
    return 1.0


async def returns_none(base_url, api_key, record):
    """Forgets to return its reward."""


async def returns_text(base_url, api_key, record):
    return "1.0"


async def returns_nan(base_url, api_key, record):
    return float("nan")


async def returns_true(base_url, api_key, record):
    return True


CROWD = {"now": 0, "most": 0}  # calls of counts_its_crowd running now, and the most at once
_CROWD_LOCK = threading.Lock()  # the groups' episodes run in threads of their own


async def counts_its_crowd(base_url, api_key, record):
    """Half a second of work, counted in CROWD while it runs."""
    with _CROWD_LOCK:
        CROWD["now"] += 1
        CROWD["most"] = max(CROWD["most"], CROWD["now"])
    try:
        await asyncio.sleep(0.5)
    finally:
        with _CROWD_LOCK:
            CROWD["now"] -= 1
    return 1.0
