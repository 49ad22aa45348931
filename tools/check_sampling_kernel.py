"""The sampling kernel's logic in Triton's interpreter (run with TRITON_INTERPRET=1; needs triton, not a GPU):
its block max, first argmax and mass against torch's for banned and free rows, stop tables of 1 to 600 ids,
vocabularies that end inside a tile. Prints PASS."""

import torch

from areal_hpc.gen.backends.builtin import sampling
from areal_hpc.gen.backends.builtin.sampling import BLOCK, Scaled


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


def main() -> None:
    assert sampling.triton is not None, "needs triton"
    torch.manual_seed(0)
    shapes = [(4, 1000, 3), (3, 8 * 2 * BLOCK + 77, 5), (2, 600, 1), (2, 3000, 600)]
    errors = [case(*shape) for shape in shapes]
    print("max relative error of the masses:", max(errors))
    assert max(errors) < 1e-5
    print("PASS")


if __name__ == "__main__":
    main()
