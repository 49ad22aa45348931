"""chunked_logprobs: the LM head's token logprobs and entropy, equal to the unchunked computation in values
and gradients, and never holding more than a chunk of logits (a probe of every op's output says so)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from areal_hpc.train import dist
from areal_hpc.train.head import chunked_logprobs, vocab_parallel_logprobs
from tests.helpers import OutputProbe

T, H, V = 96, 16, 1000  # tokens, hidden size, vocab
TEMPERATURE = 0.7


def unchunked(hidden, weight, labels, temperature=1.0):
    """The reference: full [T, V] logits, log_softmax and gather; entropy -(p * log p).sum()."""
    logits = (hidden @ weight.T).float() / temperature
    logp = logits.log_softmax(-1)
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def unchunked_f64(hidden, weight, labels, temperature=1.0):
    logits = (hidden.double() @ weight.double().T) / temperature
    logp = logits.log_softmax(-1)
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def head_inputs(dtype=torch.float32, seed=0, tokens=T):
    gen = torch.Generator().manual_seed(seed)
    # Logits of a few units, like a trained model's: peaked enough that both p and log p matter.
    hidden = torch.randn(tokens, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.5
    labels = torch.randint(V, (tokens,), generator=gen)
    return hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_(), labels


def value_and_grads(fn, hidden, weight, labels, a, b):
    """(logp, entropy, d loss/d hidden, d loss/d weight) for loss = sum(a * logp + b * entropy)."""
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    logp, entropy = fn(hidden, weight, labels)
    loss = 0.0
    if a is not None:
        loss = loss + (a * logp).sum()
    if b is not None:
        loss = loss + (b * entropy).sum()
    loss.backward()
    return logp.detach(), entropy.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk_tokens", [1, 32, 40, 1000])  # 1 and 32 divide T, 40 does not, 1000 > T
@pytest.mark.parametrize("loss_on", ["both", "logp", "entropy"])
def test_float32_equals_the_unchunked_computation(chunk_tokens, loss_on):
    hidden, weight, labels = head_inputs()
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(T, generator=gen) if loss_on != "entropy" else None
    b = torch.randn(T, generator=gen) if loss_on != "logp" else None
    got = value_and_grads(
        lambda h, w, y: chunked_logprobs(h, w, y, TEMPERATURE, chunk_tokens), hidden, weight, labels, a, b
    )
    want = value_and_grads(lambda h, w, y: unchunked_f64(h, w, y, TEMPERATURE), hidden, weight, labels, a, b)
    for g, w, name in zip(got, want, ["logp", "entropy", "grad hidden", "grad weight"], strict=True):
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g, w.float(), rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_bf16_inputs_are_close_to_the_float32_reference():
    hidden, weight, labels = head_inputs(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
    logp, entropy, gh, gw = value_and_grads(
        lambda h, w, y: chunked_logprobs(h, w, y, TEMPERATURE, 40), hidden, weight, labels, a, b
    )
    assert logp.dtype == entropy.dtype == torch.float32 and gh.dtype == gw.dtype == torch.bfloat16
    # The reference: the same bf16 numbers, computed in float32 throughout.
    want = value_and_grads(
        lambda h, w, y: unchunked(h.float(), w.float(), y, TEMPERATURE), hidden, weight, labels, a, b
    )
    # bf16 keeps 8 bits: logits of up to ~16 are off by up to ~0.03; logprobs and entropy by as much
    # (measured: 0.024 and 0.040), the gradients by ~1% of their largest entry.
    torch.testing.assert_close(logp, want[0], rtol=0, atol=0.1)
    torch.testing.assert_close(entropy, want[1], rtol=0, atol=0.1)
    for got, ref in zip([gh, gw], want[2:], strict=True):
        torch.testing.assert_close(got.float(), ref.float(), rtol=0.02, atol=0.03 * ref.abs().max().item())
    # And the same as the unchunked bf16 computation, which rounds the same matmul the same way.
    same = value_and_grads(lambda h, w, y: unchunked(h, w, y, TEMPERATURE), hidden, weight, labels, a, b)
    torch.testing.assert_close(logp, same[0], rtol=0, atol=1e-4)


def test_no_grad_and_a_frozen_head():
    hidden, weight, labels = head_inputs()
    want_logp, want_entropy = unchunked_f64(hidden, weight, labels)
    with torch.no_grad():  # inference: no autograd graph at all
        logp, entropy = chunked_logprobs(hidden, weight, labels, chunk_tokens=40)
    assert not logp.requires_grad and not entropy.requires_grad
    torch.testing.assert_close(logp, want_logp.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy.float(), rtol=1e-5, atol=1e-5)
    # A frozen LM head: the gradient reaches the hidden states only.
    frozen = weight.detach()
    logp, _ = chunked_logprobs(hidden, frozen, labels, chunk_tokens=40)
    logp.sum().backward()
    assert frozen.grad is None and hidden.grad is not None and weight.grad is None


def test_a_callers_autocast_does_not_reach_the_head():
    # CPU autocast would run the matmul in bf16; the head keeps the inputs' float32.
    hidden, weight, labels = head_inputs()
    want = chunked_logprobs(hidden, weight, labels, TEMPERATURE, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_logprobs(hidden, weight, labels, TEMPERATURE, 40)
        autocast_logits = hidden @ weight.T
    assert autocast_logits.dtype == torch.bfloat16  # the probe: autocast was on around the call
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_bad_inputs_are_refused():
    hidden, weight, labels = head_inputs()
    with pytest.raises(ValueError, match="share a dtype"):
        chunked_logprobs(hidden, weight.double(), labels)
    with pytest.raises(ValueError, match="labels"):
        chunked_logprobs(hidden, weight, labels[1:])
    with pytest.raises(ValueError, match=r"\[V, H\]"):
        chunked_logprobs(hidden, weight.T, labels)


# --- memory: a probe of every op's output -----------------------------------------------------------------


def probe(fn, tokens=512, chunk_tokens=64):
    """The probe's record of a forward and backward of ``fn(hidden, weight, labels)``."""
    hidden, weight, labels = head_inputs(tokens=tokens)
    with OutputProbe() as p:
        logp, entropy = fn(hidden, weight, labels)
        (logp.sum() + entropy.sum()).backward()
    return p


def naive_chunks(hidden, weight, labels, chunk_tokens=64):
    """Chunked forward left to autograd: no chunk of logits is large, but every chunk is saved."""
    parts = [
        unchunked(hidden[s : s + chunk_tokens], weight, labels[s : s + chunk_tokens])
        for s in range(0, hidden.shape[0], chunk_tokens)
    ]
    return torch.cat([lp for lp, _ in parts]), torch.cat([e for _, e in parts])


def test_no_op_materialises_more_than_a_chunk_of_logits():
    tokens, chunk = 512, 64
    p = probe(lambda h, w, y: chunked_logprobs(h, w, y, TEMPERATURE, chunk), tokens, chunk)
    # One chunk of logits (chunk * V) and the weight's gradient (V * H) are the largest tensors.
    assert p.largest <= max(chunk * V, V * H) < tokens * V
    # Two float32 chunks alive at once (logits and p), plus the weight gradient and O(T * H) tensors.
    f32 = 4
    assert p.peak_bytes <= f32 * (2 * chunk * V + 2 * V * H + 4 * tokens * H)


def test_the_probe_catches_full_logits_and_saved_chunks():
    tokens, chunk = 512, 64
    full = probe(unchunked, tokens, chunk)
    assert full.largest == tokens * V and full.peak_bytes > 4 * tokens * V
    # Saved chunks pass the largest-tensor check, and the live-bytes peak is what catches them.
    saved = probe(lambda h, w, y: naive_chunks(h, w, y, chunk), tokens, chunk)
    assert saved.largest <= chunk * V and saved.peak_bytes > 4 * tokens * V
    ours = probe(lambda h, w, y: chunked_logprobs(h, w, y, 1.0, chunk), tokens, chunk)
    assert ours.peak_bytes * 4 < min(full.peak_bytes, saved.peak_bytes)


def _vocab_parallel_rank(rank: int, out: str) -> None:
    dist.init_distributed(rank, 2, f"{out}.init", backend="gloo", timeout_s=120)
    try:
        torch.manual_seed(0)  # the same inputs on both ranks; each holds half of the vocabulary
        hidden = torch.randn(37, 16, requires_grad=True)
        weight = torch.randn(50, 16)
        labels = torch.randint(0, 50, (37,))
        local = weight.chunk(2)[rank].clone().requires_grad_()
        logp, entropy = vocab_parallel_logprobs(hidden, local, labels, torch.distributed.group.WORLD, 0.7, 8)
        (logp.sum() + 0.3 * entropy.sum()).backward()
        torch.save(
            {"logp": logp, "entropy": entropy, "hidden": hidden.grad, "weight": local.grad}, f"{out}.{rank}"
        )
        dist.barrier()
    finally:
        dist.destroy()


def test_the_vocabulary_split_over_two_ranks_gives_the_whole_heads_outputs_and_gradients(tmp_path):
    mp.spawn(_vocab_parallel_rank, args=(str(tmp_path / "r"),), nprocs=2)
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    logp, entropy = chunked_logprobs(hidden, weight, labels, 0.7, 8)
    (logp.sum() + 0.3 * entropy.sum()).backward()
    ranks = [torch.load(tmp_path / f"r.{r}") for r in range(2)]
    for r, got in enumerate(ranks):
        for name, want in (("logp", logp), ("entropy", entropy), ("hidden", hidden.grad)):
            torch.testing.assert_close(got[name], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["weight"], weight.grad.chunk(2)[r], atol=1e-5, rtol=1e-5)
