"""A LoRA actor's adapters leave the trainer as PEFT folders (weights/adapter.py) and are served as they are:
PEFT loads them, the built-in engine runs them as a side path (SGLang's /load_lora_adapter and lora_path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from areal_hpc.config.schema import MicroBatchSpec
from areal_hpc.gen.backends.builtin.engine import Engine
from areal_hpc.gen.backends.builtin.protocol import RequestError, SamplingParams, parse_generate
from areal_hpc.gen.backends.builtin.server import App, GenHTTPServer
from areal_hpc.gen.client import GenClient, GenServerError
from areal_hpc.train.backends.fsdp.engine import FSDPEngine
from areal_hpc.weights.adapter import AdapterError, merged, read_adapter
from tests.helpers import REPO_ROOT
from tests.test_fsdp_engine import packed
from tests.test_lora import lora_actor, step

TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A LoRA actor after two steps, and its adapter as published."""
    engine = FSDPEngine(lora_actor(tiny_model_dir, targets=TARGETS), total_train_steps=2)
    batch = packed()
    step(engine, batch)
    step(engine, batch)
    folder = engine.save_adapter(tmp_path_factory.mktemp("adapter") / "v2")
    return engine, batch, folder


def test_the_published_adapter_loads_in_peft_and_gives_the_trainers_logprobs(trained, tiny_model_dir):
    engine, batch, folder = trained
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (
        config["peft_type"] == "LORA"
        and config["r"] == 4
        and sorted(config["target_modules"]) == sorted(TARGETS)
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, folder).merge_and_unload()
    mine = engine.logprobs(batch, 1.0, MicroBatchSpec())
    ids = torch.tensor(batch["packed_input_ids"])[None]
    cu = batch["cu_seqlens"]
    with torch.no_grad():
        for i in range(len(cu) - 1):
            seq = ids[:, cu[i] : cu[i + 1]]
            logits = peft(seq).logits.float().log_softmax(-1)
            theirs = logits[0, :-1].gather(-1, seq[0, 1:, None])[:, 0]
            torch.testing.assert_close(mine[cu[i] + 1 : cu[i + 1]], theirs, rtol=1e-5, atol=1e-5)


def test_the_adapter_folded_into_its_base_is_the_merged_model(trained, tiny_model_dir):
    engine, batch, folder = trained
    adapter = read_adapter(folder)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    folded = dict(merged(base.items(), adapter))
    for name, tensor in engine.hf_weights():
        torch.testing.assert_close(folded[name], tensor, rtol=1e-6, atol=1e-6)


def test_a_hostile_adapter_folder_is_refused_by_name(trained, tmp_path):
    _, _, folder = trained
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True})
    )
    with pytest.raises(AdapterError, match="use_dora"):
        read_adapter(bad)
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 0, "lora_alpha": 8}))
    with pytest.raises(AdapterError, match="r is 0"):
        read_adapter(bad)
    (folder / "adapter_model.safetensors").read_bytes()  # (the real one is untouched)


def test_the_builtin_engine_serves_the_adapter_with_the_trainers_logprobs(trained, tiny_model_dir):
    trainer, batch, folder = trained
    engine = Engine(tiny_model_dir, max_batch_size=4, max_lora_rank=8, lora_targets=TARGETS).start()
    try:
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        prompt = [int(t) for t in batch["packed_input_ids"][: batch["cu_seqlens"][1]]][:5]
        base = engine.submit([prompt], greedy).wait()[0]
        engine.adapters.load("policy-v2", str(folder), engine.device)
        with pytest.raises(RequestError, match="serves LoRA adapter policy-v2"):
            engine.submit([prompt], greedy)  # the base alone is no longer what it serves
        with pytest.raises(RequestError, match="never been loaded: policy-v9"):
            engine.submit([prompt], greedy, adapter="policy-v9")
        out = engine.submit([prompt], greedy, adapter="policy-v2").wait()[0]
        seq = {
            "packed_input_ids": torch.tensor(prompt + out.output_ids).numpy(),
            "cu_seqlens": torch.tensor([0, len(prompt) + len(out.output_ids)]).numpy(),
        }
        expected = trainer.logprobs(seq, 1.0, MicroBatchSpec())[len(prompt) :]
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, rtol=1e-4, atol=1e-4)
        engine.adapters.load("policy-v3", str(folder), engine.device)  # the next version (the same tensors)
        assert engine.submit([prompt], greedy, adapter="policy-v2").wait()[0].output_ids == out.output_ids
        assert engine.adapters.unload("policy-v2") == {"policy-v3": str(folder)}  # the old one goes
        with pytest.raises(RequestError, match="never been loaded: policy-v2"):
            engine.submit([prompt], greedy, adapter="policy-v2")
        assert engine.adapters.unload("policy-v3") == {}
        again = engine.submit([prompt], greedy).wait()[0]
        assert again.output_ids == base.output_ids and again.logprobs == pytest.approx(
            base.logprobs, abs=1e-5
        )
    finally:
        engine.stop()


def test_the_gpu_check_of_lora_serving_runs_on_the_tiny_model(tiny_model_dir):
    """tools/gpu_check_lora.py (issue 47's GPU targets) on the CPU: it runs, and its checks hold."""
    args = ["--device", "cpu", "--shape", "tiny", "--rank", "8", "--rows", "4", "--tokens", "8"]
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "gpu_check_lora.py"), *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "AREAL_HPC_TINY": str(tiny_model_dir.parent)})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["bytes_ratio"] > 5 and stats["mean_abs_logprob_diff"] < 0.01


def test_the_builtin_servers_lora_routes_answer_as_sglangs(trained, tiny_model_dir, tmp_path):
    _, batch, folder = trained
    engine = Engine(tiny_model_dir, max_batch_size=4, max_lora_rank=8, lora_targets=TARGETS).start()
    httpd = GenHTTPServer(("127.0.0.1", 0), App(engine, {}), "key")
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    client = GenClient(f"http://127.0.0.1:{httpd.server_address[1]}", "key", adapters=True)
    try:
        prompt = [int(t) for t in batch["packed_input_ids"][:5]]
        with pytest.raises(GenServerError, match=r"HTTP 400.*no adapter_config.json"):
            client.load_lora_adapter("policy-v1", str(tmp_path))  # a folder that holds no adapter
        with pytest.raises(GenServerError, match="HTTP 400.*does not exist"):
            client.unload_lora_adapter("policy-v1")
        assert client.load_lora_adapter("policy-v1", str(folder))["loaded_adapters"] == {
            "policy-v1": str(folder)
        }
        client.update_weight_version(1, abort_all_requests=True)
        (answer,) = client.generate(prompt, {"max_new_tokens": 3, "temperature": 0.0})
        assert answer["meta_info"]["weight_version"] == "1"  # it named policy-v1, as /model_info said
        # Its server moved on (policy-v2 in, policy-v1 out) since the client asked: refused, sent again.
        client.load_lora_adapter("policy-v2", str(folder))
        client.update_weight_version(2, abort_all_requests=True)
        client.unload_lora_adapter("policy-v1")
        (answer,) = client.generate(prompt, {"max_new_tokens": 3, "temperature": 0.0})
        assert answer["meta_info"]["weight_version"] == "2"
    finally:
        httpd.shutdown()
        engine.stop()


@pytest.mark.parametrize(
    ("lora_path", "why"),
    [(5, "must be an adapter's name"), (["", ""], "must be an adapter's name"), (["a", "a", "a"], "one adapter per prompt"),
     (["a", "b"], "names several adapters"), ({"$ne": 1}, "must be an adapter's name")],
)  # fmt: skip
def test_a_malformed_lora_path_is_refused_by_name(lora_path, why):
    with pytest.raises(RequestError, match=f"lora_path: .*{why}"):
        parse_generate({"input_ids": [[1, 2], [3, 4]], "lora_path": lora_path}, None)
