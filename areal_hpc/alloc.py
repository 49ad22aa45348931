"""allocation_mode: the grammar that places generation and training on the GPUs of a run.

Forms (REFERENCE.md section 2):
  colocated  `d4p1m2`, or per MFC `actor_train:d4p1m2,*:d8p1m1`: every MFC on the same GPUs
  decoupled  `sglang.d4p1m1+d2p2m1` (either side of `+`): generation servers first, training the rest
  manual     `manual`: each MFC names its own device mesh in the config (parsed; not implemented yet)

A 3D spec may add `c`, the context-parallel size (`d2c4`; default 1): the c GPUs of a context group hold the
same sequences and each runs a slice of every micro-batch's tokens (sequence parallelism), so the world is
d*t*p*c. Training backends that lack it and generation servers refuse it (config.checks names which).
It may also add `e`, the expert-parallel size of a mixture-of-experts model (`d2p2t4e4`; default 1). It
takes no GPUs of its own: as in AReaL, with expert-tensor size 1, a pipeline stage's d*t GPUs hold its experts
in groups of e, so e must divide d*t. Generation servers take theirs from `sglang.ep_size` instead.

`parse_allocation_mode` checks the syntax only; `resolve_allocation` places a mode on a cluster of
n_nodes x n_gpus_per_node GPUs and checks the sizes. GPUs are numbered node-major:
global gpu = node * n_gpus_per_node + local gpu. Inside a mesh the axes are [pipe, data, context, tensor] with
tensor fastest, so consecutive GPUs are tensor-parallel peers, and a context group's GPUs are next to each other
(its all-to-alls stay inside a node).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

MFC_NAMES = (
    "actor_gen",
    "actor_train",
    "actor_inf",
    "ref_inf",
    "teacher_inf",
    "critic_inf",
    "critic_train",
    "rew_inf",
)
DEFAULT_KEY = "*"  # the per-MFC layout of every MFC not listed
Kind = Literal["colocated", "decoupled", "manual"]
KINDS = get_args(Kind)

_AXIS_OF_LETTER = {"d": "data", "m": "tensor", "t": "tensor", "p": "pipeline", "c": "context", "e": "expert"}
_LETTER_OF_AXIS = {"data": "d", "tensor": "m (or t)", "pipeline": "p"}  # the letters a 3D spec must give


class AllocationError(ValueError):
    """An allocation_mode, device mesh or layout that cannot work; the message quotes it."""


def _fail(text: str, what: str) -> AllocationError:
    return AllocationError(f"allocation_mode {text!r}: {what}")


def _is_uint(text: str) -> bool:
    return text.isascii() and text.isdigit()


# 3D specs


@dataclass(frozen=True)
class ParallelSpec:
    """Data, tensor, pipeline and context parallel sizes of one mesh, and the expert-parallel size of its MoE
    layers (folded into the data x tensor GPUs of each pipeline stage: it adds none)."""

    data: int
    tensor: int
    pipeline: int
    expert: int = 1
    context: int = 1

    def __post_init__(self) -> None:
        for axis in ("data", "tensor", "pipeline", "expert", "context"):
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AllocationError(f"ParallelSpec {axis} size must be a positive integer, got {value!r}")
        # AReaL's rule world % (p * etp * e) == 0, with expert-tensor size etp 1: an expert group lies within
        # one pipeline stage's d*t GPUs.
        stage = self.data * self.tensor  # the GPUs of a pipeline stage, which hold its experts
        if stage % self.expert:
            raise AllocationError(
                f"3D spec {self.format()!r}: expert size {self.expert} must divide d*t = {self.data}*"
                f"{self.tensor} = {stage}, the GPUs of a pipeline stage; give an e that divides {stage}"
            )

    @property
    def world_size(self) -> int:
        return self.data * self.tensor * self.pipeline * self.context

    def format(self) -> str:
        """Canonical text, letters in d, p, m order, then c and e when above 1: `d4p1m2`, `d2p1m1c4`,
        `d4p1m2e8`."""
        context = f"c{self.context}" if self.context > 1 else ""
        expert = f"e{self.expert}" if self.expert > 1 else ""
        return f"d{self.data}p{self.pipeline}m{self.tensor}{context}{expert}"

    def coords(self, index: int) -> tuple[int, int, int, int]:
        """(dp_rank, tp_rank, pp_rank, cp_rank) of the index-th GPU of the mesh; axes [pipe, data, context,
        tensor]."""
        pp_rank, rest = divmod(index, self.data * self.context * self.tensor)
        dp_rank, rest = divmod(rest, self.context * self.tensor)
        cp_rank, tp_rank = divmod(rest, self.tensor)
        return dp_rank, tp_rank, pp_rank, cp_rank

    def rank_of(self, dp_rank: int, tp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        """The index of the GPU at these coordinates (the inverse of `coords`)."""
        return ((pp_rank * self.data + dp_rank) * self.context + cp_rank) * self.tensor + tp_rank


def _parse_spec(spec: str) -> ParallelSpec:
    """ParallelSpec of `d4m2p1`-like text; errors name the spec but not the whole allocation_mode."""
    if not spec:
        raise AllocationError("empty 3D spec (expected e.g. d4p1m2)")
    if not spec[0].isalpha():
        raise AllocationError(f"3D spec {spec!r} must start with one of the letters d, m (or t), p, c, e")
    sizes: dict[str, int] = {}
    for letter, number in re.findall(r"([A-Za-z])([^A-Za-z]*)", spec):
        axis = _AXIS_OF_LETTER.get(letter)
        if axis is None:
            raise AllocationError(
                f"unknown letter {letter!r} in 3D spec {spec!r} (use d, m or t, p; c and e optional)"
            )
        if axis in sizes:
            raise AllocationError(f"3D spec {spec!r} gives the {axis} size twice")
        if not _is_uint(number) or int(number) < 1:
            raise AllocationError(f"{letter!r} in 3D spec {spec!r} needs a positive integer, got {number!r}")
        sizes[axis] = int(number)
    missing = [_LETTER_OF_AXIS[axis] for axis in _LETTER_OF_AXIS if axis not in sizes]
    if missing:
        given = "d, m or t, p each once; c and e optional"
        raise AllocationError(f"3D spec {spec!r} lacks {' and '.join(missing)} ({given})")
    return ParallelSpec(**sizes)


# allocation_mode syntax


@dataclass(frozen=True)
class AllocationMode:
    """What an allocation_mode string says, before it meets a cluster.

    `train` maps MFC names (and `*`, the default) to layouts, kept sorted with `*` last; a bare 3D spec is
    `(("*", spec),)`. `source` is the text it was parsed from (quoted in errors, not compared).
    """

    kind: Kind
    train: tuple[tuple[str, ParallelSpec], ...] = ()
    gen_backend: str | None = None
    gen: ParallelSpec | None = None
    source: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        pairs = self.train.items() if isinstance(self.train, Mapping) else self.train
        object.__setattr__(self, "train", tuple(sorted(pairs, key=lambda kv: (kv[0] == DEFAULT_KEY, kv[0]))))
        problem = _mode_problem(self)
        if problem:
            raise _fail(self.text, problem)

    @property
    def text(self) -> str:
        """The allocation_mode as the user wrote it (canonical text when built in code)."""
        return self.source or format_allocation_mode(self)

    @property
    def train_world_size(self) -> int:
        """GPUs of every training layout (0 for manual)."""
        return self.train[0][1].world_size if self.train else 0


def _check_mfc_name(mfc: str, text: str) -> None:
    if mfc not in MFC_NAMES:
        raise _fail(text, f"unknown MFC {mfc!r} (valid: {', '.join(MFC_NAMES)})")


_GEN_EXPERTS = "generation servers take expert parallelism from sglang.ep_size, not from allocation_mode"
_GEN_CONTEXT = "a generation server holds each request's whole context (context parallelism is the trainer's)"


def _mode_problem(mode: AllocationMode) -> str | None:
    """What makes a mode inconsistent, or None."""
    if mode.kind not in KINDS:
        return f"unknown kind {mode.kind!r} (valid: {', '.join(KINDS)})"
    if mode.kind == "manual":
        return "a manual allocation has no layouts in the string" if mode.train or mode.gen_backend else None
    if mode.kind == "decoupled":
        if not re.fullmatch(r"[a-z][a-z0-9_]*", mode.gen_backend or ""):
            return f"generation backend {mode.gen_backend!r} is not a name (lowercase letters, digits, '_')"
        if mode.gen is None:
            return "a decoupled allocation needs a generation layout"
        if mode.gen.pipeline != 1:
            return f"generation pipeline size must be 1, got p{mode.gen.pipeline}"
        if mode.gen.expert != 1:
            return f"generation expert size must be 1, got e{mode.gen.expert}: {_GEN_EXPERTS}"
        if mode.gen.context != 1:
            return f"generation context size must be 1, got c{mode.gen.context}: {_GEN_CONTEXT}"
    elif mode.gen is not None or mode.gen_backend is not None:
        return "a colocated allocation has no generation backend"
    if not mode.train:
        return "no training layout"
    keys = [key for key, _ in mode.train]
    for key in keys:
        if key != DEFAULT_KEY and key not in MFC_NAMES:
            return f"unknown MFC {key!r} (valid: {', '.join(MFC_NAMES)}, or '*' for the rest)"
    if len(set(keys)) != len(keys):
        twice = sorted({key for key in keys if keys.count(key) > 1})
        return f"MFC {twice[0]!r} is given twice"
    if mode.kind == "decoupled" and "actor_gen" in keys:
        return f"actor_gen runs on the {mode.gen_backend} servers; it takes no training layout"
    gen = dict(mode.train).get("actor_gen", ParallelSpec(1, 1, 1))
    if gen.expert != 1:
        return f"actor_gen's layout is that of the generation servers, which takes no e: {_GEN_EXPERTS}"
    if gen.context != 1:
        return f"actor_gen's layout is that of the generation servers, which takes no c: {_GEN_CONTEXT}"
    if "actor_train" not in keys and DEFAULT_KEY not in keys:
        return (
            "no layout for actor_train: give actor_train:<3D spec> or '*:<3D spec>' for every MFC not listed"
        )
    sizes = {key: spec.world_size for key, spec in mode.train}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{key}:{spec.format()} uses {spec.world_size}" for key, spec in mode.train)
        return f"every per-MFC layout must use all training GPUs, but {listed}"
    return None


def parse_allocation_mode(text: str) -> AllocationMode:
    """Parse an allocation_mode string (syntax only; `resolve_allocation` checks it against a cluster)."""
    if not isinstance(text, str):
        raise AllocationError(f"allocation_mode must be a string, got {text!r}")
    stripped = text.strip()
    if stripped == "manual":
        return AllocationMode("manual", source=text)
    try:
        train, backend, gen = _parse_parts(stripped)
    except AllocationError as e:
        raise _fail(text, str(e)) from None
    kind = "colocated" if backend is None else "decoupled"
    return AllocationMode(kind, train, backend, gen, source=text)


def _parse_parts(text: str) -> tuple[list[tuple[str, ParallelSpec]], str | None, ParallelSpec | None]:
    if not text:
        raise AllocationError("empty (expected e.g. 'builtin.d4p1m1+d2p2m1', 'd8p1m1' or 'manual')")
    parts = [part.strip() for part in text.split("+")]
    if not all(parts):
        raise AllocationError("empty part before or after '+'")
    gen_parts = [part for part in parts if "." in part]  # `<backend>.<3D spec>`
    train_parts = [part for part in parts if "." not in part]
    if len(gen_parts) > 1:
        raise AllocationError(f"two generation parts {gen_parts[0]!r} and {gen_parts[1]!r}; give one")
    if len(train_parts) > 1:
        raise AllocationError(f"two training parts {train_parts[0]!r} and {train_parts[1]!r}; give one")
    if not train_parts:
        raise AllocationError(f"generation part {gen_parts[0]!r} needs a training part after '+'")
    train = _parse_train(train_parts[0])
    if not gen_parts:
        return train, None, None
    backend, _, spec = gen_parts[0].partition(".")
    return train, backend, _parse_spec(spec)


def _parse_train(part: str) -> list[tuple[str, ParallelSpec]]:
    """A bare 3D spec (every MFC) or `mfc:spec,...,*:spec`; names are checked by AllocationMode."""
    if ":" not in part:
        return [(DEFAULT_KEY, _parse_spec(part))]
    pairs = []
    for entry in part.split(","):
        key, colon, spec = (piece.strip() for piece in entry.partition(":"))
        if not colon or not key:
            raise AllocationError(f"entry {entry.strip()!r} of {part!r} is not of the form mfc:3D spec")
        pairs.append((key, _parse_spec(spec)))
    return pairs


def format_allocation_mode(mode: AllocationMode | Allocation) -> str:
    """Canonical text: generation part first, letters d, p, m (then c and e when above 1), per-MFC keys sorted
    with `*` last."""
    if isinstance(mode, Allocation):
        mode = mode.mode
    if mode.kind == "manual":
        return "manual"
    if len(mode.train) == 1 and mode.train[0][0] == DEFAULT_KEY:
        train = mode.train[0][1].format()
    else:
        train = ",".join(f"{key}:{spec.format()}" for key, spec in mode.train)
    if mode.gen is None:
        return train
    return f"{mode.gen_backend}.{mode.gen.format()}+{train}"


# layouts on a cluster


@dataclass(frozen=True)
class Placement:
    """Where one mesh runs: its global GPUs in mesh order and its parallel sizes."""

    gpus: tuple[int, ...]
    spec: ParallelSpec


@dataclass(frozen=True)
class GpuRank:
    """What one GPU does for one mesh."""

    gpu: int
    node: int
    local_gpu: int
    role: Literal["gen", "train"]
    dp_rank: int
    tp_rank: int
    pp_rank: int
    cp_rank: int = 0


@dataclass(frozen=True)
class GenServer:
    """One generation server: one tensor-parallel group of the generation layout, inside one node, or on
    whole consecutive nodes from `node` on (SGLang's multi-node tensor parallelism: a task per node)."""

    index: int
    gpus: tuple[int, ...]
    node: int
    local_gpus: tuple[int, ...]  # on each of its nodes
    n_nodes: int = 1


@dataclass(frozen=True)
class Allocation:
    """An allocation mode placed on a cluster. Build it with `resolve_allocation`."""

    mode: AllocationMode
    n_nodes: int
    n_gpus_per_node: int
    layouts: tuple[tuple[str, Placement], ...]  # by MFC name or `*`
    gen_layout: Placement | None = None  # the generation servers (decoupled only)

    @property
    def n_gpus(self) -> int:
        return self.n_nodes * self.n_gpus_per_node

    @property
    def n_gen_gpus(self) -> int:
        """GPUs given to generation servers (0 unless decoupled)."""
        return len(self.gen_layout.gpus) if self.gen_layout else 0

    @property
    def n_train_gpus(self) -> int:
        """GPUs used by the trainer's MFCs."""
        return len({gpu for _, placement in self.layouts for gpu in placement.gpus})

    @property
    def gen_spec(self) -> ParallelSpec | None:
        return self.gen_layout.spec if self.gen_layout else None

    def layout(self, mfc: str) -> Placement:
        """Placement of an MFC: decoupled actor_gen is the generation layout; else its entry or `*`."""
        _check_mfc_name(mfc, self.mode.text)
        if mfc == "actor_gen" and self.gen_layout is not None:
            return self.gen_layout
        layouts = dict(self.layouts)
        placement = layouts.get(mfc, layouts.get(DEFAULT_KEY))
        if placement is None:
            raise _fail(self.mode.text, f"no layout for MFC {mfc!r}; give it one")
        return placement

    def train_spec(self, mfc: str) -> ParallelSpec:
        """Parallel sizes of an MFC (see `layout`)."""
        return self.layout(mfc).spec

    def gpu_map(self, mfc: str = "actor_train") -> dict[int, GpuRank]:
        """Global GPU -> its ranks: the generation servers' GPUs plus the GPUs that run `mfc`."""
        ranks = self._ranks(self.gen_layout, "gen") if self.gen_layout else {}
        ranks |= self._ranks(self.layout(mfc), "gen" if mfc == "actor_gen" else "train")
        return dict(sorted(ranks.items()))

    @property
    def colocated(self) -> bool:
        """The generation servers share the trainers' GPUs (a bare 3D spec)."""
        return self.mode.kind == "colocated"

    @property
    def gen_tensor(self) -> int:
        """GPUs of one generation server."""
        return self.server_layout.spec.tensor

    @property
    def server_layout(self) -> Placement:
        """Where the generation servers run: decoupled, the generation layout; colocated, the GPUs of actor_gen,
        shared with the trainers (a server is a tensor group of that layout; its pipeline stages and the GPUs of
        a context group are servers of their own, as a server has neither)."""
        if self.gen_layout is not None:
            return self.gen_layout
        placement = self.layout("actor_gen")
        spec = placement.spec
        return Placement(
            placement.gpus, ParallelSpec(spec.data * spec.pipeline * spec.context, spec.tensor, 1)
        )

    def gen_servers(self) -> tuple[GenServer, ...]:
        """The generation servers, one per generation TP group, in GPU order."""
        gpus, tp = self.server_layout.gpus, self.server_layout.spec.tensor
        groups = [gpus[start : start + tp] for start in range(0, len(gpus), tp)]
        per_node = self.n_gpus_per_node
        return tuple(
            GenServer(
                i,
                group,
                group[0] // per_node,
                tuple(g % per_node for g in group if g // per_node == group[0] // per_node),
                len({g // per_node for g in group}),
            )
            for i, group in enumerate(groups)
        )

    def gen_tasks(self) -> tuple[tuple[GenServer, int], ...]:
        """(server, node rank) of each gen_server task, in task order: a server's node ranks on its
        consecutive nodes, as Slurm's block distribution places a step's tasks."""
        return tuple((server, rank) for server in self.gen_servers() for rank in range(server.n_nodes))

    def _ranks(self, placement: Placement, role: Literal["gen", "train"]) -> dict[int, GpuRank]:
        out = {}
        for index, gpu in enumerate(placement.gpus):
            node, local = divmod(gpu, self.n_gpus_per_node)
            dp_rank, tp_rank, pp_rank, cp_rank = placement.spec.coords(index)
            out[gpu] = GpuRank(gpu, node, local, role, dp_rank, tp_rank, pp_rank, cp_rank)
        return out


def _check_cluster(n_nodes: int, n_gpus_per_node: int) -> None:
    for name, value in (("n_nodes", n_nodes), ("n_gpus_per_node", n_gpus_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise AllocationError(f"{name} must be a positive integer, got {value!r}")


def resolve_allocation(mode: AllocationMode | str, n_nodes: int, n_gpus_per_node: int) -> Allocation:
    """Place a colocated or decoupled mode on n_nodes x n_gpus_per_node GPUs and check that it fits."""
    if isinstance(mode, str):
        mode = parse_allocation_mode(mode)
    _check_cluster(n_nodes, n_gpus_per_node)
    if mode.kind == "manual":
        raise _fail(mode.text, "manual meshes are not implemented yet")
    n_gen = mode.gen.world_size if mode.gen else 0
    train_gpus = tuple(range(n_gen, n_gen + mode.train_world_size))  # generation takes the first GPUs
    allocation = Allocation(
        mode,
        n_nodes,
        n_gpus_per_node,
        layouts=tuple((key, Placement(train_gpus, spec)) for key, spec in mode.train),
        gen_layout=Placement(tuple(range(n_gen)), mode.gen) if mode.gen else None,
    )
    problem = _cluster_problem(allocation)
    if problem:
        raise _fail(mode.text, problem)
    return allocation


def _cluster_problem(alloc: Allocation) -> str | None:
    """Why an allocation does not fit its cluster, or None."""
    n_gen, n_train = alloc.n_gen_gpus, alloc.n_train_gpus
    n_gpus, per_node = alloc.n_gpus, alloc.n_gpus_per_node
    cluster = f"the cluster has {alloc.n_nodes} node(s) x {per_node} GPUs = {n_gpus}"
    decoupled = alloc.gen_layout is not None
    if decoupled and n_gen >= per_node and n_gen % per_node:
        return f"generation uses {n_gen} GPUs; it must use fewer than a node's {per_node} or a multiple of it"
    if decoupled and n_gen + n_train != n_gpus:
        return f"generation ({n_gen} GPUs) + training ({n_train} GPUs) = {n_gen + n_train}, but {cluster}"
    if n_train > n_gpus:
        return f"training uses {n_train} GPUs, but {cluster}"
    if alloc.n_nodes > 1 and n_gen + n_train != n_gpus:
        return f"a multi-node run must use every GPU of every node, but uses {n_gen + n_train}; {cluster}"
    for server in alloc.gen_servers():
        whole_nodes = server.gpus[0] % per_node == 0 and len(server.gpus) % per_node == 0
        if server.n_nodes > 1 and not whole_nodes:
            return (
                f"generation server {server.index} (tensor parallel size {len(server.gpus)}) would span "
                f"nodes {server.node}-{server.gpus[-1] // per_node} in part; a server must fit in one node "
                f"or take whole nodes (a tensor size that is a multiple of {per_node})"
            )
    return None


# checks against the model and the batch


def _all_layouts(alloc: Allocation) -> Iterable[tuple[str, ParallelSpec]]:
    if alloc.gen_layout is not None:
        yield "generation", alloc.gen_layout.spec
    for key, placement in alloc.layouts:
        yield ("the default layout '*'" if key == DEFAULT_KEY else key), placement.spec


def check_model_heads(alloc: Allocation, n_heads: int, n_kv_heads: int) -> None:
    """Every tensor-parallel size must divide the model's attention heads and KV heads, and t*c its attention
    heads (sequence parallelism gives each rank of a context group heads of its own; KV heads that c does not
    divide are repeated)."""
    for name, spec in _all_layouts(alloc):
        for count, what in ((n_heads, "attention heads"), (n_kv_heads, "KV heads")):
            if count % spec.tensor:
                problem = (
                    f"{name} has tensor parallel size {spec.tensor}, which does not divide {count} {what}"
                )
                raise _fail(alloc.mode.text, problem)
        if n_heads % (spec.tensor * spec.context):
            problem = (
                f"{name} has t*c = {spec.tensor}*{spec.context}, which does not divide {n_heads} attention "
                "heads (each rank of a context group takes heads of its own); give a c that divides "
                f"{n_heads // spec.tensor}"
            )
            raise _fail(alloc.mode.text, problem)


def check_pipeline_batch(alloc: Allocation, n_seqs: int) -> None:
    """With pipeline size p > 1 each data-parallel rank needs 2*p micro-batches of one sequence or more."""
    for name, spec in _all_layouts(alloc):
        need = 2 * spec.pipeline * spec.data
        if spec.pipeline > 1 and n_seqs < need:
            problem = f"{name} ({spec.format()}) needs 2*p*d = {need} sequences per batch, not {n_seqs}"
            raise _fail(alloc.mode.text, problem)
