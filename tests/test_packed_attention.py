"""Which kernel runs which part of a packed row (train.packed): on a GPU a sequence of CUDNN_FROM tokens or more
runs alone through cuDNN's attention, padded at its end, and each run of shorter sequences between them goes to
one varlen FlashAttention call. Here SDPA's CPU kernel stands in for both GPU kernels, so the row cut and put
back together must equal each sequence's attention alone; tests/test_gpu.py checks the kernels themselves."""

from __future__ import annotations

import contextlib

import torch

from areal_hpc.train import packed


def test_long_sequences_run_alone_and_the_short_ones_between_them_together():
    assert packed.segments([0, 3, 5, 20, 22, 40], alone_from=10) == [
        (0, 5, False), (5, 20, True), (20, 22, False), (22, 40, True),
    ]  # fmt: skip
    assert packed.segments([0, 12, 30], alone_from=10) == [(0, 12, True), (12, 30, True)]
    assert packed.segments([0, 2, 4, 9], alone_from=10) == [(0, 9, False)]


def test_a_row_cut_for_cudnn_computes_each_sequences_attention_alone(monkeypatch):
    monkeypatch.setattr(packed, "CUDNN_FROM", 10)
    monkeypatch.setattr(packed, "CUDNN_PAD", 8)  # 13 and 19 tokens padded to 16 and 24
    monkeypatch.setattr(packed, "sdpa_kernel", lambda backend: contextlib.nullcontext())
    runs = []

    def varlen(q, k, v, cu, max_len, scale):
        runs.append((cu.tolist(), max_len))
        return packed._per_sequence(q, k, v, cu, scale)

    monkeypatch.setattr(packed, "_varlen", varlen)
    cu = torch.tensor([0, 3, 5, 18, 21, 40], dtype=torch.int32)
    torch.manual_seed(0)
    q = torch.randn(40, 4, 8, requires_grad=True)
    k, v = (torch.randn(40, 2, 8, requires_grad=True) for _ in range(2))
    grad = torch.randn(40, 4, 8)

    out = packed._long_alone(q, k, v, cu, 19, 0.3)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want_out = packed._per_sequence(q, k, v, cu, 0.3)
    want = torch.autograd.grad(want_out, (q, k, v), grad)

    assert runs == [([0, 3, 5], 9), ([0, 3], 9)]  # the short runs, each from its own start
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_the_cudnn_probe_runs_its_own_graph_inside_a_logprob_pass_and_a_checkpointed_layer(monkeypatch):
    """The first long sequence may come in a no-grad logprob pass or inside a checkpointed layer, whose hooks
    would take the probe's saved tensors; on the CPU SDPA's own kernel stands in for cuDNN's."""
    monkeypatch.setattr(packed, "sdpa_kernel", lambda backend: contextlib.nullcontext())
    probe = packed._cudnn_ok.__wrapped__  # uncached
    cpu = torch.device("cpu")
    with torch.inference_mode():
        assert probe(cpu, torch.float32, 4, 2, 8)
    with torch.no_grad():
        assert probe(cpu, torch.float32, 4, 2, 8)

    def layer(x):
        assert probe(cpu, torch.float32, 4, 2, 8)
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum().backward()
    torch.testing.assert_close(x.grad, x.detach().cos())
