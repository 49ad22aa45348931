"""The built-in engine's Triton kernels' logic in Triton's interpreter (run with TRITON_INTERPRET=1; needs
triton, not a GPU). Sampling: block max, first argmax and mass against torch's for banned and free rows, stop
tables of 1 to 600 ids, vocabularies that end inside a tile. A decode step's rotary embedding and cache write:
equal to the model's rope in float32, for head counts that are not powers of two; and the engine's decode
path with both kernels (the tiny model) against its gathered path. Prints PASS."""

import os
from pathlib import Path

import torch

from areal_hpc.gen.backends.builtin import paged_decode, sampling
from areal_hpc.gen.backends.builtin.engine import Engine
from areal_hpc.gen.backends.builtin.model import rope
from areal_hpc.gen.backends.builtin.protocol import SamplingParams
from areal_hpc.gen.backends.builtin.sampling import BLOCK, Scaled

TINY = (
    Path(os.environ.get("AREAL_HPC_TINY", Path(__file__).resolve().parents[1] / ".cache" / "tiny")) / "model"
)


def case(rows: int, vocab: int, stops: int) -> float:
    logits = (torch.randn(rows, vocab) * 3).bfloat16()
    ids = torch.randint(0, vocab, (rows, stops)).sort(dim=1).values
    if stops > 1:
        ids[:, -1] = ids[:, -2]  # padding repeats the last id
    logits.scatter_(1, ids[:, :1], 20.0)  # a stop token holds most of its row's mass
    logits[:, 5] = logits[:, 3] = 30.0  # a tie in the first block: token 3 wins
    scaled = Scaled(logits, 1 / (0.5 + torch.rand(rows)), ids, torch.arange(rows) % 2 == 0)
    fast, slow = (
        sampling._block_stats_triton(scaled),
        sampling.block_stats(scaled),
    )  # CPU tensors: torch's way
    assert torch.equal(fast.max, slow.max) and torch.equal(fast.arg, slow.arg), (rows, vocab, stops)
    return float(((fast.sum - slow.sum) / slow.sum.clamp(min=1e-30)).abs().max())


def rotate_case(
    rows: int, heads: int, kv_heads: int, device="cpu", dtype=torch.float32, rel: float = 0.0
) -> None:
    """rotate_and_store against the model's rope in float32: equal (rel 0), or within ``rel`` of it (bf16 on a
    GPU: one rounding, a fused multiply-add may differ; the interpreter rounds to bf16 by truncation, so it
    checks float32). q, k and v are views of one product, as in the decoder; nothing is written outside the
    rows ``where`` names."""
    dim = 128
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device=device, dtype=dtype)
    q, k, v = (t.view(rows, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    cos, sin = torch.randn(2, rows, dim, device=device, dtype=dtype)
    k_flat, v_flat = torch.zeros(2, 4 * rows, kv_heads, dim, device=device, dtype=dtype)
    where = torch.randperm(4 * rows, device=device)[:rows]
    out = paged_decode.rotate_and_store(q, k, v, cos, sin, k_flat, v_flat, where)
    for got, x in ((out, q), (k_flat[where], k)):
        want = rope(x.float(), cos.float(), sin.float())
        bound = want.abs() * rel + (1e-6 if rel else 0.0)
        assert ((got.float() - want).abs() <= bound).all(), (heads, kv_heads)
    assert torch.equal(v_flat[where], v)
    others = torch.ones(4 * rows, dtype=torch.bool, device=device).index_fill_(0, where, False)
    assert not k_flat[others].any() and not v_flat[others].any(), "wrote outside its rows"


def engine_case(kernels: bool) -> list[tuple[list[int], list[float]]]:
    """Greedy answers of the tiny model (float32): the decode kernels on the CPU, or the gathered path."""
    available = paged_decode.available
    paged_decode.available = lambda device, dtype: kernels
    try:
        engine = Engine(str(TINY), device="cpu", dtype="float32", seed=0, max_batch_size=4).start()
    finally:
        paged_decode.available = available
    try:
        params = SamplingParams(max_new_tokens=12, temperature=0.0)
        return [
            (o.output_ids, o.logprobs) for o in engine.submit([[5, 6, 7, 8], [9, 10, 11]], params).wait(600)
        ]
    finally:
        engine.stop()


def main() -> None:
    assert sampling.triton is not None, "needs triton"
    torch.manual_seed(0)
    shapes = [(4, 1000, 3), (3, 8 * 2 * BLOCK + 77, 5), (2, 600, 1), (2, 3000, 600)]
    errors = [case(*shape) for shape in shapes]
    print("max relative error of the masses:", max(errors))
    assert max(errors) < 1e-5
    for shape in [(3, 12, 2), (2, 28, 4), (1, 16, 8), (2, 4, 4)]:  # 1.5B, 7B, 8 KV heads, MHA
        rotate_case(*shape)
    for (ids, logprobs), (want_ids, want) in zip(engine_case(True), engine_case(False), strict=True):
        assert ids == want_ids and max(abs(a - b) for a, b in zip(logprobs, want, strict=True)) < 1e-4
    print("PASS")


if __name__ == "__main__":
    main()
