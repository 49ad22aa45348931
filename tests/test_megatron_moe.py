"""Mixture-of-experts models in the megatron backend on CPU gloo ranks: HF <-> Megatron conversion of experts
split over expert-parallel ranks, the model's logprobs equal to transformers' at EP=1, EP=2 and TP=2 x EP=2,
and a training step at those layouts equal to one rank's. A Qwen2-MoE built here adds a shared expert, a dense
layer and the auxiliary losses: equal to one rank's with padding at TP=2, the balancing loss equal to
transformers'. Routing replay: the routers route as the servers did after the weights moved."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM
from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

from areal_hpc.config.schema import ActorConfig, MicroBatchSpec, OptimizerConfig
from areal_hpc.data import CU, ROUTED_EXPERTS, select
from areal_hpc.train import dist
from areal_hpc.train.backends.megatron import convert
from areal_hpc.train.microbatch import micro_batches
from tests.test_fsdp_engine import LENGTHS, alone, model_config, nll, packed
from tests.test_routed_experts import hf_routing

# (tensor, pipeline, expert); data = 2 when expert = 2. TP 2 runs sequence parallel: each TP rank routes its own
# tokens, and its experts' gradients are summed with the other's (expert data-parallel group).
LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 1, 2), (1, 2, 1)]


def hf_of(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def qwen2_moe(path, num_hidden_layers=2, router_z_loss_coef=0.001):
    """A random Qwen2-MoE saved in ``path``: 8 experts, top 2 without renormalisation, a gated shared expert, layer 1
    dense, the load-balancing loss and a router z-loss on (no Qwen config sets one; transformers keeps the key)."""
    config = Qwen2MoeConfig(
        vocab_size=1024, hidden_size=64, num_hidden_layers=num_hidden_layers, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
        shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1], output_router_logits=True,
        router_aux_loss_coef=0.01, router_z_loss_coef=router_z_loss_coef, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory):
    return qwen2_moe(tmp_path_factory.mktemp("qwen2-moe"))


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (1, 1, 2), (2, 1, 4), (1, 2, 8), (2, 2, 2)])
@pytest.mark.parametrize("model", ["tiny_moe_dir", "qwen2_moe_dir"])
def test_hf_to_megatron_and_back_is_bit_exact(model, tp, pp, ep, request):
    model_dir = request.getfixturevalue(model)
    hf, weights = hf_of(model_dir), load_file(model_dir / "model.safetensors")
    back = {}
    for pp_rank in range(pp):
        layouts = [[convert.Layout(tp, t, pp, pp_rank, ep, e) for t in range(tp)] for e in range(ep)]
        ranks = [
            [dict((n, x) for n, _, x in convert.load_shards(hf, lay, weights.__getitem__)) for lay in row]
            for row in layouts
        ]
        for name, param in convert.exported(hf, layouts[0][0]).items():
            shards = [r[0][name] for r in ranks] if param.experts else [r[name] for r in ranks[0]]
            back.update(zip(param.hf_names, convert.unshard(param, shards, hf), strict=True))
    assert back.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(back[name], tensor), name


def test_each_expert_parallel_rank_holds_its_own_experts(tiny_moe_dir):
    hf = hf_of(tiny_moe_dir)
    second = convert.params_of(hf, convert.Layout(ep=4, ep_rank=1))["decoder.layers.0.mlp.experts.fc2_weight"]
    assert second.hf_names == tuple(f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in (2, 3))


def no_loss(out, mb):  # the step's gradient is then the auxiliary losses' alone
    return out["logprobs"].sum() * 0.0


def _rank_main(rank, world, layout, model_dir, mb_tokens, loss_fn, recompute, out):
    tp, pp, ep = layout
    torch.set_num_threads(1)
    dist.init_distributed(rank, world, f"{out}.init", backend="gloo", timeout_s=300)
    try:
        from areal_hpc.train.backends.megatron.engine import MegatronEngine

        cfg = model_config(model_dir, gradient_checkpointing=recompute)
        engine = MegatronEngine(cfg, 10, tensor=tp, pipeline=pp, expert=ep)
        before = engine.logprobs(packed(), 1.0, MicroBatchSpec(max_tokens_per_mb=16))
        replicas = world // (tp * pp)  # each data-parallel replica trains on its share of the sequences
        mine = np.array_split(np.arange(len(LENGTHS)), replicas)[engine.groups.dp.rank()]
        mbs = micro_batches(select(packed(), list(mine)), MicroBatchSpec(max_tokens_per_mb=mb_tokens))
        step = engine.train_minibatch(mbs, loss_fn)
        after = engine.logprobs(packed(), 1.0, MicroBatchSpec(max_tokens_per_mb=16))
        weights = dict(engine.hf_weights())
        plan = engine.hf_params()  # what publication's buckets are planned from: every expert of every rank
        assert {n: p.shape for n, p in plan.items()} == {n: w.shape for n, w in weights.items()}
        result = {"before": before, "step": step, "after": after, "weights": weights}
        result["saved"] = engine.save_hf(f"{out}.saved")  # rank 0 returns the directory
        torch.save(result, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy()


def run(model_dir, tmp, layout, mb_tokens=20, loss_fn=nll, recompute=False) -> list[dict]:
    """``layout`` (tensor, pipeline, expert) on gloo ranks, two data-parallel replicas when expert > 1: every
    rank's results (``recompute``: with activation recomputation)."""
    tp, pp, ep = layout
    world = tp * pp * (2 if ep > 1 else 1)
    prefix = str(tmp / f"tp{tp}pp{pp}ep{ep}-{mb_tokens}{'-recompute' * recompute}" / "rank")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = (world, layout, str(model_dir), mb_tokens, loss_fn, recompute, prefix)
    mp.spawn(_rank_main, args=args, nprocs=world)
    return [torch.load(f"{prefix}.{r}") for r in range(world)]


@pytest.fixture(scope="module")
def tiny_runs(tiny_moe_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    return {layout: run(tiny_moe_dir, tmp, layout) for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_logprobs_equal_the_hf_models(tiny_runs, tiny_moe_dir, layout):
    expected = alone(tiny_moe_dir, packed(), 1.0)
    for rank in tiny_runs[layout]:
        torch.testing.assert_close(rank["before"], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_a_training_step_with_experts_split_equals_one_ranks(tiny_runs, layout):
    one, many = tiny_runs[1, 1, 1][0], tiny_runs[layout]
    # each replica's loss, on each of its TP ranks and pipeline stages
    replicas_loss = sum(rank["step"]["loss"] for rank in many) / (layout[0] * layout[1])
    assert replicas_loss == pytest.approx(one["step"]["loss"], rel=1e-6)
    for rank in many:
        assert rank["step"]["grad_norm"] == pytest.approx(one["step"]["grad_norm"], rel=1e-5)
        assert rank["step"]["moe/load_imbalance"] == pytest.approx(one["step"]["moe/load_imbalance"])
        torch.testing.assert_close(rank["after"], one["after"], atol=1e-5, rtol=0)
        for name, tensor in rank["weights"].items():  # every rank gets every expert
            torch.testing.assert_close(tensor, one["weights"][name], atol=1e-6, rtol=0)


def test_save_hf_writes_every_expert_for_transformers(tiny_runs):
    ranks = tiny_runs[2, 1, 2]
    saved = AutoModelForCausalLM.from_pretrained(ranks[0]["saved"], dtype=torch.float32).state_dict()
    reference = AutoModelForCausalLM.from_pretrained(tiny_runs[1, 1, 1][0]["saved"], dtype=torch.float32)
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(saved[name], tensor, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def qwen2_runs(qwen2_moe_dir, tmp_path_factory):
    """``runs(layout)``: every rank's results of ``run`` on the Qwen2-MoE, one sequence per micro-batch (so that
    each micro-batch's balancing loss is the same on every layout), each layout run once."""
    tmp, done = tmp_path_factory.mktemp("qwen2-moe-runs"), {}

    def runs(layout, recompute=False):
        if (layout, recompute) not in done:
            done[layout, recompute] = run(qwen2_moe_dir, tmp, layout, mb_tokens=1, recompute=recompute)
        return done[layout, recompute]

    return runs


@pytest.mark.parametrize("layout", [(1, 1, 2), (2, 1, 1), (2, 1, 2)])
def test_shared_expert_dense_layer_and_auxiliary_losses_equal_one_rank(qwen2_moe_dir, qwen2_runs, layout):
    """At TP=2 the odd lengths (9, 5, 13, 7, 11) are padded: padding counts in neither auxiliary loss, and the
    TP ranks' parts of a micro-batch's losses (and of their statistics) add up to one rank's."""
    expected = alone(qwen2_moe_dir, packed(), 1.0)
    one, many = qwen2_runs((1, 1, 1))[0], qwen2_runs(layout)
    for rank in [one, *many]:
        torch.testing.assert_close(rank["before"], expected, atol=1e-5, rtol=0)
    assert one["step"]["moe/load_balancing_loss"] > 0 and one["step"]["moe/z_loss"] > 0
    assert list(k for k in one["step"] if "layer" in k) == ["moe/load_imbalance/layer0"]  # layer 1 is dense
    replicas_loss = sum(rank["step"]["loss"] for rank in many) / layout[0]  # each on its TP ranks
    assert replicas_loss == pytest.approx(one["step"]["loss"], rel=1e-6)
    for rank in many:
        for key in ("grad_norm", "moe/load_balancing_loss", "moe/z_loss", "moe/load_imbalance"):
            assert rank["step"][key] == pytest.approx(one["step"][key], rel=1e-5), key
        torch.testing.assert_close(rank["after"], one["after"], atol=1e-5, rtol=0)
        for name, tensor in rank["weights"].items():
            torch.testing.assert_close(tensor, one["weights"][name], atol=1e-6, rtol=0)


def test_activation_recomputation_changes_no_auxiliary_loss(qwen2_runs):
    """A recomputed layer routes twice (without gradients, then with): its losses count once."""
    one, again = qwen2_runs((1, 1, 1))[0]["step"], qwen2_runs((1, 1, 1), recompute=True)[0]["step"]
    for key in ("loss", "grad_norm", "moe/load_balancing_loss", "moe/z_loss", "moe/load_imbalance"):
        assert again[key] == pytest.approx(one[key], rel=1e-6), key


@pytest.mark.parametrize("layers", [2, 4])  # layer 1 dense: one sparse layer, or three
def test_the_balancing_loss_is_transformers_aux_loss(tmp_path, layers):
    """One step, one micro-batch of all the sequences, a loss of zero and no z loss: the step's gradient is the
    balancing loss's alone. transformers' model on the same weights, the sequences padded in one batch, gives its
    ``aux_loss`` (one loss over every sparse layer's tokens together) and, from its router logits, the loss of each
    sparse layer alone: the engine's loss is their mean, HF's aux_loss with one sparse layer."""
    model_dir = qwen2_moe(tmp_path / "model", num_hidden_layers=layers, router_z_loss_coef=0.0)
    step = run(model_dir, tmp_path, (1, 1, 1), mb_tokens=1000, loss_fn=no_loss)[0]["step"]

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    mask = torch.arange(max(LENGTHS)) < torch.tensor(LENGTHS)[:, None]
    ids[mask] = torch.from_numpy(packed()["packed_input_ids"])
    out = hf(input_ids=ids, attention_mask=mask.long(), output_router_logits=True)
    experts, k, coef = hf.config.num_experts, hf.config.num_experts_per_tok, hf.config.router_aux_loss_coef
    per_layer = torch.stack([load_balancing_loss_func((x,), experts, k, mask) for x in out.router_logits])
    (coef * per_layer.mean()).backward()
    grad_norm = torch.cat([x.grad.flatten() for x in hf.parameters() if x.grad is not None]).norm()

    mean = float(per_layer.mean())
    assert step["moe/load_balancing_loss"] == pytest.approx(mean, rel=1e-5)
    assert step["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)  # the loss the engine trains on
    # HF's pooled loss is the layers' mean less E * sum_i cov_l(f_i, P_i) over the layers: f_i = the top-k choices
    # of expert i per token, P_i = its mean probability, over each layer's real tokens
    logits = torch.stack(out.router_logits)[:, mask.flatten()].detach()  # [sparse layers, tokens, experts]
    f = torch.zeros_like(logits).scatter_(-1, logits.topk(k).indices, 1.0).mean(1)
    probs = logits.softmax(-1).mean(1)
    covariance = float(((f * probs).mean(0) - f.mean(0) * probs.mean(0)).sum())
    assert float(out.aux_loss) == pytest.approx(mean - experts * covariance, rel=1e-5)
    if layers == 2:  # one sparse layer: HF's aux_loss itself
        assert step["moe/load_balancing_loss"] == pytest.approx(float(out.aux_loss), rel=1e-5)
    else:  # 2.085 here, HF's 2.032
        assert abs(experts * covariance) > 0.01


# --- routing replay ----------------------------------------------------------------------------------------------


def recorded_routing(model_dir, batch) -> np.ndarray:
    """What the generation servers would have recorded: transformers' top-k of each token, sequence by sequence,
    [T, layers, k] as uint8 (the rollout's batch key)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cu, ids = batch[CU], batch["packed_input_ids"]
    return np.concatenate([hf_routing(model, ids[a:b]) for a, b in zip(cu[:-1], cu[1:], strict=True)]).astype(
        np.uint8
    )


def _replay_rank(rank, world, layout, mode, model_dir, out):
    tp, pp, recompute = layout
    torch.set_num_threads(1)
    dist.init_distributed(rank, world, f"{out}.init", backend="gloo", timeout_s=300)
    try:
        from areal_hpc.train.backends.megatron.engine import MegatronEngine
        from areal_hpc.train.backends.megatron.replay import routers

        cfg = ActorConfig(
            path=model_dir, dtype="float32", router_replay=mode, gradient_checkpointing=recompute,
            optimizer=OptimizerConfig(lr=1e-3),
        )  # fmt: skip
        engine = MegatronEngine(cfg, 10, tensor=tp, pipeline=pp)
        moved = load_file(f"{model_dir}/model.safetensors")  # the weights moved since the servers routed:
        engine.load_weights((n, -t if n.endswith("mlp.gate.weight") else t) for n, t in moved.items())
        chosen = []  # each router call's choice: (layer, [tokens of this TP rank, experts])
        for router in routers(engine.model):
            router.register_forward_hook(lambda r, args, out: chosen.append((r.layer_number, out[1])))
        batch = {**packed(), ROUTED_EXPERTS: recorded_routing(model_dir, packed())}
        engine.logprobs(batch, 1.0, MicroBatchSpec(max_tokens_per_mb=1000))  # one micro-batch
        mbs = micro_batches(batch, MicroBatchSpec(max_tokens_per_mb=16))  # several, pipelined
        step = engine.train_minibatch(mbs, nll)
        recorded = [torch.from_numpy(b[ROUTED_EXPERTS]).long() for b in [batch, *mbs]]
        torch.save({"chosen": chosen, "step": step, "recorded": recorded}, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy()


def routed_like_one_of(routing_map, layer, recorded, tp, tp_rank) -> bool:
    """Whether a router call's ``routing_map`` (this TP rank's tokens) is the recorded routing of one of the
    micro-batches (``recorded``: each one's [T, layers, k]) on its real tokens."""
    for routed in recorded:
        rows = torch.cat([routed[:, layer - 1], torch.arange(2).expand(-len(routed) % tp, -1)])
        rows = rows.chunk(tp)[tp_rank] if tp > 1 else rows
        if len(rows) != len(routing_map):
            continue
        real = min(len(rows), max(0, len(routed) - tp_rank * len(rows)))
        expected = torch.zeros_like(routing_map).scatter_(1, rows, True)
        if torch.equal(routing_map[:real], expected[:real]):
            return True
    return False


@pytest.mark.parametrize("layout", [(1, 1, False), (2, 1, False), (1, 2, True)])  # (tp, pp, recomputation)
def test_replay_routes_as_the_servers_did_after_the_weights_moved(tiny_moe_dir, tmp_path, layout):
    tp, pp, recompute = layout
    results = {}
    for mode in ("rollout", "off"):
        prefix = str(tmp_path / f"{mode}-rank")
        mp.spawn(_replay_rank, args=(tp * pp, layout, mode, str(tiny_moe_dir), prefix), nprocs=tp * pp)
        results[mode] = [torch.load(f"{prefix}.{r}") for r in range(tp * pp)]
    for mode, ranks in results.items():
        for rank_index, rank in enumerate(ranks):
            # every call: the logprob pass, each micro-batch's training forward and its recomputation
            replayed = [
                routed_like_one_of(routing_map, layer, rank["recorded"], tp, rank_index % tp)
                for layer, routing_map in rank["chosen"]
            ]
            n_mbs = len(rank["recorded"]) - 1  # the training micro-batches, after the logprob pass's one
            assert len(replayed) == 2 // pp * (1 + n_mbs * (2 if recompute else 1))
            if mode == "rollout":
                assert all(replayed)
            else:  # the reversed routers choose other experts
                assert not any(replayed)
    assert results["rollout"][-1]["step"]["moe/replay_mismatch"] > 0.5  # the router would choose otherwise
    assert "moe/replay_mismatch" not in results["off"][-1]["step"]
