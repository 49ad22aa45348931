"""Agents of the user's for the checks before submit (tests/test_agent_config.py): one that may be trained, two
that may not."""


async def solve(base_url, api_key, record):
    return 1.0


def not_async(base_url, api_key, record):
    return 1.0


async def takes_two(base_url, record):
    return 1.0
