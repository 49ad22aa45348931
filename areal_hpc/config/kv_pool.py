"""One row at the longest prompt and answer against what a generation server holds, checked before anything is
submitted: a server refuses a request whose prompt + max_new_tokens exceeds its context length (both backends:
SGLang's tokenizer_manager, the built-in engine's _check_fits) or, on the built-in server, its KV pool.

The config stage may not import the generation stage (tests/test_layering.py), so the pool's arithmetic is
repeated here from areal_hpc/gen/backends/builtin/cache.py (PAGE, RESERVED_BYTES, budget_bytes, plan) and
model.py (Shape.kv_bytes_per_token): a change there is a change here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from areal_hpc import alloc
from areal_hpc.config.schema import ExperimentConfig

PAGE = 16  # token positions per page of the pool: builtin/paged_decode.PAGE
RESERVED_BYTES = 3 << 30  # left free on a GPU for activations and CUDA graphs: builtin/cache.RESERVED_BYTES
ITEMSIZE = 2  # bytes of a bfloat16, the built-in server's dtype on a GPU (builtin/loading.resolve_dtype)


def kv_bytes_per_token(hf: dict) -> int:
    """Bytes of K and V one token adds to the cache over every layer, for the HF config.json ``hf`` (Shape.of and
    Shape.kv_bytes_per_token, in bfloat16)."""
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return hf["num_hidden_layers"] * 2 * hf.get("num_key_value_heads", heads) * head_dim * ITEMSIZE


def parameter_count(path: str | Path) -> int | None:
    """Elements of the tensors of the model directory's *.safetensors files (their headers only), or None when
    there are none to read."""
    files, count = sorted(Path(path).expanduser().glob("*.safetensors")), 0
    if not files:
        return None
    try:  # a file: 8 bytes of header length (little-endian), the header (JSON of name -> dtype, shape), the data
        for file in files:
            with file.open("rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            count += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not a safetensors file after all: loading the model says why
    return count


def budget_bytes(gpu_bytes: int, mem_fraction: float, weights_bytes: int) -> int:
    """What the pool may take on a GPU of ``gpu_bytes`` (cache.budget_bytes, its total for the free memory)."""
    return int(mem_fraction * gpu_bytes) - weights_bytes - RESERVED_BYTES


def pool_tokens(budget: int, per_token: int) -> int:
    """Positions a row may use in a pool of ``budget`` bytes: whole pages, less the scratch page (cache.plan and
    Plan.tokens)."""
    pages = max(budget, 0) // (PAGE * per_token)
    return max(pages - 1, 0) * PAGE


def problems(cfg: ExperimentConfig, hf: dict | None) -> list[str]:
    """One row of the longest prompt (dataset.max_prompt_len) and answer (ppo.gen.max_new_tokens) against the
    servers' context length and, for the built-in server on a GPU of known memory, its KV pool. ``hf``: the
    actor's config.json, None where actor.path is not readable here (it may exist on the cluster only): then
    sglang.context_length alone bounds the context and the pool is not checked."""
    prompt, new = cfg.dataset.max_prompt_len, cfg.ppo.gen.max_new_tokens
    if cfg.experiment_type != "ppo" or prompt < 1 or new < 1:
        return []  # a supervised warm-up generates nothing; out-of-bounds lengths: their bounds check says why
    need = prompt + new
    row = f"'ppo.gen.max_new_tokens' {new} + 'dataset.max_prompt_len' {prompt} = {need}"
    where = f"'actor.path' ({Path(cfg.actor.path or '') / 'config.json'})"
    text = None if hf is None else hf.get("text_config", hf)
    model_len = None if text is None else text.get("max_position_embeddings")
    # The built-in single_turn asks for ppo.gen.max_new_tokens in every request (gen/rollout.py); a multi-turn
    # workflow or an agent cuts each turn's to the room the context leaves (gen/episode.py, gen/endpoint.py), so
    # that a longer answer is served, cut, and its longest row is the context.
    single = cfg.rollout.workflow == "single_turn" and not (cfg.rollout.agent or cfg.rollout.agent_command)
    problem = _context_problem(cfg, row, need, model_len, where) if single else None
    out = [problem] if problem else []
    limit = _context(cfg, model_len)
    if not single and limit is not None and need > limit:
        need, row = limit, f"{row} cut to the context, {limit}"
    try:
        backend = alloc.parse_allocation_mode(cfg.allocation_mode).gen_backend or cfg.colocated_gen_backend
    except alloc.AllocationError:
        return out  # the allocation check says why
    gib, fraction = cfg.cluster.gpu_memory_gib, cfg.sglang.mem_fraction_static
    if backend != "builtin" or gib is None or gib <= 0 or not 0 < fraction <= 1 or text is None:
        return out
    params = parameter_count(cfg.actor.path)
    if params is None or "num_attention_heads" not in text:
        return out
    # The built-in server has no tensor parallelism (config/backends.py): its one GPU holds all weights.
    weights, per_token = params * ITEMSIZE, kv_bytes_per_token(text)
    budget = budget_bytes(int(gib * 2**30), fraction, weights)
    tokens = pool_tokens(budget, per_token)
    if tokens < need:
        out.append(
            f"'cluster.gpu_memory_gib' {gib} leaves the built-in server's KV cache {tokens} positions, fewer than "
            f"the longest row: {row} (sglang.mem_fraction_static {fraction} of {gib} GiB, less {_gib(weights)} "
            f"GiB of weights and {_gib(RESERVED_BYTES)} GiB reserved, leaves {_gib(max(budget, 0))} GiB at "
            f"{per_token} bytes a position): raise sglang.mem_fraction_static, lower ppo.gen.max_new_tokens or "
            "dataset.max_prompt_len, or generate on GPUs with more memory"
        )
    return out


def _context_problem(
    cfg: ExperimentConfig, row: str, need: int, model_len: int | None, where: str
) -> str | None:
    """The row against min(sglang.context_length or the model's, the model's), as the built-in engine takes it
    (SGLang refuses to start with a context_length over the model's)."""
    configured = cfg.sglang.context_length
    if configured is not None and configured < 1:
        return None  # its bounds check says why
    if configured is not None and (model_len is None or configured <= model_len):
        if need <= configured:
            return None
        raise_to = f", or raise sglang.context_length to {need}" if model_len is None or need <= model_len else (
            f" (the model takes at most {model_len}: max_position_embeddings of {where})"
        )  # fmt: skip
        return (
            f"{row} exceeds 'sglang.context_length' {configured}, the longest prompt + answer a generation "
            f"server takes: lower ppo.gen.max_new_tokens or dataset.max_prompt_len{raise_to}"
        )
    if model_len is None or need <= model_len:
        return None
    cut = "" if configured is None else f" ('sglang.context_length' {configured} is more than it takes)"
    return (
        f"{row} exceeds the model's context, max_position_embeddings {model_len} of {where}{cut}: lower "
        "ppo.gen.max_new_tokens or dataset.max_prompt_len"
    )


def _context(cfg: ExperimentConfig, model_len: int | None) -> int | None:
    """The longest prompt + answer a server takes: min(sglang.context_length or the model's, the model's); None
    when neither is known."""
    configured = cfg.sglang.context_length if (cfg.sglang.context_length or 0) >= 1 else None
    return min(filter(None, (configured, model_len)), default=None)


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g}"
