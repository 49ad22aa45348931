"""What we send SGLang, checked against SGLang's own source (the pinned wheel, read as text: its CUDA
dependencies cannot be installed here, so nothing of it is imported; `make test` unpacks it into
.cache/sglang-src). Every flag the launcher emits is one of ServerArgs' arguments; every body the client sends
to a route has only fields of the request class that route takes (FastAPI drops unknown ones silently) and all
its required ones; every sampling parameter is one SGLang's SamplingParams takes. What we read from its
answers: tests/test_sglang_answers.py."""

from __future__ import annotations

import ast
import functools
import json
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from areal_hpc.config import ConfigError, load_config
from areal_hpc.gen.client import GenClient
from areal_hpc.gen.rollout import group_params, sampling_params

REPO = Path(__file__).resolve().parents[1]
SRC = Path(os.environ.get("AREAL_SGLANG_SRC", REPO / ".cache" / "sglang-src")) / "sglang" / "srt"
pytestmark = pytest.mark.skipif(not SRC.is_dir(), reason=f"{SRC} missing: `make test` unpacks sglang there")
GOLDEN_COMMANDS = sorted((REPO / "tests" / "golden").glob("*.servers.txt"))
# Ours, and said so: the built-in server bounds its join by it; SGLang drops it (its group waits 30 minutes).
OURS = {"/init_weights_update_group": {"timeout_secs"}}


def tree(relative: str, root: Path = SRC) -> ast.Module:
    return parse((root / relative).read_text())


@functools.cache  # several checks read the same files, and an altered copy of them is mostly the same text
def parse(text: str) -> ast.Module:
    return ast.parse(text)


def cli_flags() -> set[str]:
    """Every `--flag` ServerArgs.add_cli_args declares."""
    return {
        arg.value
        for node in ast.walk(tree("server_args.py"))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
        for arg in node.args
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--")
    }


def request_classes() -> dict[str, str]:
    """Route -> the io_struct class its handler takes as `obj` (http_server.py's decorators)."""
    routes = {}
    for node in tree("entrypoints/http_server.py").body:
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        obj = next((a for a in node.args.args if a.arg == "obj"), None)
        for deco in node.decorator_list:
            if isinstance(deco, ast.Call) and getattr(deco.func, "attr", "") in ("post", "api_route") and obj:
                routes[deco.args[0].value] = ast.unparse(obj.annotation)
    return routes


def class_fields(name: str) -> dict[str, bool]:
    """Field -> required (no default) of an io_struct dataclass, its bases' included."""
    classes = {n.name: n for n in tree("managers/io_struct.py").body if isinstance(n, ast.ClassDef)}
    fields: dict[str, bool] = {}
    stack = [classes[name]]
    while stack:
        cls = stack.pop()
        stack += [classes[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in classes]
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                fields.setdefault(stmt.target.id, stmt.value is None)
    return fields


def sampling_param_names() -> set[str]:
    (cls,) = [
        n
        for n in tree("sampling/sampling_params.py").body
        if isinstance(n, ast.ClassDef) and n.name == "SamplingParams"
    ]
    (init,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    return {a.arg for a in init.args.args[1:] + init.args.kwonlyargs}


def test_every_flag_the_launcher_emits_is_one_of_sglang_server_args():
    ours = {
        arg
        for golden in GOLDEN_COMMANDS
        for line in golden.read_text().splitlines()
        for arg in line.split()
        if arg.startswith("--")
    }
    ours -= {"--token-file"}  # our launcher's own, taken off before SGLang parses the rest
    assert ours and ours <= cli_flags(), sorted(ours - cli_flags())


# SGLang's answers, as the fake server gives them; /generate's as with --skip-tokenizer-init (no text) and
# return_logprob.
GENERATE = {
    "output_ids": [5, 2],
    "meta_info": {
        "id": "r1",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "cached_tokens": 0,
        "weight_version": "0",
        "e2e_latency": 0.1,
        "output_token_logprobs": [[-0.5, 5, None], [-0.25, 2, None]],
    },
}
DONE = {"success": True, "message": ""}
PAUSED = {"message": "", "status": "ok"}
REPLIES = {  # a route not here answers 200 with an empty body, as SGLang's /abort_request does
    "/generate": GENERATE,
    "/update_weights_from_disk": {**DONE, "num_paused_requests": 0},
    "/init_weights_update_group": DONE,
    "/update_weights_from_distributed": DONE,
    "/update_weights_from_tensor": DONE,
    "/destroy_weights_update_group": DONE,
    "/pause_generation": PAUSED,
    "/continue_generation": PAUSED,
    "/load_lora_adapter": {"success": True, "error_message": "", "loaded_adapters": {}},  # names: any keys
    "/unload_lora_adapter": {"success": True, "error_message": "", "loaded_adapters": {}},
    "/update_weight_version": {"success": True, "message": "", "new_version": "3"},
    "/model_info": {"model_path": "/m", "is_generation": True, "weight_version": "3"},
}


def client_calls(params: dict) -> dict[str, Callable[[GenClient], Any]]:
    """Every call the client makes, by route."""
    return {
        "/generate": lambda c: c.generate([1, 2, 3], {**params, "sampling_seed": 7}, rid="r1"),
        "/abort_request": lambda c: c.abort_request("r1"),
        "/pause_generation": lambda c: c.pause_generation("in_place"),
        "/continue_generation": lambda c: c.continue_generation(),
        "/update_weights_from_disk": lambda c: c.update_weights_from_disk(
            "/shared/weights/v3", weight_version=3, abort_all_requests=False
        ),
        "/init_weights_update_group": lambda c: c.init_weights_update_group(
            "10.0.0.1", 29500, 1, 3, "g", "nccl", group_timeout=60
        ),
        "/update_weights_from_distributed": lambda c: c.update_weights_from_distributed(
            ["w"], ["bfloat16"], [[2, 2]], "g", weight_version=3, load_format="flattened_bucket"
        ),
        "/update_weights_from_tensor": lambda c: c.update_weights_from_tensor(["gAU="], weight_version=3),
        "/destroy_weights_update_group": lambda c: c.destroy_weights_update_group("g"),
        "/release_memory_occupation": lambda c: c.release_memory_occupation(),
        "/resume_memory_occupation": lambda c: c.resume_memory_occupation(["weights"]),
        "/load_lora_adapter": lambda c: c.load_lora_adapter("policy-v3", "/shared/weights/adapter-v3"),
        "/unload_lora_adapter": lambda c: c.unload_lora_adapter("policy-v2"),
        "/update_weight_version": lambda c: c.update_weight_version(3, abort_all_requests=True),
    }


def sent_bodies(calls: dict[str, Callable[[GenClient], Any]] | None = None, **client) -> dict[str, dict]:
    """The body of every call the client makes (or of `calls`, by a GenClient of `client` options), as a
    server receives it."""
    bodies: dict[str, dict] = {}

    class Capture(BaseHTTPRequestHandler):
        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            bodies[self.path] = json.loads(raw) if raw else {}
            reply = REPLIES.get(self.path)
            data = json.dumps(reply).encode() if reply is not None else b""
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        c = GenClient(f"http://127.0.0.1:{httpd.server_address[1]}", "key", **client)
        if calls is None:
            calls = client_calls(sampling_params(load_config([REPO / "configs/qwen3-1.7b-8gpu.yaml"])))
        for call in calls.values():
            call(c)
    finally:
        httpd.shutdown()
    return bodies


def test_every_body_the_client_sends_builds_the_request_sglang_takes_there():
    routes, bodies = request_classes(), sent_bodies()
    assert len(bodies) == 14
    for route, body in bodies.items():
        fields = class_fields(routes[route])
        unknown = set(body) - set(fields) - OURS.get(route, set())
        missing = {f for f, required in fields.items() if required} - set(body)
        assert not unknown and not missing, (route, routes[route], unknown, missing)
    assert isinstance(bodies["/update_weights_from_distributed"]["weight_version"], str)  # str there, not int


def test_a_request_of_a_lora_run_names_the_adapter_of_its_servers_version_in_generates_own_field():
    answers = []
    bodies = sent_bodies({"/generate": lambda c: answers.extend(c.generate([1, 2, 3], {"max_new_tokens": 2}))},
                         adapters=True)  # fmt: skip
    assert bodies["/generate"]["lora_path"] == "policy-v3"  # /model_info said version 3
    assert "lora_path" in class_fields(request_classes()["/generate"])
    assert answers[0]["meta_info"]["weight_version"] == "3"  # labelled with the adapter it ran on


def test_lora_servers_launch_with_sglang_s_own_flags_and_module_names():
    from areal_hpc.config import server_targets

    cfg = load_config([REPO / "configs" / f for f in ("qwen3-1.7b-8gpu.yaml", "qwen2.5-7b-1gpu-lora.yaml")])
    supported = next(
        ast.literal_eval(node.value)
        for node in tree("utils/common.py").body
        if isinstance(node, ast.Assign)
        and getattr(node.targets[0], "id", "") == "SUPPORTED_LORA_TARGET_MODULES"
    )
    assert server_targets(cfg) and set(server_targets(cfg)) <= set(supported)
    assert {"--enable-lora", "--max-lora-rank", "--lora-target-modules"} <= cli_flags()
    # SGLang asks for both when it starts with no adapter (server_args.py's check_lora_server_args)
    assert "max_lora_rank and self.lora_target_modules" in (SRC / "server_args.py").read_text()


def test_response_format_reaches_sglang_as_its_own_sampling_parameter_json_schema():
    """The endpoint sends a response_format's schema as json_schema, SGLang's grammar of /generate (its chat
    route maps json_object to '{"type": "object"}' as the endpoint does)."""
    assert "json_schema" in sampling_param_names()
    source = (SRC / "entrypoints/openai/protocol.py").read_text()
    assert """sampling_params["json_schema"] = '{"type": "object"}'""" in source


def test_every_sampling_parameter_we_send_is_one_sglang_takes_and_no_seed_is_relied_on():
    recipe = REPO / "configs/qwen3-1.7b-8gpu.yaml"  # SGLang's servers
    sglang_cfg = load_config([recipe])
    sglang = group_params(sglang_cfg, "q1", 0)
    assert set(sglang) <= sampling_param_names(), sorted(set(sglang) - sampling_param_names())
    # SGLang ignores sampling_seed unless deterministic, and then gives all n answers the same one.
    assert "sampling_seed" not in sglang
    builtin = group_params(load_config([recipe], ["allocation_mode=builtin.d4p1m1+d2p2m1"]), "q1", 0)
    assert builtin == {**sglang, "sampling_seed": builtin["sampling_seed"]}  # seeded where each answer is


def class_default(name: str, field: str) -> Any:
    """The default of ``field`` of io_struct class ``name`` (its own or a base's), a literal."""
    classes = {n.name: n for n in tree("managers/io_struct.py").body if isinstance(n, ast.ClassDef)}
    stack = [classes[name]]
    while stack:
        cls = stack.pop()
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and getattr(stmt.target, "id", None) == field:
                return ast.literal_eval(stmt.value)
        stack += [classes[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in classes]
    raise KeyError(f"{name} has no field {field}")


def test_the_builtin_servers_weight_updates_default_to_sglangs_abort_all_requests():
    from areal_hpc.gen.backends.builtin.server import ABORT_ALL_DEFAULT

    routes = request_classes()
    for kind in ("disk", "distributed", "tensor"):
        route = f"/update_weights_from_{kind}"
        assert class_default(routes[route], "abort_all_requests") is ABORT_ALL_DEFAULT, route


def test_both_servers_report_their_context_length_in_server_info(builtin_client):
    # SGLang's /server_info spreads its ServerArgs, context_length among them (null unless launched with it).
    named = lambda file, name: [n for n in tree(file).body if getattr(n, "name", "") == name]  # noqa: E731
    (handler,) = named("entrypoints/http_server.py", "server_info")
    assert "**dataclasses.asdict(_global_state.tokenizer_manager.server_args)" in ast.unparse(handler)
    (args,) = named("server_args.py", "ServerArgs")
    assert "context_length: Optional[int] = None" in ast.unparse(args)
    assert builtin_client.context_length() == 2048  # the tiny model's


# --- routing replay (issue 33): what we ask SGLang for, and how it answers ----------------------------------


def routing_config(tiny_moe_dir, *overrides: str):
    """The shipped SGLang recipe on the tiny MoE, servers of tensor size 2, routing replay on."""
    # Answers the tiny model's context (2048) holds.
    layout = [
        "allocation_mode=sglang.d2p1m2+d2p2m1",
        f"actor.path={tiny_moe_dir}",
        "ppo.gen.max_new_tokens=1000",
    ]
    cfg = load_config([REPO / "configs/qwen3-1.7b-8gpu.yaml"], [*layout, *overrides])
    # No trainer backend replays the routing yet, so validation refuses rollout; the servers' side runs without it.
    return replace(cfg, actor=replace(cfg.actor, router_replay="rollout"))


def test_routing_replay_and_expert_parallel_servers_launch_with_sglang_s_own_flags(tiny_moe_dir):
    from tests.test_sglang_launch import commands

    (line, _) = commands(routing_config(tiny_moe_dir, "sglang.ep_size=2"), 8).splitlines()
    flags = line.split()
    assert "--enable-return-routed-experts" in flags and flags[flags.index("--ep-size") + 1] == "2"
    assert {f for f in flags if f.startswith("--")} - {"--token-file"} <= cli_flags()
    switches = {  # a flag that takes no value: store_true there
        node.args[0].value
        for node in ast.walk(tree("server_args.py"))
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", "") == "add_argument"
        and any(k.arg == "action" and getattr(k.value, "value", "") == "store_true" for k in node.keywords)
    }
    assert "--enable-return-routed-experts" in switches
    off = commands(
        load_config(
            [REPO / "configs/qwen3-1.7b-8gpu.yaml"],
            [f"actor.path={tiny_moe_dir}", "ppo.gen.max_new_tokens=1000"],
        ),
        4,
    )
    assert (
        "--enable-return-routed-experts" not in off and "--ep-size" not in off
    )  # the golden files' commands


def test_ep_size_must_divide_the_servers_tensor_size_as_sglang_s_model_runner_requires(tiny_moe_dir):
    runner = (SRC / "model_executor/model_runner.py").read_text()
    assert "if self.tp_size % self.moe_ep_size != 0:" in runner  # SGLang's rule, and ours:
    with pytest.raises(
        ConfigError, match="'sglang.ep_size' 3 must divide the generation servers' tensor size 2"
    ):
        routing_config(tiny_moe_dir, "sglang.ep_size=3")
    with pytest.raises(ConfigError, match="'sglang.ep_size' 16 does not divide the 8 experts"):
        routing_config(tiny_moe_dir, "sglang.ep_size=16")  # and 16 does not divide 2 either


def test_a_routing_request_asks_with_generate_s_own_field_and_sglang_s_sampling_parameters(tiny_moe_dir):
    params = group_params(routing_config(tiny_moe_dir), "q1", 0)
    (body,) = sent_bodies({"/generate": lambda c: c.generate([1, 2, 3], params)}).values()
    assert body["return_routed_experts"] is True
    fields = class_fields(request_classes()["/generate"])
    assert set(body) <= set(fields) and "return_routed_experts" in fields
    assert set(body["sampling_params"]) <= sampling_param_names()  # our shape of the routing stays here


def test_sglang_answers_the_routing_of_every_forwarded_token_as_base64_int32_tokens_by_layers_by_top_k():
    manager = ast.unparse(tree("managers/tokenizer_manager.py"))
    # Each answer of a list (n > 1, a batch) gets its own request's routing, as the bytes of its tensor.
    assert "routed_experts_tensor = recv_obj.routed_experts[i]" in manager
    assert (
        "meta_info['routed_experts'] = pybase64.b64encode(routed_experts_tensor.numpy().tobytes())" in manager
    )
    capturer = ast.unparse(tree("layers/moe/routed_experts_capturer.py"))
    # The host buffer holds int32 [tokens, layers, top_k], layers and top_k the (text) config's, like ours.
    assert "torch.zeros((num_tokens, num_hidden_layers, num_experts_per_tok), dtype=torch.int32" in capturer
    assert "self.num_hidden_layers = model_config.hf_text_config.num_hidden_layers" in capturer
    assert "self.num_experts_per_tok = model_config.hf_text_config.num_experts_per_tok" in capturer
    # A request's rows: every token of its sequence but the last, which no forward took.
    assert "req_to_token_pool.req_to_token[req_pool_idx][:seqlen - 1]" in capturer
