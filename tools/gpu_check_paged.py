"""Check the paged decode attention kernel on a GPU: correctness against the torch reference, then speed.

(a) paged_decode vs paged_decode_reference over several shapes, lengths and split counts (bf16 mostly); exits
1 if any max abs error exceeds 2e-2. (b) Per decode shape, one call captured in a CUDA graph and replayed 50
times: ms and achieved TB/s (K and V bytes the rows attend), beside torch's FlashAttention varlen op over
contiguous slots (what the engine used before) and the ratio; then a small sweep of launch configurations and
split counts, to choose the defaults.

Usage (repo root, a CUDA machine)::

    PYTHONPATH=$PWD python3 tools/gpu_check_paged.py
"""

from __future__ import annotations

import importlib.util
import sys
from functools import partial
from pathlib import Path

import torch


def _load_module():
    """The kernel's module by its path: importing the package would import all of areal_hpc.gen (and its
    dependencies, which a bare GPU machine may lack); the module itself needs only torch and triton."""
    path = Path(__file__).resolve().parents[1] / "areal_hpc/gen/backends/builtin/paged_decode.py"
    spec = importlib.util.spec_from_file_location("paged_decode", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_pd = _load_module()
PAGE, splits_for = _pd.PAGE, _pd.splits_for
paged_decode, paged_decode_reference = _pd.paged_decode, _pd.paged_decode_reference

DEV = "cuda"
SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
# (name, heads, kv heads, head dim, rows, mean keys, flash slot length)
SHAPES = [
    ("7b", 28, 4, 128, 256, 3000, 17408),
    ("7b", 28, 4, 128, 64, 3000, 17408),
    ("7b", 28, 4, 128, 1, 16000, 17408),
    ("1.5b", 12, 2, 128, 256, 1280, 2048),
    ("1.5b", 12, 2, 128, 128, 768, 1280),  # issue 46's rollout at mid-answer: 2 splits (and a merge) or 1?
]
# (block_n, warps, stages); stages 5 double-buffers K and V (3 and 4 buffer one block: the page-id load comes first)
CONFIGS = [(64, 4, 3), (64, 4, 2), (64, 4, 5), (32, 4, 3), (32, 4, 5), (32, 2, 4), (128, 4, 2), (128, 8, 3)]


def setup(heads, kv_heads, dim, lengths, dtype=torch.bfloat16, seed=0):
    """A pool with every row's pages scattered in random order, a table with spare columns, q."""
    gen = torch.Generator(DEV).manual_seed(seed)
    need = [-(-n // PAGE) for n in lengths]
    pool = sum(need) + 8
    width = max(need) + 2
    k_pool = torch.randn(pool, PAGE, kv_heads, dim, device=DEV, dtype=dtype, generator=gen)
    v_pool = torch.randn(pool, PAGE, kv_heads, dim, device=DEV, dtype=dtype, generator=gen)
    order = torch.randperm(pool, device=DEV, generator=gen)
    # spare columns and one spare row hold garbage: the kernel must never read them
    table = torch.full((len(lengths) + 1, width), 10**8, device=DEV, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = order[start : start + n].to(torch.int32)
        start += n
    q = torch.randn(len(lengths), heads, dim, device=DEV, dtype=dtype, generator=gen)
    return q, k_pool, v_pool, table, torch.tensor(lengths, device=DEV, dtype=torch.int32)


def check(heads, kv_heads, dim, lengths, splits, dtype=torch.bfloat16) -> float:
    q, k_pool, v_pool, table, lens = setup(heads, kv_heads, dim, lengths, dtype)
    got = paged_decode(q, k_pool, v_pool, table, lens, dim**-0.5, splits)
    ref = paged_decode_reference(q, k_pool, v_pool, table, lens, dim**-0.5)
    return (got.float() - ref.float()).abs().max().item()


def correctness() -> bool:
    edge = [1, PAGE - 1, PAGE, PAGE + 1, 63, 64, 65, 5 * PAGE + 3, 1000, 3001]
    gen = torch.Generator().manual_seed(1)
    rand = torch.randint(1, 2500, (24,), generator=gen).tolist()
    cases = [
        (28, 4, 128, edge, 1, torch.bfloat16),
        (28, 4, 128, edge, 7, torch.bfloat16),
        (28, 4, 128, [16000], 66, torch.bfloat16),
        (12, 2, 128, rand, 1, torch.bfloat16),
        (12, 2, 128, rand, 33, torch.bfloat16),
        (14, 2, 64, edge, 1, torch.bfloat16),
        (14, 2, 64, edge, 5, torch.bfloat16),
        (16, 4, 128, rand, 3, torch.bfloat16),  # MoE-like G=4
        (32, 2, 64, rand, 2, torch.bfloat16),  # G=16
        (28, 4, 128, edge, 4, torch.float16),
        (28, 4, 128, edge, 3, torch.float32),
    ]
    ok = True
    for heads, kv_heads, dim, lengths, splits, dtype in cases:
        err = check(heads, kv_heads, dim, lengths, splits, dtype)
        ok &= err <= 2e-2
        flag = "ok" if err <= 2e-2 else "FAIL"
        name = str(dtype).split(".")[-1]
        shape = f"H={heads:2d} HKV={kv_heads} D={dim:3d} rows={len(lengths):2d} splits={splits:2d}"
        print(f"  {shape} {name}: {err:.1e} {flag}")
    return ok & flash_agrees()


def flash_agrees() -> bool:
    """The baseline's call over slots holding the same keys gives the same answer (so the timing compares like)."""
    lengths, slot = [5, 700, 2048], 2048
    q, k_pool, v_pool, table, lens = setup(28, 4, 128, lengths)
    ks, vs = slots(k_pool, v_pool, table, lengths, slot)
    got = flash(q, ks, vs, lens, slot)
    ref = paged_decode_reference(q, k_pool, v_pool, table, lens, 128**-0.5)
    err = (got.float() - ref.float()).abs().max()
    print(f"  flash varlen over slots vs reference: {err.item():.1e}")
    return err.item() <= 2e-2


def slots(k_pool, v_pool, table, lengths, slot):
    ks = torch.zeros(len(lengths) * slot, *k_pool.shape[2:], device=DEV, dtype=k_pool.dtype)
    vs = torch.zeros_like(ks)
    for b, n in enumerate(lengths):
        pages = table[b, : -(-n // PAGE)].long()
        ks[b * slot : b * slot + n] = k_pool[pages].flatten(0, 1)[:n]
        vs[b * slot : b * slot + n] = v_pool[pages].flatten(0, 1)[:n]
    return ks, vs


def flash(q, ks, vs, lens, slot):
    rows = q.shape[0]
    cu_q = torch.arange(rows + 1, device=DEV, dtype=torch.int32)
    cu_k = cu_q * slot
    out = torch.ops.aten._flash_attention_forward(
        q, ks, vs, cu_q, cu_k, 1, slot, 0.0, False, False, scale=q.shape[-1] ** -0.5, seqused_k=lens
    )
    return out[0]


def graph_ms(fn, reps=50) -> float:
    """Capture ``fn`` once in a CUDA graph (after a warm-up that compiles), replay ``reps`` times: ms a call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def copy_tbs() -> float:
    x = torch.empty(2**30, device=DEV, dtype=torch.uint8)
    y = torch.empty_like(x)
    return 2 * x.numel() / graph_ms(lambda: y.copy_(x), reps=20) / 1e9


def speed() -> None:
    print(f"(b) speed, CUDA graph x50 ({SMS} SMs, copy {copy_tbs():.2f} TB/s)")
    for name, heads, kv_heads, dim, rows, mean, slot in SHAPES:
        gen = torch.Generator().manual_seed(2)
        jitter = torch.randint(-mean // 10, mean // 10 + 1, (rows,), generator=gen).tolist()  # +-10%
        lengths = [mean + j for j in jitter] if rows > 1 else [mean]
        q, k_pool, v_pool, table, lens = setup(heads, kv_heads, dim, lengths)
        scale, width = dim**-0.5, table.shape[1]
        gbytes = sum(lengths) * kv_heads * dim * 2 * q.element_size() / 1e9
        splits = splits_for(rows, kv_heads, width, SMS)
        ms = graph_ms(partial(paged_decode, q, k_pool, v_pool, table, lens, scale, splits))
        fms = flash_ms(q, kv_heads, lens, slot)
        print(
            f"  {name:4s} B={rows:3d} keys~{mean:5d} splits={splits:2d}: paged {ms:.3f} ms {gbytes / ms:.2f} TB/s"
            f" | flash {fms:.3f} ms {gbytes / fms:.2f} TB/s | x{fms / ms:.2f}"
        )
        sweep(q, k_pool, v_pool, table, lens, scale, splits, gbytes)


def flash_ms(q, kv_heads, lens, slot) -> float:
    """The baseline: FlashAttention varlen over slots of ``slot`` keys each (random keys: only time matters)."""
    ks = torch.randn(q.shape[0] * slot, kv_heads, q.shape[2], device=DEV, dtype=q.dtype)
    vs = torch.randn_like(ks)
    return graph_ms(partial(flash, q, ks, vs, lens, slot))


def sweep(q, k_pool, v_pool, table, lens, scale, splits, gbytes) -> None:
    """TB/s per launch configuration (block_n, warps, stages) and, for few rows, per split count."""
    cells = []
    for block_n, warps, stages in CONFIGS:
        try:
            config = dict(block_n=block_n, warps=warps, stages=stages)
            call = partial(paged_decode, q, k_pool, v_pool, table, lens, scale, splits, **config)
            ms = graph_ms(call, reps=20)
            cells.append(f"{block_n}/{warps}/{stages}:{gbytes / ms:.2f}")
        except Exception as exc:  # e.g. out of shared memory
            cells.append(f"{block_n}/{warps}/{stages}:x({type(exc).__name__})")
    print("    cfg TB/s " + " ".join(cells))
    if q.shape[0] * k_pool.shape[2] >= 2 * SMS:
        return
    cells = []
    for s in sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, splits}):
        if s <= table.shape[1]:
            ms = graph_ms(partial(paged_decode, q, k_pool, v_pool, table, lens, scale, s), reps=20)
            cells.append(f"{s}:{gbytes / ms:.2f}")
    print("    splits TB/s " + " ".join(cells))


def main() -> int:
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    print("(a) correctness, max abs error vs reference")
    ok = correctness()
    speed()
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
