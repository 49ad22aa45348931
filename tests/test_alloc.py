"""allocation_mode: parsing, formatting, placement on a cluster and the model/batch checks."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_hpc.alloc import (
    MFC_NAMES,
    AllocationError,
    AllocationMode,
    GenServer,
    ParallelSpec,
    check_model_heads,
    check_pipeline_batch,
    format_allocation_mode,
    parse_allocation_mode,
    resolve_allocation,
)

# the examples of REFERENCE.md


def test_reference_one_node_example():
    alloc = resolve_allocation("sglang.d4p1m1+d2p2m1", n_nodes=1, n_gpus_per_node=8)
    assert alloc.mode.kind == "decoupled" and alloc.mode.gen_backend == "sglang"
    assert (alloc.n_gen_gpus, alloc.n_train_gpus) == (4, 4)
    assert alloc.gen_spec == ParallelSpec(data=4, tensor=1, pipeline=1)
    assert alloc.train_spec("actor_train") == ParallelSpec(data=2, tensor=1, pipeline=2)
    assert alloc.gen_servers() == tuple(GenServer(i, (i,), 0, (i,)) for i in range(4))
    ranks = alloc.gpu_map()
    assert [ranks[g].role for g in range(8)] == ["gen"] * 4 + ["train"] * 4
    assert [(ranks[g].dp_rank, ranks[g].pp_rank) for g in range(4, 8)] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_reference_four_node_example():
    alloc = resolve_allocation("sglang.d24p1m1+d4p2m1", n_nodes=4, n_gpus_per_node=8)
    assert (alloc.n_gen_gpus, alloc.n_train_gpus) == (24, 8)
    servers = alloc.gen_servers()
    assert len(servers) == 24 and servers[9] == GenServer(9, (9,), 1, (1,))
    ranks = alloc.gpu_map("actor_train")
    assert {ranks[g].node for g in range(24, 32)} == {3}  # training owns the last node
    first, last = ranks[24], ranks[31]
    assert (first.role, first.local_gpu, first.dp_rank, first.pp_rank) == ("train", 0, 0, 0)
    assert (last.local_gpu, last.dp_rank, last.pp_rank) == (7, 3, 1)


# syntax


def test_generation_part_may_come_second_and_still_gets_the_first_gpus():
    assert parse_allocation_mode("d2p2m1+sglang.d4p1m1") == parse_allocation_mode("sglang.d4p1m1+d2p2m1")
    alloc = resolve_allocation("d2p2m1+vllm.d4p1m1", 1, 8)
    assert [alloc.gpu_map()[g].role for g in range(8)] == ["gen"] * 4 + ["train"] * 4


def test_letters_in_any_order_and_t_means_m():
    assert parse_allocation_mode("p1d4t2") == parse_allocation_mode("d4m2p1")
    assert format_allocation_mode(parse_allocation_mode(" p1d4t2 ")) == "d4p1m2"
    assert parse_allocation_mode(" p1d4t2 ").text == " p1d4t2 "  # errors quote what the user wrote


def test_bare_spec_is_colocated_and_every_mfc_uses_it():
    alloc = resolve_allocation("d2p1m2", 1, 4)
    assert alloc.mode.kind == "colocated" and alloc.n_gen_gpus == 0
    assert {alloc.train_spec(mfc) for mfc in MFC_NAMES} == {ParallelSpec(2, 2, 1)}
    assert {rank.role for rank in alloc.gpu_map("actor_gen").values()} == {"gen"}
    # the servers share the trainers' GPUs: one per tensor group of actor_gen's layout
    assert [s.gpus for s in alloc.gen_servers()] == [(0, 1), (2, 3)] and alloc.gen_tensor == 2


def test_colocated_pipeline_stages_generate_as_servers_of_their_own():
    alloc = resolve_allocation("actor_train:d1p2m2,*:d2p1m2", 2, 2)
    assert [(s.node, s.gpus) for s in alloc.gen_servers()] == [(0, (0, 1)), (1, (2, 3))]
    alloc = resolve_allocation("d1p2m1", 1, 2)
    assert [s.gpus for s in alloc.gen_servers()] == [(0,), (1,)]


def test_per_mfc_layouts_with_default():
    mode = parse_allocation_mode("actor_train:d4m2p1,actor_inf:d8m1p1,*:d2m2p2")
    assert format_allocation_mode(mode) == "actor_inf:d8p1m1,actor_train:d4p1m2,*:d2p2m2"
    alloc = resolve_allocation(mode, 1, 8)
    assert alloc.train_spec("actor_train") == ParallelSpec(4, 2, 1)
    assert alloc.train_spec("actor_inf") == ParallelSpec(8, 1, 1)
    assert alloc.train_spec("ref_inf") == ParallelSpec(2, 2, 2)  # unlisted: the '*' default
    assert alloc.gpu_map("ref_inf")[4].pp_rank == 1


def test_per_mfc_layouts_without_default_need_every_mfc_listed():
    alloc = resolve_allocation("sglang.d4p1m1+actor_train:d4p1m1", 1, 8)
    assert alloc.train_spec("actor_train") == ParallelSpec(4, 1, 1)
    assert alloc.train_spec("actor_gen") == alloc.gen_spec  # decoupled actor_gen is the generation layout
    with pytest.raises(AllocationError, match="no layout for MFC 'ref_inf'"):
        alloc.train_spec("ref_inf")


def test_manual_is_its_own_kind():
    mode = parse_allocation_mode("manual")
    assert mode.kind == "manual" and format_allocation_mode(mode) == "manual"
    with pytest.raises(AllocationError, match="manual meshes are not implemented yet"):
        resolve_allocation(mode, 1, 8)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("d4m2", "lacks p"),
        ("d4p1", "lacks m"),
        ("x2d4m1p1", "unknown letter 'x'"),
        ("d4m2p1d1", "data size twice"),
        ("d4m2p1t1", "tensor size twice"),
        ("d0m1p1", "positive integer, got '0'"),
        ("d-2m1p1", "positive integer, got '-2'"),
        ("dm1p1", "positive integer, got ''"),
        ("4d1m1p1", "must start with one of the letters"),
        ("+d1m1p1", "empty part"),
        ("sglang.d1m1p1+", "empty part"),
        ("sglang.d1p1m1", "needs a training part"),
        ("sglang.d1m1p1+vllm.d1m1p1", "two generation parts"),
        ("d1m1p1+d1m1p1", "two training parts"),
        ("SGLang.d1m1p1+d1m1p1", "generation backend 'SGLang' is not a name"),
        ("sglang.d4m1p1+actor_inf:d4m1p1", "no layout for actor_train"),
        ("sglang.+d1m1p1", "empty 3D spec"),
        ("sglang.d1m1p2+d2m1p1", "generation pipeline size must be 1"),
        ("actor_trian:d1m1p1", "unknown MFC 'actor_trian' (valid: actor_gen, actor_train, actor_inf"),
        ("actor_train:d1m1p1,actor_train:d1m1p1", "'actor_train' is given twice"),
        ("actor_train:d1m1p1,,*:d1m1p1", "is not of the form mfc:3D spec"),
        ("actor_train:d1m1p1,d1m1p1", "is not of the form mfc:3D spec"),
        ("actor_train:d4m1p1,*:d2m1p1", "must use all training GPUs"),
        ("sglang.d1m1p1+actor_gen:d1m1p1", "actor_gen runs on the sglang servers"),
    ],
)
def test_syntax_errors_quote_the_string_and_say_what_is_wrong(text, problem):
    with pytest.raises(AllocationError) as error:
        parse_allocation_mode(text)
    assert f"allocation_mode {text!r}" in str(error.value)
    assert problem in str(error.value)


def test_allocation_error_is_a_value_error():
    assert issubclass(AllocationError, ValueError)
    with pytest.raises(ValueError, match="positive integer"):
        ParallelSpec(0, 1, 1)


# placement on a cluster


@pytest.mark.parametrize(
    "text, n_nodes, per_node, problem",
    [
        ("sglang.d4p1m1+d2p1m1", 1, 8, "generation (4 GPUs) + training (2 GPUs) = 6, but the cluster has"),
        ("sglang.d12p1m1+d4p1m1", 2, 8, "generation uses 12 GPUs; it must use fewer than a node's 8"),
        ("d4p1m1", 2, 8, "multi-node run must use every GPU of every node"),
        ("d4p1m4", 1, 8, "training uses 16 GPUs"),
        ("sglang.d2p1m12+d8p1m1", 4, 8, "generation server 0 (tensor parallel size 12) would span nodes 0-1"),
    ],
)
def test_cluster_errors_quote_the_string(text, n_nodes, per_node, problem):
    with pytest.raises(AllocationError) as error:
        resolve_allocation(text, n_nodes, per_node)
    assert f"allocation_mode {text!r}" in str(error.value) and problem in str(error.value)


def test_one_node_colocated_run_may_leave_gpus_idle():
    assert resolve_allocation("d2p1m1", 1, 8).n_train_gpus == 2


def test_cluster_sizes_must_be_positive():
    with pytest.raises(AllocationError, match="n_gpus_per_node must be a positive integer, got 0"):
        resolve_allocation("d1p1m1", 1, 0)


def test_gpu_map_tensor_is_fastest_then_data_then_pipe():
    ranks = resolve_allocation("d2p2m2", 1, 8).gpu_map()
    coords = [(ranks[g].pp_rank, ranks[g].dp_rank, ranks[g].tp_rank) for g in range(8)]
    assert coords == [(p, d, t) for p in range(2) for d in range(2) for t in range(2)]


def test_rank_of_inverts_coords():
    spec = ParallelSpec(data=3, tensor=2, pipeline=4)
    assert [spec.rank_of(*spec.coords(i)) for i in range(spec.world_size)] == list(range(spec.world_size))


def test_gpu_map_node_and_local_gpu_and_servers_within_nodes():
    alloc = resolve_allocation("sglang.d4p1m4+d16p1m1", 4, 8)
    ranks = alloc.gpu_map()
    gpu13 = ranks[13]  # node 1, local gpu 5: second GPU of generation server 3
    assert (gpu13.node, gpu13.local_gpu, gpu13.role, gpu13.dp_rank, gpu13.tp_rank) == (1, 5, "gen", 3, 1)
    assert (ranks[16].node, ranks[16].role, ranks[16].dp_rank) == (2, "train", 0)
    assert [(s.node, s.local_gpus) for s in alloc.gen_servers()] == [
        (0, (0, 1, 2, 3)),
        (0, (4, 5, 6, 7)),
        (1, (0, 1, 2, 3)),
        (1, (4, 5, 6, 7)),
    ]


def test_a_server_wider_than_a_node_takes_whole_nodes_and_a_task_on_each():
    alloc = resolve_allocation("sglang.d2p1m16+d32p1m1", 8, 8)
    servers = alloc.gen_servers()
    assert [(s.node, s.n_nodes, s.local_gpus) for s in servers] == [
        (0, 2, tuple(range(8))),
        (2, 2, tuple(range(8))),
    ]
    assert [(server.index, rank) for server, rank in alloc.gen_tasks()] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(
        AllocationError, match="would span nodes 0-1 in part; a server must fit in one node or take"
    ):
        resolve_allocation("sglang.d2p1m12+d40p1m1", 8, 8)


def test_small_generation_shares_its_node_with_training():
    alloc = resolve_allocation("mock.d1p1m2+d6p1m1", 1, 8)
    assert alloc.gen_servers() == (GenServer(0, (0, 1), 0, (0, 1)),)
    assert alloc.layout("actor_train").gpus == (2, 3, 4, 5, 6, 7)


# checks against the model and the batch


def test_model_heads_must_divide_by_every_tp():
    alloc = resolve_allocation("sglang.d2p1m2+actor_train:d1p1m4,*:d4p1m1", 1, 8)
    check_model_heads(alloc, n_heads=16, n_kv_heads=8)
    with pytest.raises(
        AllocationError, match="actor_train has tensor parallel size 4, which does not divide 2 KV"
    ):
        check_model_heads(alloc, n_heads=16, n_kv_heads=2)
    with pytest.raises(
        AllocationError,
        match=r"allocation_mode 'sglang.d2p1m2\+.*generation has tensor parallel size 2, which does not divide 3 attention",
    ):
        check_model_heads(alloc, n_heads=3, n_kv_heads=3)


def test_pipeline_needs_two_micro_batches_per_stage_and_dp_rank():
    alloc = resolve_allocation("sglang.d4p1m1+d2p2m1", 1, 8)
    check_pipeline_batch(alloc, n_seqs=8)
    with pytest.raises(
        AllocationError, match=r"'\*' \(d2p2m1\) needs 2\*p\*d = 8 sequences per batch, not 7"
    ):
        check_pipeline_batch(alloc, n_seqs=7)
    check_pipeline_batch(resolve_allocation("d8p1m1", 1, 8), n_seqs=1)  # no pipeline, no constraint


# round trips


specs = st.builds(ParallelSpec, st.integers(1, 8), st.integers(1, 8), st.integers(1, 4))


@st.composite
def modes(draw) -> AllocationMode:
    base = draw(specs)
    sizes = (base.data, base.tensor, base.pipeline)
    keys = draw(st.lists(st.sampled_from([*MFC_NAMES, "*"]), unique=True, min_size=1, max_size=4))
    gen = draw(st.none() | st.builds(ParallelSpec, st.integers(1, 8), st.integers(1, 8), st.just(1)))
    if gen is not None:
        keys = [key for key in keys if key != "actor_gen"] or ["*"]
    if "actor_train" not in keys and "*" not in keys:
        keys.append("*")
    # every per-MFC layout has the same world size: permute the base sizes
    train = {key: ParallelSpec(*draw(st.permutations(sizes))) for key in keys}
    backend = draw(st.sampled_from(["builtin", "sglang", "vllm"])) if gen else None
    return AllocationMode("decoupled" if gen else "colocated", train, backend, gen)


@st.composite
def spellings(draw, mode: AllocationMode) -> str:
    """A non-canonical but equivalent string: shuffled letters, t for m, keys and parts in any order."""

    def spell(spec: ParallelSpec) -> str:
        letters = [f"d{spec.data}", f"p{spec.pipeline}", f"{draw(st.sampled_from('mt'))}{spec.tensor}"]
        return "".join(draw(st.permutations(letters)))

    train = [f"{key}:{spell(spec)}" for key, spec in mode.train]
    if len(mode.train) == 1 and mode.train[0][0] == "*" and draw(st.booleans()):
        train = [spell(mode.train[0][1])]
    parts = [",".join(draw(st.permutations(train)))]
    if mode.gen is not None:
        parts = draw(st.permutations([*parts, f"{mode.gen_backend}.{spell(mode.gen)}"]))
    return "+".join(parts)


@given(modes())
def test_parse_of_format_is_the_same_mode(mode):
    text = format_allocation_mode(mode)
    assert parse_allocation_mode(text) == mode
    assert format_allocation_mode(parse_allocation_mode(text)) == text


@given(st.data())
def test_every_spelling_parses_to_the_mode_and_formats_canonically(data):
    mode = data.draw(modes())
    text = data.draw(spellings(mode))
    assert parse_allocation_mode(text) == mode
    assert format_allocation_mode(parse_allocation_mode(text)) == format_allocation_mode(mode)


@given(
    per_node=st.sampled_from([1, 2, 4, 8]),
    n_nodes=st.integers(1, 4),
    gen_tp=st.sampled_from([1, 2, 4, 8]),
    gen_dp=st.integers(1, 8),
    train_tp=st.sampled_from([1, 2]),
)
def test_gpu_map_covers_every_gpu_once_with_generation_first(per_node, n_nodes, gen_tp, gen_dp, train_tp):
    n_gen, n_gpus = gen_tp * gen_dp, n_nodes * per_node
    n_train = n_gpus - n_gen
    if n_train < 1 or n_train % train_tp or (n_gen >= per_node and n_gen % per_node) or per_node % gen_tp:
        return  # not a layout that fits; the error paths are tested above
    text = f"sglang.d{gen_dp}p1m{gen_tp}+d{n_train // train_tp}p1m{train_tp}"
    ranks = resolve_allocation(text, n_nodes, per_node).gpu_map()
    assert sorted(ranks) == list(range(n_gpus))
    for gpu, rank in ranks.items():
        assert (rank.node, rank.local_gpu) == divmod(gpu, per_node)
        assert rank.role == ("gen" if gpu < n_gen else "train")
        tp = gen_tp if gpu < n_gen else train_tp
        assert gpu - (0 if gpu < n_gen else n_gen) == rank.dp_rank * tp + rank.tp_rank


# expert parallelism: the optional letter e


def test_expert_letter_is_optional_adds_no_gpus_and_formats_last():
    spec = parse_allocation_mode("d2p2t4e4").train[0][1]
    assert spec == ParallelSpec(data=2, tensor=4, pipeline=2, expert=4) and spec.world_size == 16
    assert format_allocation_mode(parse_allocation_mode("e8d4p1m2")) == "d4p1m2e8"
    assert parse_allocation_mode("d4p1m2").train[0][1].expert == 1  # the default
    assert format_allocation_mode(parse_allocation_mode("d4p1m2e1")) == "d4p1m2"  # e1 is left out
    alloc = resolve_allocation("sglang.d4p1m1+d2p2t4e4", n_nodes=5, n_gpus_per_node=4)
    assert (alloc.n_gen_gpus, alloc.n_train_gpus) == (4, 16)
    assert alloc.train_spec("actor_train").expert == 4


def test_expert_size_leaves_the_rank_layout_alone():
    dense, moe = ParallelSpec(2, 4, 2), ParallelSpec(2, 4, 2, expert=8)
    assert [moe.coords(i) for i in range(16)] == [dense.coords(i) for i in range(16)]
    assert moe.rank_of(1, 3, 1) == dense.rank_of(1, 3, 1)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("d2p1m1e4", "3D spec 'd2p1m1e4': expert size 4 must divide d*t = 2*1 = 2"),
        ("d1p4m2e4", "expert size 4 must divide d*t = 1*2 = 2"),  # the pipeline stages do not count
        ("d4p1m2e3", "give an e that divides 8"),
        ("d4p1m1e2e2", "gives the expert size twice"),
        ("d4p1m1e0", "'e' in 3D spec 'd4p1m1e0' needs a positive integer, got '0'"),
        ("d4p1e2", "lacks m"),
        (
            "sglang.d4p1m1e2+d4p1m1",
            "generation expert size must be 1, got e2: generation servers take expert parallelism from "
            "sglang.ep_size, not from allocation_mode",
        ),
        ("actor_gen:d4p1m1e2,*:d4p1m1", "takes no e: generation servers take expert parallelism from"),
    ],
)
def test_expert_size_errors_quote_the_string_and_give_the_numbers(text, problem):
    with pytest.raises(AllocationError) as error:
        parse_allocation_mode(text)
    assert f"allocation_mode {text!r}" in str(error.value) and problem in str(error.value)


def test_a_spec_built_in_code_checks_its_expert_size():
    with pytest.raises(AllocationError, match="expert size must be a positive integer, got 0"):
        ParallelSpec(2, 1, 1, expert=0)
    with pytest.raises(AllocationError, match="expert size 3 must divide d\\*t = 2\\*2 = 4"):
        ParallelSpec(2, 2, 1, expert=3)


def test_colocated_servers_take_no_expert_size_from_a_training_layout_with_e():
    alloc = resolve_allocation("d4p1m2e8", 1, 8)
    assert alloc.train_spec("actor_train").expert == 8
    assert alloc.server_layout.spec == ParallelSpec(4, 2, 1) and len(alloc.gen_servers()) == 4


@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 4), st.data())
def test_a_spec_with_experts_formats_and_parses_back(data_size, tensor, pipeline, data):
    stage = data_size * tensor
    expert = data.draw(st.sampled_from([e for e in range(1, stage + 1) if stage % e == 0]))
    spec = ParallelSpec(data_size, tensor, pipeline, expert)
    text = spec.format()
    assert parse_allocation_mode(text).train == (("*", spec),)
    assert ("e" in text) == (expert > 1) and spec.world_size == stage * pipeline
    mode = parse_allocation_mode(
        f"sglang.d2p1m1+actor_train:{text},*:{ParallelSpec(stage, 1, pipeline).format()}"
    )
    assert parse_allocation_mode(format_allocation_mode(mode)) == mode


# context parallelism: the optional letter c


def test_context_letter_multiplies_the_world_and_formats_before_e():
    spec = parse_allocation_mode("d2p1t1c4").train[0][1]
    assert spec == ParallelSpec(data=2, tensor=1, pipeline=1, context=4) and spec.world_size == 8
    assert format_allocation_mode(parse_allocation_mode("c2e2d2p1m2")) == "d2p1m2c2e2"
    assert format_allocation_mode(parse_allocation_mode("d4p1m1c1")) == "d4p1m1"  # c1 is left out
    alloc = resolve_allocation("sglang.d4p1m1+d2p1m1c4", n_nodes=3, n_gpus_per_node=4)
    assert (alloc.n_gen_gpus, alloc.n_train_gpus) == (4, 8)


def test_a_context_group_is_consecutive_gpus_inside_a_data_replica():
    spec = ParallelSpec(data=2, tensor=2, pipeline=2, context=2)
    coords = [spec.coords(i) for i in range(16)]  # (dp, tp, pp, cp): tensor fastest, then context
    assert coords[:4] == [(0, 0, 0, 0), (0, 1, 0, 0), (0, 0, 0, 1), (0, 1, 0, 1)]
    assert coords[4] == (1, 0, 0, 0) and coords[8] == (0, 0, 1, 0)
    assert [spec.rank_of(*c) for c in coords] == list(range(16))
    ranks = resolve_allocation("d2p1m1c4", 1, 8).gpu_map()
    assert [(ranks[g].dp_rank, ranks[g].cp_rank) for g in range(8)] == [
        (d, c) for d in range(2) for c in range(4)
    ]


def test_colocated_servers_are_one_per_gpu_of_a_context_group():
    alloc = resolve_allocation("d2p1m1c4", 1, 8)
    assert alloc.server_layout.spec == ParallelSpec(8, 1, 1) and len(alloc.gen_servers()) == 8


@pytest.mark.parametrize(
    "text, problem",
    [
        ("d2p1m1c0", "'c' in 3D spec 'd2p1m1c0' needs a positive integer, got '0'"),
        ("d2p1m1c2c2", "gives the context size twice"),
        (
            "sglang.d4p1m1c2+d4p1m1",
            "generation context size must be 1, got c2: a generation server holds each request's whole context",
        ),
        (
            "actor_gen:d4p1m1c2,*:d8p1m1",
            "actor_gen's layout is that of the generation servers, which takes no c",
        ),
    ],
)
def test_context_size_errors_quote_the_string(text, problem):
    with pytest.raises(AllocationError) as error:
        parse_allocation_mode(text)
    assert f"allocation_mode {text!r}" in str(error.value) and problem in str(error.value)


def test_t_times_c_must_divide_the_attention_heads():
    check_model_heads(resolve_allocation("d1p1m2c4", 1, 8), n_heads=16, n_kv_heads=2)  # KV heads repeat
    with pytest.raises(AllocationError, match="t\\*c = 2\\*4, which does not divide 12 attention heads"):
        check_model_heads(resolve_allocation("d1p1m2c4", 1, 8), n_heads=12, n_kv_heads=2)
