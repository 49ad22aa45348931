"""The built-in workflows. A workflow is `async def workflow(ctx, record) -> reward`: ``ctx`` is the episode's
context (generation, chat, tools, the task's reward: gen.episode.EpisodeContext), ``record`` the dataset's
prompt (data.PromptSample); the reward is the episode's task reward (1.0 solved, 0.0 not, as the task's scorer
gives it), or one per model turn with ``rollout.export: per_turn``. docs/agents.md shows how to write one."""

from __future__ import annotations


async def single_turn(ctx, record) -> float:
    """One answer to the prompt, scored by its task: the rollout of RLVR. The rollout runs this workflow's group
    as one request of group_size answers (one prefill of the prompt, as before workflows existed)."""
    turn = await ctx.generate(record.input_ids)
    return await ctx.score(turn.text, turn.ids)


async def tool_loop(ctx, record) -> float:
    """The model answers the prompt, calling the run's tools (rollout.tools) in its chat template's format, for
    up to rollout.max_turns turns; each turn's calls run and their answers (or errors) come back as tool
    messages. The last turn's text is scored by the prompt's task."""
    messages = [{"role": "user", "content": record.prompt}]
    for _ in range(ctx.options.max_turns):
        reply = await ctx.chat(messages, ctx.tool_schemas)
        messages.append(reply)
        if ctx.last_turn.finish != "stop" or not ctx.pending_calls:
            break
        messages += await ctx.run_tools()
    return await ctx.score(reply["content"])
