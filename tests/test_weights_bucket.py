"""Buckets of named tensors: the plan, the flat buffer and back, and the request fields (pure)."""

from __future__ import annotations

import pytest
import torch

from areal_hpc.weights.bucket import (
    FieldError,
    Stager,
    TensorMeta,
    bucket_fields,
    empty_buffer,
    flatten,
    metas_from_fields,
    plan_buckets,
    tensor_meta,
    unflatten,
)

KB = 1024


def named(*specs: tuple[str, tuple[int, ...], torch.dtype]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape, dtype in specs}


def test_buckets_keep_order_and_stay_under_the_limit():
    metas = [
        TensorMeta(f"model.layers.{i}.mlp.up_proj.weight", "float32", (16, 16)) for i in range(10)
    ]  # 1 KiB each
    buckets = plan_buckets(metas, 3 * KB)
    assert [len(b) for b in buckets] == [3, 3, 3, 1]
    assert [m for b in buckets for m in b] == metas
    assert all(sum(m.nbytes for m in b) <= 3 * KB for b in buckets)


def test_a_tensor_larger_than_a_bucket_gets_a_bucket_of_its_own():
    small, big = (
        TensorMeta("a", "float32", (16,)),
        TensorMeta("model.embed_tokens.weight", "float32", (64, 64)),
    )
    buckets = plan_buckets([small, big, TensorMeta("b", "float32", (16,))], 1 * KB)
    assert [[m.name for m in b] for b in buckets] == [["a"], ["model.embed_tokens.weight"], ["b"]]


def test_dtypes_never_share_a_bucket():
    metas = [
        TensorMeta("w0", "bfloat16", (8,)),
        TensorMeta("norm0", "float32", (8,)),
        TensorMeta("w1", "bfloat16", (8,)),
        TensorMeta("norm1", "float32", (8,)),
    ]
    buckets = plan_buckets(metas, 1 * KB)
    assert [[m.name for m in b] for b in buckets] == [["w0", "w1"], ["norm0", "norm1"]]
    assert all(len({m.dtype for m in b}) == 1 for b in buckets)


def test_flatten_then_unflatten_round_trips_names_shapes_and_values():
    weights = named(
        ("q.weight", (4, 3), torch.bfloat16), ("q.bias", (4,), torch.bfloat16), ("s", (), torch.bfloat16)
    )
    metas = [tensor_meta(n, t) for n, t in weights.items()]
    flat = flatten(list(weights.values()))
    assert flat.shape == (4 * 3 + 4 + 1,) and flat.dtype == torch.bfloat16
    back = unflatten(flat, metas)
    assert [n for n, _ in back] == list(weights)
    for (name, tensor), original in zip(back, weights.values(), strict=True):
        assert tensor.shape == original.shape and torch.equal(tensor, original), name


def test_flatten_casts_to_the_sent_dtype_and_the_receiver_buffer_matches():
    weights = named(("a", (5, 2), torch.float32), ("b", (3,), torch.float32))
    metas = [tensor_meta(n, t, torch.bfloat16) for n, t in weights.items()]
    assert metas[0] == TensorMeta("a", "bfloat16", (5, 2)) and metas[0].nbytes == 20
    flat = flatten(list(weights.values()), torch.bfloat16)
    buffer = empty_buffer(metas)
    assert buffer.shape == flat.shape and buffer.dtype == flat.dtype
    buffer.copy_(flat)
    assert torch.equal(dict(unflatten(buffer, metas))["a"], weights["a"].bfloat16())


def test_the_stager_flattens_as_flatten_does_into_one_buffer_reused_by_every_bucket():
    weights = named(("a", (5, 2), torch.float32), ("b", (3,), torch.bfloat16), ("c", (4, 4), torch.bfloat16))
    buckets = plan_buckets([tensor_meta(n, t, torch.bfloat16) for n, t in weights.items()], bucket_bytes=32)
    assert [[m.name for m in b] for b in buckets] == [["a", "b"], ["c"]]
    stager = Stager(buckets)
    for scale in (1.0, -2.0):  # a second publication: the same places, the new values (of two dtypes)
        flat = stager.flat(0, [weights["a"] * scale, weights["b"] * scale])
        assert torch.equal(flat, flatten([weights["a"] * scale, weights["b"] * scale], torch.bfloat16))
    assert stager.flat(1, [weights["c"]]).data_ptr() == weights["c"].data_ptr()  # sent as it is
    sliced = weights["c"][:, :2]  # not contiguous: staged
    buckets = plan_buckets([tensor_meta("s", sliced)], bucket_bytes=32)
    assert torch.equal(Stager(buckets).flat(0, [sliced]), sliced.flatten())


def test_mixed_dtypes_or_a_short_buffer_are_refused():
    with pytest.raises(ValueError, match="one dtype"):
        flatten([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="one dtype"):
        empty_buffer([TensorMeta("a", "float32", (1,)), TensorMeta("b", "float16", (1,))])
    with pytest.raises(ValueError, match="does not hold the bucket's 6 elements"):
        unflatten(torch.zeros(5), [TensorMeta("a", "float32", (2, 3))])
    with pytest.raises(ValueError, match="repeat"):
        plan_buckets([TensorMeta("a", "float32", (1,))] * 2, KB)


def test_request_fields_round_trip_and_bad_fields_are_named():
    metas = [
        TensorMeta("lm_head.weight", "bfloat16", (1024, 64)),
        TensorMeta("model.norm.weight", "float32", (64,)),
    ]
    fields = bucket_fields(metas)
    assert fields == {
        "names": ["lm_head.weight", "model.norm.weight"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[1024, 64], [64]],
    }
    assert metas_from_fields(**fields) == metas
    assert metas_from_fields(["a"], ["torch.float16"], [[2]]) == [TensorMeta("a", "float16", (2,))]
    for args, field in [
        ((["a"], ["complex"], [[1]]), "dtypes"),
        ((["a"], ["float32"], [[-1]]), "shapes"),
        ((["a", "b"], ["float32"], [[1]]), "names"),
        ((["a", "a"], ["float32"] * 2, [[1]] * 2), "names"),
        (("a", ["float32"], [[1]]), "names"),
    ]:
        with pytest.raises(FieldError) as err:
            metas_from_fields(*args)
        assert err.value.field == field
