"""The paged decode attention: the torch reference against per-row SDPA over gathered keys, and the split count.
The Triton kernel itself runs only on a GPU (here one test, skipped without CUDA; tools/gpu_check_paged.py)."""

import math

import pytest
import torch
import torch.nn.functional as F

from areal_hpc.gen.backends.builtin.paged_decode import (
    PAGE,
    available,
    paged_decode,
    paged_decode_reference,
    splits_for,
)

LENGTHS = [1, PAGE - 1, PAGE, PAGE + 1, 5 * PAGE + 3]


def make(heads, kv_heads, dim=64, lengths=LENGTHS, pool=40, dtype=torch.float32, device="cpu", seed=0):
    """Rows over pages in shuffled order; table entries past a row's pages are garbage (never read)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // PAGE) for n in lengths) + 1
    k_pool = torch.randn(pool, PAGE, kv_heads, dim, generator=gen)
    v_pool = torch.randn(pool, PAGE, kv_heads, dim, generator=gen)
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    table = torch.stack([torch.randperm(pool, generator=gen)[:width] for _ in range(len(lengths) + 2)])
    table[:, -1] = 10**6
    lengths = torch.tensor(lengths, dtype=torch.int32)
    tensors = q.to(dtype), k_pool.to(dtype), v_pool.to(dtype), table.to(torch.int32), lengths
    return tuple(t.to(device) for t in tensors)


def sdpa_rows(q, k_pool, v_pool, table, lengths, scale):
    """Row by row: gather the row's keys page by page, repeat kv heads for GQA, SDPA with one query."""
    heads, kv_heads = q.shape[1], k_pool.shape[2]
    outs = []
    for b, n in enumerate(lengths.tolist()):
        pages = table[b, : -(-n // PAGE)].long()
        k = k_pool[pages].reshape(-1, kv_heads, q.shape[2])[:n].repeat_interleave(heads // kv_heads, 1)
        v = v_pool[pages].reshape(-1, kv_heads, q.shape[2])[:n].repeat_interleave(heads // kv_heads, 1)
        out = F.scaled_dot_product_attention(q[b][:, None], k.transpose(0, 1), v.transpose(0, 1), scale=scale)
        outs.append(out[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("heads,kv_heads", [(28, 4), (4, 4), (12, 2)])
def test_reference_matches_sdpa_per_row(heads, kv_heads):
    tensors = make(heads, kv_heads)
    scale = 64**-0.5
    got = paged_decode_reference(*tensors, scale)
    assert got.shape == (len(LENGTHS), heads, 64) and got.dtype == torch.float32
    torch.testing.assert_close(got, sdpa_rows(*tensors, scale), atol=1e-5, rtol=1e-5)


def test_reference_keeps_dtype_and_ignores_extra_table_rows():
    q, k_pool, v_pool, table, lengths = make(7, 1, dim=128, dtype=torch.bfloat16)
    got = paged_decode_reference(q, k_pool, v_pool, table, lengths, 0.1)
    assert got.dtype == torch.bfloat16 and table.shape[0] > q.shape[0]
    expected = sdpa_rows(q.float(), k_pool.float(), v_pool.float(), table, lengths, 0.1)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_splits_for_bounds():
    assert splits_for(1, 4, 1000, 132) == 66  # one long row: split to fill ~2 waves
    assert splits_for(256, 4, 200, 132) == 1  # many rows fill the GPU by themselves
    assert splits_for(128, 2, 200, 132) == 1  # the colocated 1.5B step's 128 rows, one wave
    assert splits_for(64, 2, 200, 132) == 3
    assert splits_for(1, 4, 3, 132) == 3  # never more splits than pages
    assert splits_for(1, 1, 0, 132) == 1  # and always at least one
    for batch in (1, 2, 7, 64, 256):
        for max_pages in (1, 5, 1000):
            s = splits_for(batch, 2, max_pages, 132)
            assert 1 <= s <= max(1, max_pages)
            assert s == max_pages or batch * 2 * s >= 2 * 132 or (s == 1 and batch * 2 >= 132)


def test_available_is_false_on_cpu():
    assert not available(torch.device("cpu"), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs CUDA")
def test_kernel_matches_reference_on_gpu():
    cases = [(torch.bfloat16, 1, 28, 4), (torch.bfloat16, 7, 12, 2), (torch.float32, 3, 7, 1)]
    for dtype, splits, heads, kv_heads in cases:
        tensors = make(heads, kv_heads, dim=128, dtype=dtype, device="cuda")
        scale = 1 / math.sqrt(128)
        got = paged_decode(*tensors, scale, splits)
        expected = paged_decode_reference(*tensors, scale)
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
