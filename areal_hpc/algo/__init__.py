"""The algorithm, as pure functions of arrays: PPO/GRPO losses and advantages, sequence packing, the math reward.

ppo         the (decoupled) clipped objective, the value loss, masked statistics
advantages  per-token rewards, GAE over packed sequences, advantage normalisation
packing     packed-sequence bookkeeping, balanced partitions, first-fit-decreasing micro-batches
math_parse  the math reward's rule: the last box of a response against the reference, by Math-Verify
math_verify MathVerifier: the math reward in a pool of worker processes, each check under a timeout
"""

from areal_hpc.algo.advantages import compute_advantages, response_mask
from areal_hpc.algo.math_parse import reference_answer, response_answer
from areal_hpc.algo.math_verify import MathVerifier, VerifierError
from areal_hpc.algo.packing import (
    AlgoInputError,
    align_next_token,
    balanced_partition,
    ffd_pack,
    seq_index,
    split_minibatches,
)
from areal_hpc.algo.ppo import MaskedStat, actor_loss, critic_loss

__all__ = [
    "AlgoInputError",
    "MaskedStat",
    "MathVerifier",
    "VerifierError",
    "actor_loss",
    "align_next_token",
    "balanced_partition",
    "compute_advantages",
    "critic_loss",
    "ffd_pack",
    "reference_answer",
    "response_answer",
    "response_mask",
    "seq_index",
    "split_minibatches",
]
