"""Decode attention over a paged KV pool, in Triton (flash-decoding with GQA packing).

Why our own kernel: torch's FlashAttention op takes no block table, and its varlen decode reads every key once
per *query* head. Here a program owns one kv head of one row and multiplies all G = H // HKV query heads that
share it at once, so the pool is read once per kv head. Stage 1 splits a row's keys into ``splits`` ranges (to
fill the GPU when few rows run); stage 2 merges the ranges by their log-sum-exp. Shapes depend only on B, HKV
and ``splits``, never on lengths, so a step is CUDA-graph capturable. ``gathered_decode`` is decode attention
without the kernel (CPU), and ``paged_decode_reference`` the kernel in plain torch, for checking it.
``rotate_and_store`` rotates a decode step's q and k and writes its keys and values to the pool, in one kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU CI has no triton: only the reference runs there
    triton = None

PAGE = 16  # tokens per page of the KV pool
LOG2E = 1.4426950408889634  # the kernel works in base 2 (exp2 is the native instruction)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernel runs here (a CUDA device with triton importable, fp16/bf16/fp32)."""
    if triton is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    ampere = torch.cuda.get_device_capability(device)[0] >= 8  # bf16 tl.dot needs sm80+
    return ampere and dtype in (torch.float16, torch.bfloat16, torch.float32)


def splits_for(batch: int, kv_heads: int, max_pages: int, sms: int) -> int:
    """How many key ranges (flash-decoding splits) a step of `batch` rows uses: none when its programs fill the
    GPU's `sms` by themselves (a split costs a merge kernel and its partial sums: at 128 rows of a 1.5B on an
    H100, one split read 2.35 TB/s and two 2.10), else enough for ~2 waves; at most max_pages. Pure function,
    used at CUDA-graph capture (static per batch size)."""
    programs = max(1, batch * kv_heads)
    if programs >= sms:
        return 1
    return max(1, min(max_pages, -(-2 * sms // programs)))


if triton is not None:

    @triton.jit
    def _split_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, out_ptr, part_ptr, lse_ptr,
        qk_scale, splits,
        s_qb, s_qh, s_kp, s_kt, s_kh, s_vp, s_vt, s_vh, s_tb,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE_: tl.constexpr, BLOCK_N: tl.constexpr,
        DIRECT: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        length = tl.load(len_ptr + b)
        # this split's share of the row's key blocks (a split past the row's end gets none)
        blocks = tl.cdiv(length, BLOCK_N)
        per = tl.cdiv(blocks, splits)
        lo = s * per
        hi = tl.minimum(lo + per, blocks)

        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        heads = kvh * G + g  # the query heads sharing kv head `kvh`; rows g >= G are padding for tl.dot
        q_rows = q_ptr + b.to(tl.int64) * s_qb + heads[:, None] * s_qh + d[None, :]
        q = tl.load(q_rows, mask=g[:, None] < G, other=0.0)

        m = tl.full([GP], float("-inf"), tl.float32)
        den = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        n = tl.arange(0, BLOCK_N)
        row_table = table_ptr + b.to(tl.int64) * s_tb
        for blk in range(lo, hi):
            t = blk * BLOCK_N + n
            valid = t < length
            # per-token page lookup; int64 because a pool can exceed 2**31 elements
            page = tl.load(row_table + t // PAGE_, mask=valid, other=0).to(tl.int64)
            slot = t % PAGE_
            k = tl.load(
                k_ptr + (page * s_kp + slot * s_kt + kvh * s_kh)[:, None] + d[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            v = tl.load(
                v_ptr + (page * s_vp + slot * s_vt + kvh * s_vh)[:, None] + d[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            # every block visited holds >= 1 valid key, so m_new is finite and exp2 never sees inf - inf
            m_new = tl.maximum(m, tl.max(scores, 1))
            p = tl.exp2(scores - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            den = den * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new

        # an empty split leaves den == 0: it writes zeros and lse -inf, which stage 2 weighs as 0
        has = den > 0
        o = acc / tl.where(has, den, 1.0)[:, None]
        keep = g[:, None] < G
        if DIRECT:  # one split: this is already the answer
            out_rows = out_ptr + (b * tl.num_programs(1) * G + heads)[:, None] * D + d[None, :]
            tl.store(out_rows, o.to(out_ptr.dtype.element_ty), mask=keep)
        else:
            # part [B, H, splits, D], lse [B, H, splits]
            at = (b * tl.num_programs(1) * G + heads) * splits + s
            tl.store(part_ptr + at[:, None] * D + d[None, :], o, mask=keep)
            tl.store(lse_ptr + at, tl.where(has, m + tl.log2(den), float("-inf")), mask=g < G)

    @triton.jit
    def _merge_kernel(part_ptr, lse_ptr, out_ptr, splits, D: tl.constexpr, SB: tl.constexpr):
        row = tl.program_id(0)  # b * H + h
        d = tl.arange(0, D)
        i = tl.arange(0, SB)
        m = tl.full([1], float("-inf"), tl.float32)
        den = tl.zeros([1], tl.float32)
        acc = tl.zeros([D], tl.float32)
        # splits in chunks of SB, merged online; split 0 always has keys, so m is finite after the first chunk
        for c in range(0, splits, SB):
            idx = c + i
            lse = tl.load(lse_ptr + row * splits + idx, mask=idx < splits, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(lse, 0))
            w = tl.exp2(lse - m_new)
            alpha = tl.exp2(m - m_new)
            rows = (row * splits + idx)[:, None] * D
            part = tl.load(part_ptr + rows + d[None, :], mask=(idx < splits)[:, None])
            acc = acc * alpha + tl.sum(w[:, None] * part, 0)
            den = den * alpha + tl.sum(w, 0)
            m = m_new
        tl.store(out_ptr + row * D + d, (acc / den).to(out_ptr.dtype.element_ty))

    @triton.jit
    def _rotate_store_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_flat_ptr, v_flat_ptr, where_ptr, out_ptr,
        s_q, s_k, s_v, H, HKV, D: tl.constexpr, HP: tl.constexpr,
    ):  # fmt: skip
        """Program t: token t's query heads rotated into out, its key heads rotated and its value heads copied
        into pool row where[t] (float32 arithmetic, one rounding: what the compiled rope computes)."""
        t = tl.program_id(0)
        d = tl.arange(0, D)
        first = d < D // 2
        partner = tl.where(first, d + D // 2, d - D // 2)  # the half-rotation: (-x2, x1)
        cos = tl.load(cos_ptr + t * D + d).to(tl.float32)[None, :]
        sin = tl.where(first, -1.0, 1.0) * tl.load(sin_ptr + t * D + d).to(tl.float32)
        sin = sin[None, :]
        h = tl.arange(0, HP)[:, None]
        at = h * D + d[None, :]
        x = tl.load(q_ptr + t * s_q + at, mask=h < H).to(tl.float32)
        pair = tl.load(q_ptr + t * s_q + h * D + partner[None, :], mask=h < H).to(tl.float32)
        tl.store(out_ptr + t * H * D + at, (x * cos + pair * sin).to(out_ptr.dtype.element_ty), mask=h < H)
        row = tl.load(where_ptr + t) * HKV * D
        x = tl.load(k_ptr + t * s_k + at, mask=h < HKV).to(tl.float32)
        pair = tl.load(k_ptr + t * s_k + h * D + partner[None, :], mask=h < HKV).to(tl.float32)
        tl.store(k_flat_ptr + row + at, (x * cos + pair * sin).to(k_flat_ptr.dtype.element_ty), mask=h < HKV)
        tl.store(v_flat_ptr + row + at, tl.load(v_ptr + t * s_v + at, mask=h < HKV), mask=h < HKV)


def paged_decode(
    q, k_pool, v_pool, table, lengths, scale: float, splits: int, *, block_n=None, warps=4, stages=3
) -> torch.Tensor:
    """q [B, H, D]; k_pool, v_pool [P, PAGE, HKV, D] (P pages, H % HKV == 0, GQA: query head h uses kv head
    h // (H // HKV)); table [R, W] int32 with R >= B (row b's page ids in order: key position t of row b lives at
    k_pool[table[b, t // PAGE], t % PAGE]); lengths [B] int32 (row b attends keys 0..lengths[b]-1; always >= 1).
    Returns [B, H, D] in q's dtype. ``block_n``, ``warps``, ``stages``: the launch configuration (for tuning)."""
    batch, heads, dim = q.shape
    kv_heads = k_pool.shape[2]
    block_n = block_n or 64 * 2 // q.element_size()  # 16 KiB K tiles at D=128: fp32 halves the block (smem)
    group = heads // kv_heads
    assert k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1 and q.stride(-1) == 1 and table.stride(-1) == 1
    out = torch.empty(batch, heads, dim, device=q.device, dtype=q.dtype)
    part = lse = out  # unused placeholders when one split writes the answer directly
    if splits > 1:
        part = torch.empty(batch, heads, splits, dim, device=q.device, dtype=torch.float32)
        lse = torch.empty(batch, heads, splits, device=q.device, dtype=torch.float32)
    _split_kernel[(batch, kv_heads, splits)](
        q, k_pool, v_pool, table, lengths.contiguous(), out, part, lse,
        scale * LOG2E, splits,
        q.stride(0), q.stride(1), *k_pool.stride()[:3], *v_pool.stride()[:3], table.stride(0),
        G=group, GP=max(16, triton.next_power_of_2(group)), D=dim, PAGE_=PAGE, BLOCK_N=block_n,
        DIRECT=splits == 1, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(batch * heads,)](part, lse, out, splits, D=dim, SB=16, num_warps=4)
    return out


def rotate_and_store(q, k, v, cos, sin, k_flat, v_flat, where) -> torch.Tensor:
    """A decode step's rotary embedding and cache write in one kernel (four before: two ropes, two indexed
    writes, ~12 us a layer at 128 rows of a 1.5B on an H100): q [B, H, D], k and v [B, HKV, D] (rows of one
    [B, (H + 2 HKV) D] product: heads contiguous), cos and sin [B, D]; k rotated and v written to rows ``where``
    [B] of k_flat and v_flat [positions, HKV, D]. Returns q rotated, [B, H, D] contiguous."""
    batch, heads, dim = q.shape
    kv_heads = k.shape[1]
    for t in (q, k, v):
        assert t.stride(2) == 1 and t.stride(1) == dim, "heads must be contiguous within a row"
    assert k_flat.is_contiguous() and v_flat.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    out = torch.empty(batch, heads, dim, device=q.device, dtype=q.dtype)
    _rotate_store_kernel[(batch,)](
        q, k, v, cos, sin, k_flat, v_flat, where, out, q.stride(0), k.stride(0), v.stride(0), heads, kv_heads,
        D=dim, HP=triton.next_power_of_2(max(heads, kv_heads)), num_warps=4,
    )  # fmt: skip
    return out


def pool_rows(table: torch.Tensor) -> torch.Tensor:
    """Pool rows (page * PAGE + offset) of every position of the pages in ``table`` [rows, pages]:
    [rows, pages * PAGE]."""
    return (table.long()[:, :, None] * PAGE + torch.arange(PAGE, device=table.device)).flatten(1)


def gathered_decode(q, k_flat, v_flat, rows, valid, scale=None) -> torch.Tensor:
    """Decode attention without the kernel: q [B, H, D] over the keys at pool ``rows`` [B, span] of k_flat and
    v_flat [positions, Hkv, D], those where ``valid`` [B, span]. GQA without copies: the query heads of one KV
    head are its "positions". Positions not valid may hold any bits (a resumed cache): NaN survives a mask
    (NaN - inf, 0 x NaN), so they are zeroed. The engine's path on CPU (and on a GPU without triton)."""
    batch, heads, dim = q.shape
    kv_heads = k_flat.shape[1]
    keys, values = (torch.where(valid[:, :, None, None], t[rows], 0) for t in (k_flat, v_flat))
    out = F.scaled_dot_product_attention(
        q.view(batch, kv_heads, heads // kv_heads, dim),
        keys.transpose(1, 2), values.transpose(1, 2), attn_mask=valid[:, None, None], scale=scale,
    )  # fmt: skip
    return out.reshape(batch, heads, dim)


def paged_decode_reference(q, k_pool, v_pool, table, lengths, scale) -> torch.Tensor:
    """The same as ``paged_decode`` in plain torch, in float32, for checking the kernel."""
    batch, width = q.shape[0], table.shape[1]
    # table entries past a row's last page may be stale: read page 0 there (masked out)
    used = torch.arange(width, device=q.device)[None, :] < (lengths.long()[:, None] + PAGE - 1) // PAGE
    rows = pool_rows(torch.where(used, table[:batch].long(), 0))
    valid = torch.arange(width * PAGE, device=q.device)[None, :] < lengths.long()[:, None]
    k_flat, v_flat = (t.reshape(-1, *t.shape[2:]).float() for t in (k_pool, v_pool))
    return gathered_decode(q.float(), k_flat, v_flat, rows, valid, scale).to(q.dtype)
