"""The config system: YAML over the schema, typed overrides, clear errors, dump and reload."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from areal_hpc.alloc import ParallelSpec
from areal_hpc.cli import DOCS_PATH, main
from areal_hpc.config import ConfigError, ExperimentConfig, dump_yaml, gen_backend, load_config, mfc_spec
from areal_hpc.config.backends import megatron_model_problems, moe_experts
from areal_hpc.config.checks import validate, walk
from areal_hpc.config.docs import render_markdown

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
STANDALONE = {"toy-cpu.yaml", "toy-sft.yaml", "qwen3-1.7b-8gpu.yaml"}  # the other shipped configs are layers
BASES = {
    "toy-code.yaml": "toy-cpu.yaml",
    "toy-tools.yaml": "toy-cpu.yaml",
    "toy-agent.yaml": "toy-cpu.yaml",  # over toy-tools.yaml too, as tests/test_tool_learning.py runs it
    "toy-tools-sft.yaml": "toy-cpu.yaml",
}  # the base of a layer, when not qwen3-1.7b-8gpu.yaml


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_schema_defaults_are_valid():
    validate(ExperimentConfig())


def test_every_option_has_help_text():
    for key, field, _ in walk(ExperimentConfig()):
        assert field.metadata.get("help"), f"{key} has no help text"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    base = (
        [] if path.name in STANDALONE else [ROOT / "configs" / BASES.get(path.name, "qwen3-1.7b-8gpu.yaml")]
    )
    cfg = load_config([*base, path])
    assert cfg.experiment_name


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_no_config_meant_for_gpus_generates_with_the_builtin_server(path):
    """builtin is the CPU and test default; a GPU cluster's recipe generates with SGLang (issue 28)."""
    base = (
        [] if path.name in STANDALONE else [ROOT / "configs" / BASES.get(path.name, "qwen3-1.7b-8gpu.yaml")]
    )
    cfg = load_config([*base, path])
    assert (gen_backend(cfg) == "builtin") == path.name.startswith("toy-"), gen_backend(cfg)


def test_files_merge_in_order_and_overrides_win(tmp_path):
    base = write(tmp_path, "ppo:\n  eps_clip: 0.3\n  kl_ctl: 0.5\n", "a.yaml")
    top = write(tmp_path, "ppo:\n  kl_ctl: 0.0\n", "b.yaml")
    cfg = load_config([base, top], ["ppo.eps_clip=0.25"])
    assert (cfg.ppo.eps_clip, cfg.ppo.kl_ctl, cfg.ppo.discount) == (0.25, 0.0, 1.0)


def test_overrides_are_coerced_to_the_field_type():
    cfg = load_config(
        overrides=[
            "seed=7",
            "actor.optimizer.lr=1e-5",
            "ppo.adv_norm=false",
            "ppo.c_clip=3",
            "ppo.behav_correction.upper=null",
            "ppo.gen.stop_token_ids=7,9",
            "cluster.slurm.setup_commands=[module load cuda, source env.sh]",
            "trial_name=try-2",
        ]
    )
    assert cfg.seed == 7
    assert cfg.actor.optimizer.lr == 1e-5
    assert cfg.ppo.adv_norm is False
    assert cfg.ppo.c_clip == 3.0 and isinstance(cfg.ppo.c_clip, float)
    assert cfg.ppo.behav_correction.upper is None
    assert cfg.ppo.gen.stop_token_ids == [7, 9]
    assert cfg.cluster.slurm.setup_commands == ["module load cuda", "source env.sh"]
    assert cfg.trial_name == "try-2"


def test_yaml_scientific_notation_without_dot_is_a_float(tmp_path):
    # PyYAML reads `1e-5` as a string; the schema type makes it a float.
    cfg = load_config([write(tmp_path, "actor:\n  optimizer:\n    lr: 1e-5\n")])
    assert cfg.actor.optimizer.lr == 1e-5


def test_unknown_key_in_yaml_names_file_line_and_suggests(tmp_path):
    path = write(tmp_path, "seed: 1\nppo:\n  eps_clp: 0.1\n")
    with pytest.raises(
        ConfigError, match=rf"{path}:3: unknown key 'ppo.eps_clp' \(did you mean 'ppo.eps_clip'\?\)"
    ):
        load_config([path])


def test_unknown_override_suggests_the_key_elsewhere_in_the_tree():
    with pytest.raises(
        ConfigError, match=r"override 'eps_clip=0.1': unknown key 'eps_clip' \(did you mean 'ppo.eps_clip'"
    ):
        load_config(overrides=["eps_clip=0.1"])


def test_wrong_type_names_key_and_source(tmp_path):
    with pytest.raises(ConfigError, match=r"override 'group_size=many': 'group_size' expects int"):
        load_config(overrides=["group_size=many"])
    path = write(tmp_path, "cluster:\n  slurm:\n    time: 10:00\n")
    # YAML 1.1 reads 10:00 as the integer 600: refuse instead of passing a wrong time limit to Slurm.
    with pytest.raises(ConfigError, match=rf"{path}:3: 'cluster.slurm.time' expects str or null.*quote"):
        load_config([path])


def test_section_and_value_confusion_is_explained():
    with pytest.raises(ConfigError, match="'ppo' is a section"):
        load_config(overrides=["ppo=1"])
    with pytest.raises(ConfigError, match="'seed' is a value, not a section"):
        load_config(overrides=["seed.x=1"])


def test_malformed_override_and_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not of the form key.sub=value"):
        load_config(overrides=["=3"])
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config([write(tmp_path, "a: [1, 2\n")])
    with pytest.raises(ConfigError, match="appears twice"):
        load_config([write(tmp_path, "seed: 1\nseed: 2\n")])
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config([tmp_path / "missing.yaml"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["experiment_name=my_exp"], "'experiment_name' is 'my_exp'; use letters"),
        (["trial_name=a/b"], "'trial_name' is 'a/b'"),
        (["ppo.eps_clip=0"], "'ppo.eps_clip' is 0.0; it must be > 0"),
        (["ppo.gae_lambda=1.5"], "'ppo.gae_lambda' is 1.5; it must be <= 1"),
        (["recover_mode=sometimes"], "'recover_mode' is 'sometimes'; choose one of auto, resume, fault"),
        (["actor.backend=jax"], "'actor.backend' is 'jax'"),
        (["ppo.c_clip=0.5"], "'ppo.c_clip' is 0.5; it must be > 1"),
        (
            ["success_rate_lb=0.9", "success_rate_ub=0.5"],
            "'success_rate_lb' (0.9) is above 'success_rate_ub'",
        ),
        (["ppo.gen.min_new_tokens=99999"], "'ppo.gen.min_new_tokens' (99999) is above"),
        (["ppo.gen.stop_token_ids=7,-1"], "'ppo.gen.stop_token_ids' must be at most 1024 token ids >= 0"),
        (["ppo.disable_value=false"], "'critic.path' is required"),
        (["eval.enabled=true"], "'eval.data_dir' is required when 'eval.enabled' is true"),
        # What is not implemented yet is refused, saying what is.
        (
            ["allocation_mode=d1p1m1", "async_rl=true"],
            "'async_rl': colocated generation and training take turns",
        ),
        (["allocation_mode=d1p1m1"], "'weight_update_mode': colocated servers share the trainers' GPUs"),
        (["weight_update_mode=tensor"], "tensor hands GPU memory to servers on the trainers' GPUs"),
        (
            ["allocation_mode=d1p1m1", "weight_update_mode=tensor", "cluster.n_nodes=2", "async_rl=false"],
            "to the servers of its node only, and this run has 2 nodes",
        ),
        (["allocation_mode=actor_train:d1p1m1"], "give actor_gen:<3D spec> or '*:<3D spec>'"),
        (["colocated_gen_backend=sglang"], "'colocated_gen_backend' is set, but allocation_mode"),
        (["allocation_mode=manual"], "manual allocations are not implemented yet"),
        (
            ["allocation_mode=vllm.d4p1m1+d4p1m1"],
            "generation backend 'vllm' is not available (available: builtin, sglang)",
        ),
        (
            ["allocation_mode=builtin.d2p1m2+d4p1m1"],
            "'builtin' has no tensor parallelism: its servers' tensor size must be 1, not 2",
        ),
        (
            ["allocation_mode=builtin.d4p1m1+d2p2m1"],
            "pipeline size 2, but actor.backend 'fsdp' has no pipeline",
        ),
        (
            ["allocation_mode=builtin.d4p1m1+actor_train:d2p1m2,*:d4p1m1"],
            "the layout of actor_train d2p1m2 has tensor",
        ),
        (
            ["ppo.kl_ctl=0.1", "allocation_mode=builtin.d4p1m1+d1p1m4"],
            "but ref.backend 'fsdp' has no tensor",
        ),
        (["allocation_mode=builtin.d4p1m1+actor_inf:d4p1m1"], "no layout for actor_train"),
        (
            ["ppo.disable_value=false", "critic.path=/m", "critic.backend=megatron"],
            "'critic.backend' 'megatron' has no value model yet (give one of fsdp, torch)",
        ),
        (
            ["actor.backend=megatron", "allocation_mode=builtin.d4p1m1+actor_train:d2p1m2"],
            "no layout for MFC 'actor_inf'; give it one",
        ),
        (
            ["actor.backend=torch", "actor.optimizer.offload=true"],
            "'actor.optimizer.offload' needs a backend that offloads (fsdp); 'actor.backend' is 'torch'",
        ),
    ],
)
def test_value_checks_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert message in str(err.value)


def test_a_model_megatron_cannot_split_is_refused_with_its_config_file(tiny_model_dir):
    with pytest.raises(ConfigError) as err:
        load_config(
            overrides=[
                f"actor.path={tiny_model_dir}",
                "actor.backend=megatron",
                "allocation_mode=builtin.d4p1m1+actor_inf:d1p4m1,*:d4p1m1",  # the actor's copy's layout
            ]
        )
    assert f"'actor.path' ({tiny_model_dir / 'config.json'}): 2 layers do not split evenly into 4" in str(
        err.value
    )


def test_recomputing_more_layers_than_the_model_has_is_refused(tiny_model_dir):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[f"actor.path={tiny_model_dir}", "actor.recompute_layers=3"])
    assert "'actor.recompute_layers' is 3, but actor.path has 2 decoder layers: give at most 2" in str(
        err.value
    )


def test_megatron_takes_per_mfc_layouts_that_differ(tiny_model_dir):
    cfg = load_config(
        overrides=[
            f"actor.path={tiny_model_dir}",
            "actor.backend=megatron",
            "allocation_mode=builtin.d4p1m1+actor_train:d2p1m2,actor_inf:d4p1m1",
            "ppo.kl_ctl=0",  # no reference model: no ref_inf to place
            "param_realloc_mode=disk",
            "ppo.gen.max_new_tokens=1000",  # the tiny model's context is 2048
        ]
    )
    assert (mfc_spec(cfg, "actor_train").tensor, mfc_spec(cfg, "actor_inf").data) == (2, 4)


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["ppo.eps_clip=0", "group_size=0"])
    assert "ppo.eps_clip" in str(err.value) and "group_size" in str(err.value)


def test_allocation_is_checked_against_the_cluster():
    with pytest.raises(
        ConfigError, match="'allocation_mode'.*builtin.d4p1m1\\+d4p1m1.*8, but the cluster has"
    ):
        load_config(overrides=["cluster.n_gpus_per_node=4"])
    with pytest.raises(ConfigError, match="'allocation_mode'"):
        load_config(overrides=["allocation_mode=builtin.d4x1"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("mode=slurm", "'mode' is not an option of this version: the command decides where roles run"),
        ("logging.stats_jsonl=false", "statistics always go to logs/stats.jsonl"),
        ("actor_train.device_mesh=n1", "allocation_mode manual is not implemented yet"),
        ("ref_inf.parallel.tensor=2", "allocation_mode manual is not implemented yet"),
    ],
)
def test_options_of_the_original_this_version_lacks_are_refused_saying_why(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=[override])


# One option of each rule of config/inert.py, set where it does nothing (the defaults decide the mode).
DOES_NOTHING = [
    ("max_head_offpolicyness=2", "the rollout role of asynchronous RL"),
    (
        "experiment_type=sft",
        "async_rl=true",
        "a supervised warm-up (experiment_type: sft) generates no rollouts",
    ),
    ("experiment_type=sft", "ppo.eps_clip=0.3", "it applies to RL (experiment_type: ppo)"),
    ("critic.optimizer.lr=1e-6", "there is no critic"),
    ("ppo.kl_ctl=0", "ref.dtype=float32", "there is no reference model"),
    ("exp_ctrl.eval_freq_steps=5", "the held-out evaluation it schedules needs dataset.valid_path"),
    ("exp_ctrl.ckpt_freq_steps=5", "recover_mode is disabled"),
    ("weight_update_mode=disk", "weight_update_bucket_mb=64", "it applies to weight_update_mode broadcast"),
    ("logging.wandb_mode=online", "logging.wandb is false"),
    ("sglang.log_level=info", "it applies to SGLang servers only"),
    ("reward.fn_workers=4", "it applies to reward.fn, which is not set"),
    ("reward.fn=mod:score", "reward.code_isolation=best_effort", "reward.fn scores every answer"),
    ("actor.gradient_checkpointing=false", "actor.recompute_layers=4", "no layer recomputes its activations"),
]


@pytest.mark.parametrize("case", DOES_NOTHING, ids=lambda case: case[-2].split("=")[0])
def test_an_option_that_does_nothing_in_the_mode_is_refused_where_it_was_set(case):
    *overrides, why = case
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    key = overrides[-1].split("=")[0]
    assert f"override '{overrides[-1]}': '{key}' does nothing here: " in str(err.value) and why in str(
        err.value
    )


def test_a_file_line_that_does_nothing_is_named(tmp_path):
    path = write(tmp_path, "logging:\n  wandb: false\n  wandb_mode: online\n")
    with pytest.raises(
        ConfigError, match=f"{re.escape(str(path))}:3: 'logging.wandb_mode' does nothing here"
    ):
        load_config([path])


def test_options_of_a_base_file_that_a_later_layer_makes_idle_are_dropped_with_a_warning(caplog):
    """toy-sft.yaml turns toy-cpu.yaml's RL run into a supervised one: its RL options are a base's, not errors."""
    cfg = load_config(
        [ROOT / "configs/toy-cpu.yaml", ROOT / "configs/toy-sft.yaml"], ["recover_mode=disabled"]
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(m.startswith(f"{ROOT / 'configs/toy-cpu.yaml'} sets ") and "group_size" in m for m in warnings)
    assert any("exp_ctrl.ckpt_freq_steps" in m and "recover_mode is disabled" in m for m in warnings)
    defaults = ExperimentConfig()
    assert (cfg.group_size, cfg.ppo.kl_ctl) == (
        defaults.group_size,
        defaults.ppo.kl_ctl,
    )  # config.yaml says so
    assert cfg.exp_ctrl.ckpt_freq_steps is None and cfg.exp_ctrl.ckpt_freq_secs is None


def test_our_own_default_that_does_nothing_is_dropped_silently(caplog):
    cfg = load_config()  # recover_mode: disabled

    assert cfg.exp_ctrl.ckpt_freq_secs is None and not caplog.records
    assert load_config(overrides=["recover_mode=auto"]).exp_ctrl.ckpt_freq_secs == 600


def test_the_reference_model_takes_no_training_options():
    with pytest.raises(ConfigError, match="unknown key 'ref.optimizer'"):
        load_config(overrides=["ref.optimizer.lr=1e-3"])


@pytest.mark.parametrize("path", [ROOT / "configs/toy-cpu.yaml", None], ids=["toy", "defaults"])
def test_dump_then_reload_gives_an_identical_config(tmp_path, path):
    cfg = load_config([path] if path else [], ["ppo.c_clip=3", "trial_name=t1"])
    reloaded = load_config([write(tmp_path, dump_yaml(cfg))])
    assert reloaded == cfg
    assert dataclasses.asdict(reloaded) == dataclasses.asdict(cfg)


def test_config_show_prints_the_resolved_yaml(capsys):
    assert main(["config", "show", str(ROOT / "configs/toy-cpu.yaml"), "seed=5"]) == 0
    out = capsys.readouterr().out
    assert "seed: 5\n" in out and "experiment_name: toy-cpu\n" in out


def test_config_show_reports_errors_without_a_traceback(capsys):
    assert main(["config", "show", "ppo.eps_clp=1"]) == 2
    assert "unknown key 'ppo.eps_clp'" in capsys.readouterr().err


def test_config_docs_are_up_to_date():
    assert DOCS_PATH.read_text() == render_markdown(), "docs/config.md is stale: run `make docs`"


def test_config_docs_check_detects_a_stale_file(tmp_path):
    out = tmp_path / "config.md"
    assert main(["config", "docs", "--out", str(out)]) == 0
    assert main(["config", "docs", "--out", str(out), "--check"]) == 0
    out.write_text(out.read_text() + "edited\n")
    assert main(["config", "docs", "--out", str(out), "--check"]) == 1


def test_a_reader_that_stops_early_gets_no_traceback():  # `areal-hpc config options | head -1`
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_hpc.cli", "config", "options"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    proc.stdout.close()  # before a line is written: every write fails
    err = proc.stderr.read()
    assert proc.wait() == 141 and err == ""


# mixture-of-experts models: allocation_mode's e


def moe_model(tmp_path: Path, experts: int = 8, key: str = "num_experts") -> Path:
    """A directory with the config.json of a small Qwen3-MoE model (no weights: validation reads none)."""
    hf = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 4,
        "vocab_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        key: experts,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


def test_moe_experts_reads_either_name_of_the_expert_count():
    assert moe_experts({"model_type": "qwen3_moe", "num_experts": 128}) == 128  # Hub configs
    assert moe_experts({"model_type": "qwen2_moe", "num_local_experts": 60}) == 60  # saved by transformers 5
    assert moe_experts({"model_type": "qwen3"}) == 0


def test_megatron_names_a_dense_model_or_experts_that_do_not_split():
    dense = {"model_type": "qwen3", "num_hidden_layers": 4, "vocab_size": 1024}
    assert megatron_model_problems(dense, ep=2) == ["e2 needs a mixture-of-experts model; qwen3 is dense"]
    moe = {**dense, "model_type": "qwen3_moe", "num_experts": 6}
    assert megatron_model_problems(moe, ep=4) == ["6 experts do not split evenly over expert size 4"]
    assert megatron_model_problems(moe, ep=2) == megatron_model_problems(moe) == []


def test_an_moe_model_on_megatron_trains_with_an_expert_size(tmp_path):
    cfg = load_config(
        overrides=[
            f"actor.path={moe_model(tmp_path, key='num_local_experts')}",
            "actor.backend=megatron",
            "ref.backend=megatron",
            "allocation_mode=builtin.d4p1m1+d2p1m2e4",
        ]
    )
    assert mfc_spec(cfg, "actor_train") == ParallelSpec(data=2, tensor=2, pipeline=1, expert=4)
    assert mfc_spec(cfg, "ref_inf").expert == 4


def test_an_expert_size_needs_a_backend_with_expert_parallelism():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["allocation_mode=builtin.d4p1m1+d4p1m1e4"])
    for model in ("actor", "ref"):  # every model on the layout, reported together
        assert (
            f"'allocation_mode': the training layout d4p1m1e4 has expert size 4, but {model}.backend "
            f"'fsdp' has no expert parallelism (backends with it: megatron): give {model}.backend=megatron "
            "for a mixture-of-experts model, or d4p1m1 without e"
        ) in str(err.value)


def test_an_expert_size_needs_an_moe_model_whose_experts_split(tmp_path, tiny_model_dir):
    megatron = ["actor.backend=megatron", "ppo.kl_ctl=0", "allocation_mode=builtin.d4p1m1+d4p1m1e4"]
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[f"actor.path={tiny_model_dir}", *megatron])
    where = f"'actor.path' ({tiny_model_dir / 'config.json'})"
    assert f"{where}: e4 needs a mixture-of-experts model; qwen2 is dense" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[f"actor.path={moe_model(tmp_path, experts=6)}", *megatron])
    assert (
        f"'actor.path' ({tmp_path / 'config.json'}): 6 experts do not split evenly over expert size 4"
        in str(err.value)
    )


@pytest.mark.parametrize(
    "mode, message",
    [
        ("sglang.d4p1m1e2+d4p1m1", "generation servers take expert parallelism from sglang.ep_size"),
        ("builtin.d4p1m1+d2p1m1e4", "expert size 4 must divide d*t = 2*1 = 2"),
    ],
)
def test_an_expert_size_allocation_mode_cannot_hold_is_refused(mode, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[f"allocation_mode={mode}", "actor.backend=megatron"])
    assert f"'allocation_mode': allocation_mode '{mode}'" in str(err.value) and message in str(err.value)


def test_a_context_size_trains_on_fsdp_and_megatron_refuses_it_by_name(tiny_model_dir):
    tiny = [f"actor.path={tiny_model_dir}", "ppo.gen.max_new_tokens=512", "dataset.max_prompt_len=512"]
    cfg = load_config(overrides=[*tiny, "allocation_mode=builtin.d4p1m1+d2p1m1c2"])
    assert mfc_spec(cfg, "actor_train") == ParallelSpec(data=2, tensor=1, pipeline=1, context=2)
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["allocation_mode=builtin.d4p1m1+d2p1m1c2", "actor.backend=megatron"])
    assert (
        "'allocation_mode': the training layout d2p1m1c2 has context size 2, but actor.backend 'megatron' has "
        "no context parallelism (megatron-core's needs Transformer Engine's attention, which is not "
        "installed): give actor.backend=fsdp (Ulysses sequence parallelism), or d4 without c"
    ) in str(err.value)


def test_a_context_size_must_divide_the_models_attention_heads(tiny_model_dir):
    with pytest.raises(ConfigError) as err:  # the tiny model has 4 attention heads
        load_config(overrides=[f"actor.path={tiny_model_dir}", "allocation_mode=builtin.d8p1m1+d1p1m1c8",
                               "cluster.n_nodes=2", "cluster.n_gpus_per_node=8"])  # fmt: skip
    assert "t*c = 1*8, which does not divide 4 attention heads" in str(err.value)
