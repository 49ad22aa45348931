"""Our trainer's weight group meets a receiver written from SGLang's description (../shared/SGLANG_API.md, "The
weight-update group"), not from our code, in both directions: our trainer side and one server of tensor size 2
(its ranks rank_offset + tp_rank in processes of their own); AReaL's trainer side and our built-in server. Each
side joins through torch's rendezvous, PrefixStore(group_name) and the group helper; a flattened bucket is one
uint8 buffer cut in order."""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
from datetime import timedelta

import torch
from transformers import AutoModelForCausalLM

from areal_hpc.weights.bucket import bucket_fields, plan_buckets
from areal_hpc.weights.group import WeightGroup, host_store, server_ranks
from areal_hpc.weights.sender import send_buckets, weight_metas
from tests.test_weights_broadcast import GREEDY, PROMPT, check_greedy_under, client  # noqa: F401 (fixture)

GROUP = "weight_update_group"  # SGLang's default name


def sglang_tp_rank(
    port: int, rank_offset: int, tp_rank: int, world_size: int, buckets: list, out: str
) -> None:
    """One TP rank of an SGLang server receiving `buckets` (their /update_weights_from_distributed fields)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    rank, timeout = rank_offset + tp_rank, timedelta(seconds=60)
    store, _, _ = next(dist.rendezvous(f"tcp://127.0.0.1:{port}", rank, world_size, timeout=timeout))
    store = dist.PrefixStore(GROUP, store)
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], dist.Backend("gloo"), store, group_name=GROUP, timeout=timeout
    )
    received = {}
    for bucket in buckets:
        empties = [
            torch.empty(s, dtype=getattr(torch, d))
            for d, s in zip(bucket["dtypes"], bucket["shapes"], strict=True)
        ]
        flat = torch.empty(sum(t.numel() * t.element_size() for t in empties), dtype=torch.uint8)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        pg.broadcast([flat], options).wait()
        offset = 0
        for name, t in zip(bucket["names"], empties, strict=True):
            n = t.numel() * t.element_size()
            received[name] = flat[offset : offset + n].view(t.dtype).reshape(t.shape).clone()
            offset += n
    torch.save(received, out)
    # Leave without the interpreter's shutdown: the gloo group (kept in c10d's maps) would be freed while it
    # dies, and a worker thread ended there aborts the process now and then (train.dist.destroy says why).
    os._exit(0)


def test_the_trainer_side_meets_a_receiver_written_from_sglang_description(tmp_path):
    weights = {"a.weight": torch.randn(3, 4), "a.bias": torch.randn(4), "b.weight": torch.randn(64, 8)}
    buckets = plan_buckets(weight_metas(weights, torch.bfloat16), bucket_bytes=256)
    (offset,), world_size = server_ranks([2])  # rank 0 the trainer; the server's two TP ranks: 1 and 2
    assert (offset, world_size) == (1, 3)
    store = host_store("127.0.0.1", 0, 60)
    fields = [bucket_fields(b) for b in buckets]
    spawn = multiprocessing.get_context("spawn")
    ranks = [
        spawn.Process(
            target=sglang_tp_rank, args=(store.port, offset, tp, world_size, fields, tmp_path / f"{tp}.pt")
        )
        for tp in range(2)
    ]
    for process in ranks:
        process.start()
    group = WeightGroup(store, GROUP, 0, world_size, "gloo", timeout_s=60)
    sent: list = []
    sender = threading.Thread(target=lambda: sent.append(send_buckets(group, weights, buckets)))
    sender.start()
    sender.join(60)
    for process in ranks:
        process.join(60)
        assert process.exitcode == 0
    group.destroy()
    assert len(buckets) == 2 and sent == [sum(2 * t.numel() for t in weights.values())]
    for tp in range(2):  # every TP rank gets every tensor whole, in bfloat16
        received = torch.load(tmp_path / f"{tp}.pt")
        assert list(received) == ["a.weight", "a.bias", "b.weight"]
        for name, tensor in weights.items():
            assert torch.equal(received[name], tensor.bfloat16())


def test_the_built_in_server_meets_a_trainer_side_written_from_sglang_description(client, tiny_model_dir):  # noqa: F811
    # AReaL's trainer side: rank 0 serves the store through the rendezvous itself, then the same PrefixStore
    # and group helper; the bucket goes as one uint8 buffer while the server's HTTP request waits for it.
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    name, timeout = "areal-lite-group", timedelta(seconds=60)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def rank0() -> object:
        store, _, _ = next(dist.rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=timeout))
        pg, _ = c10d._new_process_group_helper(
            2, 0, [], dist.Backend("gloo"), dist.PrefixStore(name, store), group_name=name, timeout=timeout
        )
        return pg

    made: list = []
    trainer = threading.Thread(target=lambda: made.append(rank0()))
    trainer.start()
    client.init_weights_update_group(
        "127.0.0.1", str(port), 1, 2, name, "gloo"
    )  # the port as AReaL-lite sends it
    trainer.join(60)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    norms = {n: p.detach() * 0.5 for n, p in model.named_parameters() if n.endswith("norm.weight")}
    flat = torch.cat([t.flatten().view(torch.uint8) for t in norms.values()])
    update = threading.Thread(target=lambda: client.update_weights_from_distributed(
        list(norms), ["float32"] * len(norms), [list(t.shape) for t in norms.values()], name,
        weight_version="5", load_format="flattened_bucket",
    ))  # fmt: skip
    update.start()
    options = dist.BroadcastOptions()
    options.rootRank = 0
    made[0].broadcast([flat], options).wait()
    update.join(60)
    with torch.no_grad():
        for n, t in norms.items():
            model.get_parameter(n).copy_(t)
    assert client.model_info()["weight_version"] == "5"
    check_greedy_under(model, client.generate(PROMPT, GREEDY)[0])
