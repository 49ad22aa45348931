"""The configuration schema: every option of a run, with its default and help text.

Names follow the original system (REFERENCE.md section 1) where users know them. Each field carries
`help` in its metadata; `choices` and the bounds `ge`, `gt`, `le`, `lt` are checked by `config.checks`.
The algorithm's sections (ppo, ppo.gen, ppo.behav_correction) live in config/algorithm.py and are re-exported
here, as is `opt` (config/fields.py), so that every class imports from this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_hpc.config.algorithm import BehavCorrectionConfig as BehavCorrectionConfig  # re-exported
from areal_hpc.config.algorithm import GenerationConfig as GenerationConfig  # re-exported
from areal_hpc.config.algorithm import PPOConfig
from areal_hpc.config.backends import GEN_BACKENDS, TRAIN_BACKENDS
from areal_hpc.config.fields import opt as opt  # re-exported


class ConfigError(ValueError):
    """A configuration problem; the message names the key and where its value came from."""


class InputError(ValueError):
    """An input the config names (a dataset, a model directory) that cannot work; the message names the option
    and the file."""


@dataclass
class SlurmConfig:
    gen_partition: str | None = opt(None, "Partition of the generation component (null: the site default).")
    train_partition: str | None = opt(None, "Partition of the training component (null: the site default).")
    account: str | None = opt(None, "Slurm account (--account).")
    qos: str | None = opt(None, "Slurm quality of service (--qos).")
    time: str | None = opt(
        None, "Time limit of the job (--time), e.g. '2-00:00:00'; null: partition default."
    )
    constraint: str | None = opt(None, "Node features required (--constraint).")
    nodelist: str | None = opt(None, "Nodes to use (--nodelist), a Slurm hostlist.")
    exclude: str | None = opt(None, "Nodes to avoid (--exclude), a Slurm hostlist.")
    cpus_per_gpu: int = opt(8, "CPUs requested per GPU of each component.", ge=1)
    mem_per_gpu_gb: int = opt(64, "Host memory requested per GPU of each component, in GiB.", ge=1)
    hetjob: bool = opt(
        True, "Submit one heterogeneous job; false: two jobs that meet through the run directory."
    )
    extra_sbatch_lines: list[str] = opt([], "Extra '#SBATCH' options, one per item, e.g. '--reservation=x'.")
    setup_commands: list[str] = opt([], "Shell lines run before each step, e.g. 'module load cuda/12.4'.")
    command_prefix: str | None = opt(
        None, "Prefix of every role's command, e.g. a container: 'apptainer exec --nv /images/areal.sif'."
    )
    python: str | None = opt(None, "Python interpreter of the roles on the nodes (null: the submitting one).")
    signal_grace_secs: int = opt(
        120,
        "Seconds before the time limit at which Slurm sends USR2 (time to write a recover checkpoint).",
        ge=1,
    )


@dataclass
class ClusterConfig:
    fileroot: str = opt(
        "~/areal_hpc", "Root of logs, checkpoints and run state; shared storage on a cluster."
    )
    n_nodes: int = opt(1, "Number of nodes of the whole run.", ge=1)
    n_gpus_per_node: int = opt(8, "GPUs per node (on CPU: worker slots per node).", ge=1)
    gpu_memory_gib: float | None = opt(
        None,
        "Memory of one GPU of the generation partition in GiB (80 for an H100, 141 for an H200); null: unknown, "
        "the KV-cache check at submission is skipped.",
        gt=0,
    )
    slurm: SlurmConfig = opt(SlurmConfig, "Slurm options of the generated sbatch script.")


@dataclass
class OptimizerConfig:
    type: str = opt("adam", "Optimizer (AdamW with decoupled weight decay).", choices=("adam",))
    lr: float = opt(2e-5, "Peak learning rate.", gt=0)
    weight_decay: float = opt(0.05, "Decoupled weight decay.", ge=0)
    beta1: float = opt(0.9, "Adam beta1.", ge=0, lt=1)
    beta2: float = opt(0.95, "Adam beta2.", ge=0, lt=1)
    eps: float = opt(1e-5, "Adam epsilon.", gt=0)
    min_lr_ratio: float = opt(
        0.0, "Final learning rate as a fraction of lr (linear/cosine schedules).", ge=0, le=1
    )
    lr_scheduler_type: str = opt(
        "constant", "Learning-rate schedule after warm-up.", choices=("constant", "linear", "cosine")
    )
    warmup_steps_proportion: float = opt(
        0.001, "Fraction of all optimizer steps spent warming up.", ge=0, le=1
    )
    gradient_clipping: float = opt(1.0, "Clip the global gradient norm to this value.", gt=0)
    offload: bool = opt(
        False,
        "Keep the optimizer state in CPU memory, streamed to the GPU one parameter at a time for the update "
        "(backend fsdp): the GPU holds weights and gradients only.",
    )


@dataclass
class ModelConfig:
    path: str | None = opt(None, "Hugging Face model directory (weights and tokenizer).")
    backend: str = opt(
        "fsdp",
        "Training backend of the trainer ranks (config/backends.py): fsdp shards weights, gradients and "
        "optimizer state over the data-parallel ranks; torch replicates them on every rank; megatron runs "
        "megatron-core with the tensor and pipeline sizes of allocation_mode (no critic yet).",
        choices=tuple(TRAIN_BACKENDS),
    )
    dtype: str = opt("bfloat16", "Compute dtype.", choices=("bfloat16", "float16", "float32"))


@dataclass
class TrainedModelConfig(ModelConfig):
    gradient_checkpointing: bool = opt(True, "Recompute activations in the backward pass to save memory.")
    recompute_layers: int | None = opt(
        None, "With gradient_checkpointing, how many decoder layers recompute their activations (the first ones; "
        "megatron: of each pipeline stage); null: all. Each other layer keeps its activations, which saves its "
        "recomputed forward and holds about tokens per micro-batch x (6 hidden + 3 intermediate) x 2 bytes "
        "(docs/cluster.md).", ge=0,
    )  # fmt: skip
    optimizer: OptimizerConfig = opt(OptimizerConfig, "Optimizer of this model.")


@dataclass
class LoraConfig:
    rank: int = opt(
        0, "Rank of the LoRA adapters the actor trains instead of its weights; 0: full weights.", ge=0
    )
    alpha: float = opt(16.0, "LoRA's alpha: an adapter adds (alpha / rank) B A to its weight.", gt=0)
    dropout: float = opt(0.0, "Dropout on the adapters' inputs while training.", ge=0, lt=1)
    target_modules: list[str] = opt(
        ["all-linear"], "Modules that get adapters, by name (q_proj, v_proj, ...); all-linear: every linear layer "
        "but the LM head (PEFT's names).",
    )  # fmt: skip


@dataclass
class ActorConfig(TrainedModelConfig):
    interface: str | None = opt(
        None,
        "What a trainer rank does on the actor's calls (actor_inf, actor_train or sft_train): null: the experiment "
        "type's (ppo_actor, sft); or 'module:Class' (or a name registered under the entry-point group "
        "areal_hpc.interfaces), built with the config, with train_step and inference (docs/extending.md).",
    )
    router_replay: str = opt(
        "off",
        "Routing replay of a mixture-of-experts actor: rollout: the generation servers return the experts each "
        "token was routed to (SGLang's --enable-return-routed-experts, added by the launcher), kept in the batch "
        "as packed_routed_experts for the trainer to route alike; off: the trainer routes on its own.",
        choices=("off", "rollout"),
    )
    lora: LoraConfig = opt(
        LoraConfig, "LoRA: train low-rank adapters (PEFT) instead of the weights (fsdp backend); the optimizer "
        "holds the adapters' state alone, and the KL reference is the base with the adapters off. Checkpoints "
        "(save_freq) are the adapters as a PEFT folder (areal-hpc eval takes one; areal-hpc export --merge folds "
        "it into its base). weight_update_mode adapter publishes the adapters alone, megabytes, and the servers "
        "serve them (SGLang's --enable-lora, /load_lora_adapter, lora_path; the built-in engine alike); the other "
        "modes publish the weights with the adapters merged in. Memory arithmetic: README's LoRA section.",
    )  # fmt: skip


@dataclass
class MicroBatchSpec:
    n_mbs: int = opt(1, "Minimum number of micro-batches.", ge=1)
    max_tokens_per_mb: int = opt(
        30720,
        "Token budget of a micro-batch per GPU (first-fit-decreasing packing); with allocation_mode's c, a "
        "micro-batch holds c times as many, split over its context group.",
        ge=1,
    )


@dataclass
class MFCConfig:
    mb_spec: MicroBatchSpec = opt(MicroBatchSpec, "Micro-batching of this model function call.")


@dataclass
class DatasetConfig:
    path: str | None = opt(None, "Training prompts, JSONL with query_id, prompt, task, solutions.")
    valid_path: str | None = opt(None, "Held-out prompts in the same format (optional).")
    train_bs_n_seqs: int = opt(512, "Prompts per training step.", ge=1)
    max_prompt_len: int = opt(1024, "Prompts longer than this many tokens are dropped (and counted).", ge=1)
    apply_chat_template: bool = opt(True, "Wrap each prompt in the tokenizer's chat template.")
    loader: str = opt(
        "jsonl",
        "How path and valid_path are read: jsonl (the format above), or 'module:function' (or a name registered "
        "under the entry-point group areal_hpc.dataset_loaders) that takes the path and returns the records as "
        "dicts of the same fields, validated alike (docs/extending.md).",
    )


@dataclass
class ExpCtrlConfig:
    total_train_epochs: int = opt(1, "Passes over the training prompts.", ge=1)
    save_freq_epochs: int | None = opt(None, "Save HF weights every N epochs; null: never.", ge=1)
    save_freq_steps: int | None = opt(None, "Save HF weights every N steps; null: never.", ge=1)
    save_freq_secs: int | None = opt(None, "Save HF weights every N seconds; null: never.", ge=1)
    ckpt_freq_epochs: int | None = opt(None, "Write a recover checkpoint every N epochs; null: never.", ge=1)
    ckpt_freq_steps: int | None = opt(None, "Write a recover checkpoint every N steps; null: never.", ge=1)
    ckpt_freq_secs: int | None = opt(
        600,
        "Write a recover checkpoint every N seconds (unless recover_mode is disabled); null: never.",
        ge=1,
    )
    eval_freq_epochs: int | None = opt(None, "Evaluate every N epochs; null: never.", ge=1)
    eval_freq_steps: int | None = opt(None, "Evaluate every N steps; null: never.", ge=1)
    eval_freq_secs: int | None = opt(None, "Evaluate every N seconds; null: never.", ge=1)
    benchmark_steps: int | None = opt(
        None, "Stop after this many steps (benchmarking); null: run to the end.", ge=1
    )


@dataclass
class EvalConfig:
    enabled: bool = opt(
        False,
        "Evaluate each checkpoint that exp_ctrl.save_freq_* saves and the last step's (every run saves it), in a "
        "job of its own (`areal-hpc eval` on the generation partition; a local process under `areal-hpc run`); "
        "its metrics join the statistics under eval/<set>/ at the checkpoint's step. A failed evaluation never "
        "stops training.",
    )
    data_names: list[str] = opt(["math_500", "aime24", "amc23"], "Evaluation sets: <data_dir>/<name>.jsonl.")
    data_dir: str | None = opt(None, "Folder of the evaluation sets (JSONL with problem and answer).")
    max_gen_tokens: int = opt(32768, "Longest answer, in tokens.", ge=1)
    n_sampling: int = opt(32, "Samples per question besides the greedy answer.", ge=0)
    temperature: float = opt(0.6, "Sampling temperature.", gt=0)
    top_p: float = opt(0.95, "Nucleus sampling threshold.", gt=0, le=1)
    top_k: int = opt(-1, "Sample among the k most likely tokens; -1: all.", ge=-1)
    n_gpus: int = opt(1, "GPUs of an evaluation job, one generation server each (CPU: one server).", ge=1)
    max_concurrent_jobs: int = opt(3, "Evaluation jobs at once; later checkpoints wait their turn.", ge=1)
    time_limit_mins: int = opt(240, "Time limit of an evaluation job, in minutes.", ge=1)


@dataclass
class SGLangConfig:
    """Options of SGLang servers (allocation_mode sglang.*), the launch flags of SGLANG_API.md; the built-in
    server takes the first two too."""

    mem_fraction_static: float = opt(
        0.9,
        "Share of a GPU's memory a server takes for the weights and the KV cache (colocated: leave the trainer "
        "its share).",
        gt=0,
        le=1,
    )
    context_length: int | None = opt(
        32768, "Longest sequence (prompt + answer) a server takes; null: the model's.", ge=1
    )
    log_level: str = opt("warning", "SGLang's log level.", choices=("debug", "info", "warning", "error"))
    ep_size: int = opt(
        1,
        "Expert parallel size of a server (SGLang's --ep-size): a mixture-of-experts model's experts split over "
        "this many of the server's tensor-parallel GPUs; it must divide the servers' tensor size.",
        ge=1,
    )


@dataclass
class RewardConfig:
    """How answers are scored: math and stem tasks by the math verifier, code tasks by running their tests."""

    code_time_secs: float = opt(
        6.0, "CPU seconds of one code test case (the original's 6); the wall clock allows twice that.", gt=0
    )
    code_memory_mb: int = opt(1024, "Address space of a code answer's program, in MiB.", ge=64)
    code_workers: int = opt(
        4, "Code answers checked at once by a rollout process (each case a program).", ge=1
    )
    code_isolation: str = opt(
        "required",
        "required: a run whose nodes cannot isolate model-written code (namespaces, seccomp: docs/cluster.md) "
        "stops before its first step, saying what the site must allow; best_effort: the code then runs with "
        "the limits that hold there, and can read what the run's user can read and use the network.",
        choices=("required", "best_effort"),
    )
    fn: str | None = opt(
        None,
        "A function that scores every answer in place of the task's scorer: 'module:function' or a name "
        "registered under the entry-point group areal_hpc.reward_fns; called fn(prompt, completion, prompt_ids, "
        "completion_ids, **fields of the dataset line but prompt), plain or async, returning the score that "
        "stands for the task success (docs/extending.md); null: by task.",
    )
    fn_batch: bool = opt(
        False,
        "reward.fn scores a batch: it takes lists (prompts, completions, prompt_ids, completion_ids, each field) "
        "and returns a list of scores; false: one answer a call.",
    )
    fn_timeout_secs: float = opt(
        15.0,
        "Longest call of reward.fn (AReaL-lite's 15 s); past it its worker process is killed and replaced and "
        "its answers score 0.",
        gt=0,
    )
    fn_workers: int = opt(2, "Worker processes calling reward.fn in each process that scores answers.", ge=1)


@dataclass
class RolloutConfig:
    workflow: str = opt(
        "single_turn",
        "What one episode is: single_turn (one answer per prompt, the group's answers in one request), tool_loop "
        "(the model calls rollout.tools over up to rollout.max_turns turns), or 'module:function', an async "
        "function (ctx, record) -> reward (docs/agents.md).",
    )
    export: str = opt(
        "concat",
        "How a multi-turn episode becomes training samples: concat (one sample, the whole conversation, loss on "
        "the sampled tokens only) or per_turn (one sample per model turn, with its context).",
        choices=("concat", "per_turn"),
    )
    turn_discount: float = opt(
        1.0, "per_turn: a turn k turns before the last gets reward * turn_discount**k.", ge=0, le=1
    )
    max_turns: int = opt(4, "tool_loop: model turns of an episode at most.", ge=1)
    tools: list[str] = opt(
        ["calculator", "python"],
        "tool_loop: the tools offered to the model, by registered name (calculator, python) or "
        "'module:attribute' naming an agent.Tool.",
    )
    tool_time_secs: float = opt(5.0, "Longest run of one tool call; past it the model gets an error.", gt=0)
    python_state: bool = opt(
        False, "python tool: later calls of an episode see the variables of its earlier calls."
    )
    max_tool_output_chars: int = opt(
        1024, "A tool's answer is cut to this many characters before it goes back to the model.", ge=16
    )
    episode_timeout_secs: float = opt(
        600.0,
        "An episode running longer than this is given up; its group is dropped, logged and counted.",
        gt=0,
    )
    agent: str | None = opt(
        None,
        "An agent to train as it is: 'module:function', a function (base_url, api_key, record) -> reward, async "
        "or plain, that reaches the model through the OpenAI API at base_url with that key (docs/agents.md); it "
        "runs in a thread of its own, so blocking calls are fine. It replaces rollout.workflow.",
    )
    agent_command: str | None = opt(
        None,
        "A program started per episode, trained as it is: OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL in "
        "its environment, the prompt's dataset record as one JSON object on its stdin; its reward is the last "
        "line of its stdout, a number. Killed at rollout.episode_timeout_secs; its output is kept per episode "
        "(docs/agents.md).",
    )
    agent_model: str = opt(
        "policy",
        "The model name the OpenAI endpoint serves to rollout.agent or rollout.agent_command; a request naming "
        "another model gets 404.",
    )
    agent_concurrency: int | None = opt(
        None,
        "The most agent episodes (rollout.agent calls, rollout.agent_command programs) running at once in a "
        "rollout process (the controller's in synchronous RL); the others wait for their turn, and an episode's "
        "rollout.episode_timeout_secs runs from its turn. null: 4 programs per CPU the process may use "
        "(os.sched_getaffinity), functions unlimited; 0: unlimited (docs/agents.md).",
        ge=0,
    )
    agent_output_bytes: int = opt(
        65536,
        "rollout.agent_command: the bytes of its stdout and of its stderr kept per episode (the rest is cut, "
        "and the cut says so).",
        ge=1024,
    )
    agent_env: list[str] = opt(
        [],
        "rollout.agent_command: names of the rollout's environment variables its program gets besides PATH, the "
        "locale, the OPENAI_* variables and its own HOME and TMPDIR (nothing else of the role's environment, "
        "its credentials among it, reaches the program).",
    )
    agent_isolation: str = opt(
        "required",
        "rollout.agent_command: required: a run whose nodes cannot give each program mount and PID namespaces "
        "of its own (docs/agents.md) stops before its first step, saying what the site must allow; "
        "best_effort: the programs then run as the run's user, and can read what it can read (the run's "
        "secret, other episodes' keys) and leave processes behind.",
        choices=("required", "best_effort"),
    )
    transcript_groups: int = opt(
        2,
        "Groups of each step whose episodes' transcripts are kept in logs/episodes/step-<N>.jsonl (messages, "
        "tool calls, token counts, finish reasons, weight versions, reward), for `areal-hpc episodes`: the "
        "first groups to finish. 0: none.",
        ge=0,
    )


@dataclass
class LoggingConfig:
    level: str = opt("INFO", "Log level of every role.", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    progress: bool = opt(True, "`areal-hpc run` shows a progress line (step, reward, ETA) as steps finish.")
    tensorboard: bool = opt(
        True, "TensorBoard event files of the statistics in logs/tensorboard/ (`tensorboard --logdir` it)."
    )
    wandb: bool = opt(
        False, "A W&B run of the statistics in logs/wandb/ (needs the extra: pip install 'areal-hpc[wandb]')."
    )
    wandb_mode: str = opt(
        "offline", "offline: `wandb sync` uploads the run later (compute nodes rarely reach the internet).",
        choices=("offline", "online"),
    )  # fmt: skip
    timeline: bool = opt(
        True, "Every role records its phases in logs/timeline/ (under 1% of a step's time); `areal-hpc trace` "
        "turns them into a Perfetto trace and a per-step table of where the time went.",
    )  # fmt: skip
    profile_step: int = opt(
        0, "Global step whose trainer calls each rank profiles with torch.profiler (CUDA kernels on a GPU) "
        "into logs/timeline/; `areal-hpc trace --cuda` adds them to the trace. 0: none.", ge=0,
    )  # fmt: skip


@dataclass
class ExperimentConfig:
    experiment_name: str = opt("areal-hpc", "Name of the experiment; no '_' allowed.")
    trial_name: str | None = opt(None, "Name of this run of the experiment; null: 'run<timestamp>'.")
    experiment_type: str = opt(
        "ppo",
        "ppo: RL with PPO/GRPO; sft: supervised warm-up on the reference solutions.",
        choices=("ppo", "sft"),
    )
    seed: int = opt(1, "Seed of data order, sampling and initialisation.", ge=0)
    allocation_mode: str = opt(
        "builtin.d4p1m1+d4p1m1",
        "GPU layout of generation and training, '<generation backend>.<3D spec>+<training 3D spec>' "
        "(REFERENCE.md section 2; areal_hpc/alloc.py). A bare training spec such as 'd1p1m1' is colocated: "
        "the generation servers share the trainers' GPUs and take turns with them.",
    )
    colocated_gen_backend: str = opt(
        "builtin",
        "Colocated allocation_mode (a bare 3D spec): the generation backend of the servers on the trainers' "
        "GPUs (a decoupled allocation_mode names its own before the '.').",
        choices=tuple(GEN_BACKENDS),
    )
    cluster: ClusterConfig = opt(ClusterConfig, "Resources and storage.")
    actor: ActorConfig = opt(ActorConfig, "The policy being trained.")
    ref: ModelConfig = opt(
        ModelConfig, "Reference policy of the KL penalty (ppo.kl_ctl > 0); path null: actor.path."
    )
    critic: TrainedModelConfig = opt(
        TrainedModelConfig, "Value model (only when ppo.disable_value is false)."
    )
    actor_train: MFCConfig = opt(MFCConfig, "The actor's PPO update.")
    actor_inf: MFCConfig = opt(MFCConfig, "The actor's logprob recomputation.")
    teacher: ModelConfig = opt(ModelConfig, "Teacher of on-policy distillation (ppo.distill_coef > 0).")
    ref_inf: MFCConfig = opt(MFCConfig, "The reference model's logprobs.")
    teacher_inf: MFCConfig = opt(MFCConfig, "The teacher's logprobs (on-policy distillation).")
    critic_inf: MFCConfig = opt(MFCConfig, "The critic's values.")
    critic_train: MFCConfig = opt(MFCConfig, "The critic's update.")
    dataset: DatasetConfig = opt(DatasetConfig, "Training prompts and batch size.")
    group_size: int = opt(16, "Answers sampled per prompt.", ge=1)
    ppo: PPOConfig = opt(PPOConfig, "The PPO/GRPO algorithm.")
    rollout: RolloutConfig = opt(
        RolloutConfig, "What an episode is: one answer, turns with tool calls, or an agent trained as it is."
    )
    async_rl: bool = opt(
        False,
        "Asynchronous RL: a rollout role generates while the trainers train (REFERENCE.md section 4); "
        "false: each step generates, then trains.",
    )
    interruptible_generation: bool = opt(
        True,
        "Async: a weight update interrupts running requests, which continue on the new weights; false: "
        "running requests are not interrupted: an update waits for them (SGLang's from disk) or pauses them in "
        "place and they go on under the new weights (their version_start: the version published when sent).",
    )
    weight_update_mode: str = opt(
        "broadcast",
        "How new weights reach the generation servers after a train step: broadcast (trainer rank 0 sends them "
        "over a torch.distributed group of its own with every server: NCCL on GPU, gloo on CPU) or disk (rank 0 "
        "saves a safetensors snapshot with a manifest in the run directory; each server loads it) or tensor "
        "(colocated on one node: rank 0 shares its GPU memory, CUDA IPC, and each server copies from it) or "
        "adapter (a LoRA actor: rank 0 writes its adapters, megabytes, as a PEFT folder in the run directory; "
        "each server loads them, SGLang's /load_lora_adapter, and its requests name them).",
        choices=("broadcast", "disk", "tensor", "adapter"),
    )
    param_realloc_mode: str = opt(
        "broadcast",
        "How a model's weights reach its copy on another per-MFC layout (allocation_mode "
        "'actor_train:d2p1m2,actor_inf:d4p1m1') after it trains: broadcast (every trainer rank takes its shards "
        "of the full tensors, gathered over the trainers' process group) or disk (an HF snapshot in the run "
        "directory, saved by the training layout and loaded by the copy).",
        choices=("broadcast", "disk"),
    )
    weight_update_timeout_secs: float = opt(
        300.0,
        "Longest wait of one weight update (group setup, a broadcast, a server's load); past it the run fails "
        "with the server or trainer rank that did not finish.",
        gt=0,
    )
    weight_update_bucket_mb: int = opt(
        512,
        "Broadcast mode: weights travel in buckets of at most this many MiB (one flat buffer each).",
        ge=1,
    )
    max_head_offpolicyness: int = opt(4, "Staleness bound eta; 0 reproduces synchronous PPO.", ge=0)
    max_concurrent_rollouts: int | None = opt(
        None, "Rollouts in flight at once; null: dataset.train_bs_n_seqs.", ge=1
    )
    max_running_requests: int = opt(
        256,
        "Samples a generation server decodes together (SGLang's option; the built-in server's KV pool is shared "
        "by them); the rest wait in its queue.",
        ge=1,
    )
    n_rollout_workers: int | None = opt(
        None, "Rollout worker processes; null: the training world size.", ge=1
    )
    dynamic_sampling: bool = opt(
        False,
        "DAPO's dynamic sampling: a group whose answers all have the same reward is dropped (its prompt used, the "
        "drop counted) and more prompts are drawn until the batch is full.",
    )
    dynamic_sampling_max_rounds: int = opt(
        4,
        "Dynamic sampling: a step draws at most this many batches of prompts (asynchronous: until the groups kept "
        "and dropped since the last step make this many batches), then trains on the groups it kept.",
        ge=1,
    )
    success_rate_lb: float = opt(0.0, "Drop groups whose success rate is below this.", ge=0, le=1)
    success_rate_ub: float = opt(1.0, "Drop groups whose success rate is above this.", ge=0, le=1)
    schedule_policy: str = opt(
        "round_robin",
        "How the generation manager picks a server.",
        choices=("round_robin", "least_requests", "least_token_usage"),
    )
    exp_ctrl: ExpCtrlConfig = opt(ExpCtrlConfig, "When to save, checkpoint, evaluate and stop.")
    eval: EvalConfig = opt(EvalConfig, "Evaluation of the saved checkpoints (REFERENCE.md section 8).")
    sglang: SGLangConfig = opt(SGLangConfig, "SGLang generation servers (allocation_mode sglang.*).")
    reward: RewardConfig = opt(RewardConfig, "Scoring the answers of math, stem and code tasks.")
    recover_mode: str = opt(
        "disabled",
        "auto: resume if a checkpoint exists; resume: must resume; fault: fresh, retries resume; disabled.",
        choices=("auto", "resume", "fault", "disabled"),
    )
    recover_retries: int = opt(1, "How many times a failed run is restarted.", ge=0)
    recover_after: int = opt(10, "Seconds to wait before restarting a failed run.", ge=0)
    recover_keep: int = opt(2, "How many recover checkpoints to keep (the newest).", ge=1)
    logging: LoggingConfig = opt(LoggingConfig, "Logs, statistics and progress display.")
