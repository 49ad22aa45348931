"""The algorithm, as pure functions of arrays: PPO/GRPO losses and advantages, sequence packing, the math reward.

ppo         the policy losses (PPO, GSPO, CISPO; decoupled), the value loss, masked statistics
corrections off-policy corrections of the behaviour policy, KL estimators, the loglinear proximal policy
aggregation the weight of each token's loss in a minibatch (loss_agg_mode), with global normalisers
advantages  reward shaping, group baselines, per-token rewards, GAE, normalisation, distillation
packing     packed-sequence bookkeeping, balanced partitions, first-fit-decreasing micro-batches
math_parse  the math reward's rule: the last box of a response against the reference, by Math-Verify
math_numbers the original's numeric rules where Math-Verify says no: relative 1e-4, percentages
math_verify MathVerifier: the math reward in a pool of worker processes, each check under a timeout
timed_pool  TimedPool: calls of one function in worker processes, each killed and replaced when it overruns
"""

import importlib

# Imported when first used: the math reward's worker processes import this package to reach math_parse, and
# must not pay for torch (the losses' and advantages' modules) at every start.
_HOME = {
    "compute_advantages": "advantages", "response_mask": "advantages", "Overlong": "advantages",
    "Totals": "aggregation", "local_totals": "aggregation",
    "Correction": "corrections", "loglinear_proximal": "corrections",
    "reference_answer": "math_parse", "response_answer": "math_parse", "numbers_agree": "math_numbers",
    "MathVerifier": "math_verify", "VerifierError": "math_verify",
    "Outcome": "timed_pool", "PoolError": "timed_pool", "TimedPool": "timed_pool",
    "AlgoInputError": "packing", "align_next_token": "packing", "balanced_partition": "packing",
    "ffd_pack": "packing", "seq_index": "packing", "split_minibatches": "packing",
    "MaskedStat": "ppo", "actor_loss": "ppo", "critic_loss": "ppo",
}  # fmt: skip


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


__all__ = [
    "AlgoInputError",
    "Correction",
    "Overlong",
    "Totals",
    "local_totals",
    "loglinear_proximal",
    "MaskedStat",
    "MathVerifier",
    "Outcome",
    "PoolError",
    "VerifierError",
    "actor_loss",
    "align_next_token",
    "balanced_partition",
    "compute_advantages",
    "critic_loss",
    "ffd_pack",
    "numbers_agree",
    "reference_answer",
    "response_answer",
    "response_mask",
    "seq_index",
    "split_minibatches",
    "TimedPool",
]
