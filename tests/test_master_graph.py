"""The MFC dataflow graph, the metadata buffer and frequency control of the master."""

import pytest

from areal_hpc.config import load_config
from areal_hpc.master.buffer import Buffer, SampleMeta
from areal_hpc.master.freq import FrequencyControl
from areal_hpc.master.graph import ALL_MFCS, build_graph, dependencies

# What the rollout side writes: the outputs of generation and reward.
ROLLOUT_KEYS = ALL_MFCS[0].outputs + ALL_MFCS[1].outputs


def names(mfcs):
    return [m.name for m in mfcs]


def test_full_graph_with_critic_and_reference():
    cfg = load_config(overrides=["ppo.disable_value=false", "critic.path=/m", "ppo.kl_ctl=0.1"])
    graph = build_graph(cfg)
    assert names(graph) == [
        "actor_gen", "rew_inf", "ref_inf", "actor_inf", "critic_inf", "actor_train", "critic_train"
    ]  # fmt: skip
    deps = dependencies(graph)
    assert deps["actor_train"] == {"actor_gen", "rew_inf", "ref_inf", "actor_inf", "critic_inf"}
    assert deps["ref_inf"] == {"actor_gen"}


def test_pruning_rules_of_the_original():
    cfg = load_config(overrides=["ppo.kl_ctl=0"])  # disable_value is the default
    assert names(build_graph(cfg)) == ["actor_gen", "rew_inf", "actor_inf", "actor_train"]
    assert "packed_ref_logprobs" not in build_graph(cfg)[-1].inputs
    cfg = load_config(
        overrides=["ppo.kl_ctl=0", "ppo.recompute_logprob=false", "ppo.use_decoupled_loss=false"]
    )
    assert names(build_graph(cfg)) == ["actor_gen", "rew_inf", "actor_train"]


def test_the_loglinear_proximal_policy_skips_the_recomputation():
    cfg = load_config(overrides=["ppo.kl_ctl=0", "ppo.prox_logp_method=loglinear"])
    assert names(build_graph(cfg)) == ["actor_gen", "rew_inf", "actor_train"]
    assert "proximal_logprobs" not in build_graph(cfg)[-1].inputs


def test_trainer_graph_leaves_generation_and_reward_to_the_rollout_side():
    cfg = load_config(overrides=["ppo.kl_ctl=0.1"])
    assert names(build_graph(cfg, trainer_only=True)) == ["ref_inf", "actor_inf", "actor_train"]


def sample(i, birth, keys=ROLLOUT_KEYS):
    return SampleMeta(
        f"s{i}", group=f"q{i // 2}", seqlen=5, birth_time=birth, keys={k: ("gen.h5", i) for k in keys}
    )


def test_buffer_serves_oldest_ready_samples_and_frees_them_after_every_call():
    cfg = load_config(overrides=["ppo.kl_ctl=0"])
    buffer = Buffer(build_graph(cfg, trainer_only=True))  # actor_inf -> actor_train
    buffer.add([sample(0, birth=3.0), sample(1, birth=1.0), sample(2, birth=2.0)])
    assert buffer.ready("actor_train", 1) is None  # no proximal logprobs yet
    assert [s.sample_id for s in buffer.ready("actor_inf", 2)] == ["s1", "s2"]
    assert buffer.ready("actor_inf", 4) is None
    buffer.amend(["s1", "s2"], "inf.h5", ["proximal_logprobs"])
    assert buffer.consume("actor_inf", ["s1", "s2"]) == []
    assert buffer.ready("actor_inf", 2) is None  # s1, s2 consumed by actor_inf; only s0 is left for it
    assert [s.sample_id for s in buffer.ready("actor_train", 2)] == ["s1", "s2"]
    assert buffer.ready("actor_train", 2)[0].keys["proximal_logprobs"] == ("inf.h5", 0)
    assert buffer.consume("actor_train", ["s1", "s2"]) == ["s1", "s2"]
    assert len(buffer) == 1


def test_buffer_refuses_a_sample_twice():
    buffer = Buffer([])
    buffer.add([sample(0, 1.0)])
    with pytest.raises(ValueError, match="'s0' is already in the buffer"):
        buffer.add([sample(0, 2.0)])


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_frequencies_are_or_ed_and_reset_when_they_fire():
    clock = Clock()
    freq = FrequencyControl(freq_epochs=1, freq_steps=3, freq_secs=60, clock=clock)
    assert [freq.check(steps=1) for _ in range(4)] == [False, False, True, False]
    clock.now += 61
    assert freq.check(steps=1) is True  # seconds
    assert freq.check(epochs=1, steps=1) is True  # epoch
    assert FrequencyControl(clock=clock).check(epochs=5, steps=5) is False  # all null: never


def test_frequency_state_restores_counters_and_elapsed_time():
    clock = Clock()
    freq = FrequencyControl(freq_steps=3, freq_secs=60, clock=clock)
    freq.check(steps=2)
    clock.now += 50
    restored = FrequencyControl(freq_steps=3, freq_secs=60, clock=Clock())
    restored.load_state_dict(freq.state_dict())
    restored.clock.now += 11
    assert restored.steps == 2 and restored.check() is True


def test_supervised_warm_up_is_one_training_call():
    cfg = load_config(overrides=["experiment_type=sft"])
    assert names(build_graph(cfg, trainer_only=True)) == ["sft_train"]
