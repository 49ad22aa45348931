"""A workflow of the user's, outside areal_hpc (this folder on PYTHONPATH): two model turns around a calculator
call that the workflow makes itself, so that even an untrained model's episodes have every part."""

import asyncio


async def ask_calculate_ask(ctx, record):
    messages = [{"role": "user", "content": record.prompt}]
    reply = await ctx.chat(messages, ctx.tool_schemas)
    answer = await ctx.call_tool("calculator", {"expression": "6 * 7"})
    reply = await ctx.chat([*messages, reply, answer], ctx.tool_schemas)
    return float("42" in reply["content"])


async def sometimes_hangs(ctx, record):
    """ask_calculate_ask, but the episodes of one prompt in three never end (a tool that never answers)."""
    if int(record.query_id.rsplit("-", 1)[-1]) % 3 == 0:
        await asyncio.sleep(3600)
    return await ask_calculate_ask(ctx, record)
