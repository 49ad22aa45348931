"""Mixtures of experts in the built-in engine (Qwen3-MoE, Qwen2-MoE with a shared expert): logprobs and routed
experts equal transformers' on the CPU in float32, weight updates by either name of an expert, the HTTP
contract of SGLang's return_routed_experts, and the tiny MoE of tools/build_tiny_model.py."""

from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from areal_hpc.gen.backends.builtin import moe
from areal_hpc.gen.backends.builtin.engine import Engine
from areal_hpc.gen.backends.builtin.model import Decoder
from areal_hpc.gen.backends.builtin.protocol import SamplingParams
from areal_hpc.gen.backends.builtin.server import App, GenHTTPServer, parse_args
from tools.build_tiny_model import MANIFEST, MOE_PARAMS

TOKEN = "moe-test-token"
PROMPTS = [[4, 8, 15, 16, 23, 42], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [7]]


def start(path, **kwargs) -> Engine:
    return Engine(str(path), seed=0, max_batch_size=8, **kwargs).start()


@pytest.fixture(scope="module")
def engine(tiny_moe_dir):
    engine = start(tiny_moe_dir, return_routed_experts=True)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def hf(tiny_moe_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_moe_dir).eval()


def hf_forward(model, prompt: list[int], output: list[int], temperature: float):
    """transformers' logprobs of ``output`` after ``prompt`` and its routing of every token but the last,
    [tokens, layers, k] with zeros on dense layers (as the server answers)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        res = model(ids, output_router_logits=True)
    logits = res.logits[0, len(prompt) - 1 : -1] / temperature
    logprobs = logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
    config = model.config
    routing = np.zeros((ids.shape[1], config.num_hidden_layers, config.num_experts_per_tok), dtype=np.int32)
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    for layer, router_logits in zip(sparse, res.router_logits, strict=True):
        routing[:, layer] = router_logits.softmax(-1).topk(config.num_experts_per_tok, -1).indices.numpy()
    return logprobs, routing[:-1]


def assert_like_hf(model, engine: Engine, prompts, params: SamplingParams) -> None:
    outputs = engine.submit(prompts, params, routed=True).wait(60)
    assert len(outputs) == len(prompts) * params.n
    for k, out in enumerate(outputs):
        prompt = prompts[k // params.n]
        logprobs, routing = hf_forward(model, prompt, out.output_ids, params.temperature or 1.0)
        assert torch.allclose(torch.tensor(out.logprobs), logprobs, atol=1e-4)
        assert out.routed_experts.shape == (len(prompt) + len(out.output_ids) - 1, *routing.shape[1:])
        assert np.array_equal(out.routed_experts, routing)


# --- the tiny MoE of the builder -------------------------------------------------------------------------------


def test_the_tiny_moe_is_a_qwen3_moe_with_experts_stored_per_expert(tiny_moe_dir, tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_moe_dir)
    dense = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.model_type == "qwen3_moe" and config.tie_word_embeddings
    assert config.vocab_size == dense.vocab_size
    assert {k: getattr(config, k) for k in MOE_PARAMS} == MOE_PARAMS
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tiny_moe_dir / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    with safe_open(tiny_moe_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118 (safe_open has no __iter__)
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert {f"model.layers.1.mlp.experts.7.{p}_proj.weight" for p in ("gate", "up", "down")} <= names
    assert "model.layers.0.mlp.gate.weight" in names and not any("gate_up_proj" in n for n in names)
    model, info = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    manifest = json.loads((tiny_moe_dir.parent / MANIFEST).read_text())
    assert {"moe/model.safetensors", "moe/config.json", "moe/tokenizer.json"} <= set(manifest["files"])


# --- the experts' arithmetic -----------------------------------------------------------------------------------


def test_every_way_to_apply_the_experts_gives_the_loop_s_sum():
    gen = torch.Generator().manual_seed(0)
    h, gate_up, down = (torch.randn(*s, generator=gen) * 0.2 for s in ((11, 64), (8, 64, 64), (8, 64, 32)))
    weights, ids = moe.route(h, torch.randn(8, 64, generator=gen), top_k=2, norm=True)
    assert torch.allclose(weights.sum(-1), torch.ones(11)) and ids.shape == (11, 2)
    act = lambda x: torch.nn.functional.silu(x[..., :32]) * x[..., 32:]  # noqa: E731
    expected = moe.experts_loop(h, ids, weights, gate_up, down, act)
    for way in (moe.experts_gathered, moe.experts_dense, moe.experts_grouped):
        got = way(h, ids, weights, gate_up, down, act)
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), way.__name__


# --- the engine against transformers --------------------------------------------------------------------------


def test_logprobs_and_routing_equal_transformers(engine, hf):
    # One row decodes by gathering its experts, six by the dense mixture; prompts prefill by the loop.
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    assert_like_hf(hf, engine, PROMPTS[:1], greedy)
    params = SamplingParams(max_new_tokens=8, n=2, temperature=0.7, top_k=50, ignore_eos=True)
    assert_like_hf(hf, engine, PROMPTS, params)


def test_a_weight_update_writes_the_experts_in_place_under_either_name(engine, hf, tiny_moe_dir, tmp_path):
    decoder = engine._sched.runner.decoder
    storage = {n: t.data_ptr() for n, t in decoder.params.items()}
    perturbed = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    perturbed.save_pretrained(tmp_path / "v1")  # per-expert names on disk
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    before = engine.submit(PROMPTS[:1], greedy).wait(60)[0]
    try:
        assert engine.update_weights(str(tmp_path / "v1"), weight_version=1) == "1"
        assert_like_hf(perturbed.eval(), engine, PROMPTS[:1], greedy)
        assert engine.submit(PROMPTS[:1], greedy).wait(60)[0].logprobs != before.logprobs
        # A trainer's state dict: the fused names transformers holds the experts under (gate_up_proj, ...).
        state = [(n, p.detach().clone()) for n, p in hf.named_parameters()]
        assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in state)
        engine.update_weights_from_tensors(lambda: state, weight_version=2)
    finally:
        engine.update_weights(str(tiny_moe_dir), weight_version=3)
    assert engine.submit(PROMPTS[:1], greedy).wait(60)[0].logprobs == before.logprobs
    assert {n: t.data_ptr() for n, t in decoder.params.items()} == storage  # CUDA graphs read the same memory


def test_a_checkpoint_may_hold_the_fused_names_but_no_expert_may_be_missing(tiny_moe_dir, hf, tmp_path):
    decoder = Decoder.from_pretrained(str(tiny_moe_dir), torch.device("cpu"), torch.float32)
    state = {n: p.detach().clone() + 1 for n, p in hf.named_parameters()}
    save_file(state, tmp_path / "model.safetensors")
    decoder.load(str(tmp_path))
    assert torch.equal(decoder.params["1.experts_down"], state["model.layers.1.mlp.experts.down_proj"])
    up = state["model.layers.0.mlp.experts.gate_up_proj"][3, 32:]
    assert torch.equal(decoder.named()["model.layers.0.mlp.experts.3.up_proj.weight"], up)
    del state["model.layers.1.mlp.experts.down_proj"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.experts\.0\.down_proj\.weight"):
        decoder.load(str(tmp_path))


def qwen2_moe_dir(path: Path) -> Path:
    """A tiny random Qwen2-MoE: a shared expert, unnormalised top-k, layer 1 dense."""
    config = Qwen2MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[1], max_position_embeddings=256,
        eos_token_id=299, tie_word_embeddings=False,
    )  # fmt: skip
    assert not config.norm_topk_prob and config.qkv_bias
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = Qwen2MoeForCausalLM(config)
        # Larger weights than the init's, so that the shared expert's gate and the router matter.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


def test_a_qwen2_moe_with_a_shared_expert_matches_transformers(tmp_path):
    path = qwen2_moe_dir(tmp_path / "qwen2moe")
    engine = start(path, return_routed_experts=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        params = SamplingParams(max_new_tokens=5, n=2, temperature=1.0, ignore_eos=True)
        assert_like_hf(model, engine, PROMPTS[:2], params)
        routed = engine.submit(PROMPTS[:1], params, routed=True).wait(60)[0].routed_experts
        assert not routed[:, 1].any() and routed[:, [0, 2]].any()  # zeros on the dense layer
    finally:
        engine.stop()


# --- the HTTP contract (SGLang's) -------------------------------------------------------------------------------


def serve(engine: Engine) -> tuple[GenHTTPServer, str]:
    httpd = GenHTTPServer(("127.0.0.1", 0), App(engine, {}), TOKEN)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def generate(url: str, body: dict):
    request = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Authorization": f"Bearer {TOKEN}"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def decode_routed(meta: dict, rows: int, config) -> np.ndarray:
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
    return flat.reshape(rows, config.num_hidden_layers, config.num_experts_per_tok)


def test_the_server_returns_each_answer_s_routed_experts_as_sglang_does(engine, hf):
    httpd, url = serve(engine)
    try:
        prompt, sampling = PROMPTS[1], {"max_new_tokens": 5, "n": 2, "temperature": 1.0, "ignore_eos": True}
        body = {"input_ids": prompt, "sampling_params": sampling, "return_routed_experts": True}
        answers = generate(url, body)
        assert len(answers) == 2
        for answer in answers:
            rows = len(prompt) + len(answer["output_ids"]) - 1
            got = decode_routed(answer["meta_info"], rows, hf.config)
            assert np.array_equal(got, hf_forward(hf, prompt, answer["output_ids"], 1.0)[1])
        plain = generate(url, {"input_ids": prompt, "sampling_params": sampling})
        assert all("routed_experts" not in a["meta_info"] for a in plain)  # not asked: absent
        with pytest.raises(urllib.error.HTTPError, match="400"):
            generate(url, {"input_ids": prompt, "return_routed_experts": "yes"})
    finally:
        httpd.shutdown()


def test_without_the_flag_the_field_is_absent_and_a_dense_model_refuses_the_flag(
    tiny_moe_dir, tiny_model_dir
):
    # As SGLang without --enable-return-routed-experts: the request field is dropped.
    engine = start(tiny_moe_dir)
    httpd, url = serve(engine)
    try:
        answer = generate(url, {"input_ids": [5, 6, 7], "return_routed_experts": True})
        assert "routed_experts" not in answer["meta_info"] and answer["output_ids"]
    finally:
        httpd.shutdown()
        engine.stop()
    # SGLang fails at start (its capturer reads num_experts_per_tok, which a dense config lacks); so do we.
    with pytest.raises(ValueError, match="routed-expert recording needs a mixture-of-experts model"):
        start(tiny_model_dir, return_routed_experts=True)


def test_the_command_line_takes_sglang_s_flag(tmp_path):
    spec, _ = parse_args(["--model-path", "m", "--token-file", "t", "--enable-return-routed-experts"])
    assert spec.enable_return_routed_experts
    assert not parse_args(["--model-path", "m", "--token-file", "t"])[0].enable_return_routed_experts
