"""Generation: the client of a generation server, the rollouts (synchronous, and the rollout role's), the
generation manager, interruptible answers, and the servers behind one seam (`gen.backends`). The roles' entry
points are `gen.server_role` and `gen.rollout_role`.

client          GenClient: SGLang's HTTP API, every call with a timeout and an error naming the route
discovery       servers announce their address in the run directory; clients wait for them
rollout         one synchronous step: prompts -> servers -> math reward -> a packed batch file
rollout_worker  the rollout workers of asynchronous RL
episode         the context a multi-turn workflow runs with (generate, chat, tools, reward), recording its tokens
episodes        a prompt's group of episodes, run and exported as samples; a synchronous step of them
journal         each episode's completed generations, replayed when a restarted run resumes it
endpoint        the OpenAI-compatible endpoint an agent reaches the policy through, a key per episode
agents          the user's agent (a function or a program) as the workflow of its episodes
manager         GenerationManager: the staleness bound and the choice of server
partial         answers continued across weight updates (interruptible generation)
"""

from areal_hpc.gen import discovery
from areal_hpc.gen.backends import ServerSpec, start_server
from areal_hpc.gen.client import GenClient, GenServerError
from areal_hpc.gen.episodes import (
    EPISODE_COUNTS,
    GIVEN_UP,
    Episodes,
    RepeatedAgentError,
    by_cause,
    episode_stats,
    episodes_step,
    is_single_turn,
    make_services,
    repeats,
)
from areal_hpc.gen.journal import Journals
from areal_hpc.gen.partial import CACHE_COUNTS, cache_stats
from areal_hpc.gen.rollout import group_params, rollout_step, sampling_params

__all__ = [
    "CACHE_COUNTS",
    "EPISODE_COUNTS",
    "GIVEN_UP",
    "Episodes",
    "GenClient",
    "GenServerError",
    "Journals",
    "RepeatedAgentError",
    "ServerSpec",
    "by_cause",
    "cache_stats",
    "discovery",
    "episode_stats",
    "episodes_step",
    "group_params",
    "is_single_turn",
    "make_services",
    "repeats",
    "rollout_step",
    "sampling_params",
    "start_server",
]
