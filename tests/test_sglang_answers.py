"""What we read from SGLang's answers, checked against SGLang's own source (read as text, as
tests/test_sglang_contract.py reads it): every field the client, from_response and the rest read from an answer
is one SGLang builds there, in the shape it builds it; the fake server of the contract test and the built-in
server answer only with such fields; and an SGLang altered to rename or retype one of them fails the check."""

from __future__ import annotations

import ast
import functools
from contextlib import suppress
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest

from areal_hpc.gen.backends.builtin.protocol import format_output
from areal_hpc.gen.client import GenClient, GenServerError
from areal_hpc.gen.partial import ABORT, from_response
from tests.test_sglang_contract import GENERATE, REPLIES, REPO, SRC, client_calls, tree

pytestmark = pytest.mark.skipif(not SRC.is_dir(), reason=f"{SRC} missing: `make test` unpacks sglang there")

# --- what we read from SGLang's answers -------------------------------------------------------------------
# A path into a JSON answer: its keys, "*" for any item of a list, a position within an item that is itself a
# list (SGLang's tuples, such as the output_token_logprobs entries (logprob, token_id, text or None)).

# Read outside the client and from_response, so listed here: rollout.py, eval/heldout.py and eval/evaluator.py
# read text, output_ids and completion_tokens; tools/gpu_check_weights.py the weight version and finish type.
OTHER_READS = {
    "/generate": {
        ("text",),
        ("output_ids",),
        ("meta_info", "completion_tokens"),
        ("meta_info", "weight_version"),
        ("meta_info", "finish_reason", "type"),
    },
    "/model_info": {("weight_version",)},
}
# The finish reasons partial.py tells apart: abort (continued), stop, length (truncated).
FINISH_TYPES = {ABORT, "stop", "length"}
# Ours, and said so: the built-in server also answers a weight update with the version it serves now (its own
# tests read it). SGLang does not, so nothing else may read it: contract_breaks() would report it.
BUILTIN_OWN = {
    "/update_weights_from_disk": {"weight_version"},
    "/update_weights_from_distributed": {"weight_version"},
    "/update_weights_from_tensor": {"weight_version"},
}
# The files of SGLang's source the checks below read.
ANSWER_SOURCES = [
    "managers/tokenizer_manager.py",
    "managers/tokenizer_communicator_mixin.py",
    "managers/schedule_batch.py",
    "managers/io_struct.py",
    "entrypoints/http_server.py",
    "server_args.py",
]


class Probe(dict):
    """A JSON object that records the path of every field read from it, nested objects and lists included."""

    def __init__(self, value: dict, reads: set, path: tuple = ()):
        super().__init__(value)
        self.reads, self.path = reads, path

    def __getitem__(self, key):
        return self._read(key, super().__getitem__(key))

    def get(self, key, default=None):
        return self._read(key, super().get(key, default))

    def __contains__(self, key):  # `"text" in answer` tells the client whether to decode output_ids
        self.reads.add((*self.path, key))
        return super().__contains__(key)

    def _read(self, key, value):
        self.reads.add((*self.path, key))
        return probe(value, self.reads, (*self.path, key))


class ProbeList(list):
    """A JSON list whose items record their reads under "*", and whose positions are recorded when indexed."""

    def __init__(self, value: list, reads: set, path: tuple):
        super().__init__(value)
        self.reads, self.path = reads, path

    def __iter__(self):
        return (probe(item, self.reads, (*self.path, "*")) for item in super().__iter__())

    def __getitem__(self, i):
        self.reads.add((*self.path, i))
        return probe(super().__getitem__(i), self.reads, (*self.path, i))


def probe(value, reads: set, path: tuple = ()):
    if isinstance(value, dict):
        return Probe(value, reads, path)
    return ProbeList(value, reads, path) if isinstance(value, list) else value


def client_reads() -> dict[str, set[tuple]]:
    """Route -> the paths the client reads from its answers (and from_response from /generate's), recorded
    while each call gets the fake server's answer, and a failure where the answer says `success`."""
    reads: dict[str, set[tuple]] = {}
    decoder = SimpleNamespace(decode=lambda ids, skip_special_tokens: "")  # answers carry no text: decoded
    client = GenClient("http://unused", None, tokenizer=decoder)
    for route, call in client_calls({"max_new_tokens": 2}).items():
        reads[route], reply = set(), REPLIES.get(route)
        failed = {**reply, "success": False} if reply and "success" in reply else None
        for answer in (reply, failed) if failed else (reply,):
            client._call = lambda *args, answer=answer, seen=reads[route]: probe(answer, seen)
            with suppress(GenServerError):
                result = call(client)
                if route == "/generate":
                    for response in result:
                        from_response(response)
    return reads


@functools.cache  # the same for every source checked against
def all_reads() -> dict[str, set[tuple]]:
    reads = client_reads()
    for route, paths in OTHER_READS.items():
        reads[route] = reads.get(route, set()) | paths
    return reads


# --- what SGLang answers, from its source -----------------------------------------------------------------


def dict_paths(node: ast.Dict, prefix: tuple = ()) -> set[tuple]:
    """The key paths of a dict literal, those of dict literals nested in it included."""
    paths = set()
    for key, value in zip(node.keys, node.values, strict=True):
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            paths.add((*prefix, key.value))
            if isinstance(value, ast.Dict):
                paths |= dict_paths(value, (*prefix, key.value))
    return paths


def outer_dicts(node: ast.AST) -> list[ast.Dict]:
    """The dict literals in `node` that are no value of another one (dict_paths covers those)."""
    dicts = [d for d in ast.walk(node) if isinstance(d, ast.Dict)]
    inner = {id(v) for d in dicts for v in d.values if isinstance(v, ast.Dict)}
    return [d for d in dicts if id(d) not in inner]


def is_meta_info(node: ast.AST) -> bool:
    """`meta_info`, or `out["meta_info"]`: how TokenizerManager names the meta_info of an answer."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "meta_info"
    return isinstance(node, ast.Name) and node.id == "meta_info"


def meta_info_fields(module: ast.Module) -> dict[str, set[str]]:
    """Key -> the expressions TokenizerManager gives it in meta_info: `meta_info = {...}`,
    `meta_info[key] = ...` and `meta_info.update({...})`."""
    fields: dict[str, set[str]] = {}

    def add(keys, values):
        for key, value in zip(keys, values, strict=True):
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                fields.setdefault(key.value, set()).add(ast.unparse(value))

    for node in ast.walk(module):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if is_meta_info(target) and isinstance(node.value, ast.Dict):
                    add(node.value.keys, node.value.values)
                elif isinstance(target, ast.Subscript) and is_meta_info(target.value):
                    add([target.slice], [node.value])
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
        ):
            (arg,) = node.args or [None]
            if is_meta_info(node.func.value) and isinstance(arg, ast.Dict):
                add(arg.keys, arg.values)
    return fields


def finish_reasons(*modules: ast.Module) -> dict[str, set[str]]:
    """finish_reason type -> its keys, from every dict literal whose "type" is a string constant
    (SGLang: the to_json of schedule_batch.py's FINISH_* classes, and TokenizerManager._handle_abort_req)."""
    shapes: dict[str, set[str]] = {}
    for node in (n for m in modules for n in ast.walk(m) if isinstance(n, ast.Dict)):
        literal = {
            k.value: v for k, v in zip(node.keys, node.values, strict=True) if isinstance(k, ast.Constant)
        }
        kind = literal.get("type")
        if isinstance(kind, ast.Constant) and isinstance(kind.value, str):
            shapes.setdefault(kind.value, set()).update(literal)
    return shapes


def sglang_finish_reasons(root: Path = SRC) -> dict[str, set[str]]:
    return finish_reasons(
        tree("managers/schedule_batch.py", root), tree("managers/tokenizer_manager.py", root)
    )


def function(module: ast.Module, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    (fn,) = [
        n
        for n in ast.walk(module)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
    ]
    return fn


def logprob_entries(root: Path = SRC) -> list[tuple[str, ...]]:
    """Each way TokenizerManager.detokenize_logprob_tokens builds an output_token_logprobs entry, as the type
    of each position: a tuple zipped from its parameters (typed List[float] and List[int]) resolves to their
    item types; anything else stays as written (None, token_texts)."""
    fn = function(tree("managers/tokenizer_manager.py", root), "detokenize_logprob_tokens")
    item_type = {
        a.arg: ast.unparse(a.annotation.slice)
        for a in fn.args.args
        if isinstance(a.annotation, ast.Subscript)
    }
    entries, comprehended = [], set()
    for comp in ast.walk(fn):
        if isinstance(comp, ast.ListComp | ast.GeneratorExp) and isinstance(comp.elt, ast.Tuple):
            loop = comp.generators[0]  # `for logprob, token_id in zip(token_logprobs_val, ...)`
            source = dict(zip((ast.unparse(t) for t in loop.target.elts), loop.iter.args, strict=False))
            entries.append([source.get(ast.unparse(e), e) for e in comp.elt.elts])
            comprehended.add(id(loop.iter))
    entries += [
        call.args
        for call in ast.walk(fn)
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "zip" and id(call) not in comprehended
    ]
    return [tuple(item_type.get(ast.unparse(e), ast.unparse(e)) for e in entry) for entry in entries]


def generate_answer(root: Path = SRC) -> set[tuple]:
    """The paths of a /generate answer object, as TokenizerManager builds it (_handle_batch_output, and
    _handle_abort_req for a request aborted while queued); n > 1 or a batch answers a list of them."""
    module = tree("managers/tokenizer_manager.py", root)
    paths = set().union(*(dict_paths(d) for d in outer_dicts(module) if ("meta_info",) in dict_paths(d)))
    meta = meta_info_fields(module)
    paths |= {("meta_info", key) for key in meta}
    if "finish_reason" in meta:
        paths |= {
            ("meta_info", "finish_reason", k) for keys in sglang_finish_reasons(root).values() for k in keys
        }
    if "output_token_logprobs" in meta:
        paths |= {
            ("meta_info", "output_token_logprobs", "*", i)
            for e in logprob_entries(root)
            for i in range(len(e))
        }
    return paths


def served_routes(fn: ast.AsyncFunctionDef | ast.FunctionDef) -> list[str]:
    """The paths of its @app.get, @app.post and @app.api_route decorators."""
    return [
        deco.args[0].value
        for deco in fn.decorator_list
        if isinstance(deco, ast.Call)
        and getattr(deco.func, "attr", "") in ("get", "post", "api_route")
        and isinstance(deco.args[0], ast.Constant)
    ]


def route_answers(root: Path = SRC) -> dict[str, set[tuple]]:
    """Route -> the paths of the dict literals its handler in http_server.py answers with."""
    answers: dict[str, set[tuple]] = {}
    for node in tree("entrypoints/http_server.py", root).body:
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        paths = set().union(*(dict_paths(d) for d in outer_dicts(node)))
        for route in served_routes(node):
            answers[route] = paths
    return answers


def output_answers(root: Path = SRC) -> dict[str, set[tuple]]:
    """Route -> the fields of the io_struct output its handler answers with: `result = await
    _global_state.tokenizer_manager.<method>(...)` answered as `ORJSONResponse(result, ...)` (the LoRA
    routes), <method>'s return annotation resolved through io_struct's aliases to a class."""
    methods = {
        n.name: ast.unparse(n.returns)
        for module in ("managers/tokenizer_manager.py", "managers/tokenizer_communicator_mixin.py")
        for n in ast.walk(tree(module, root))
        if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef) and n.returns is not None
    }
    io = tree("managers/io_struct.py", root)
    aliases = {t.id: ast.unparse(n.value) for n in io.body if isinstance(n, ast.Assign) for t in n.targets
               if isinstance(t, ast.Name) and isinstance(n.value, ast.Name)}  # fmt: skip
    classes = {n.name: n for n in io.body if isinstance(n, ast.ClassDef)}
    answers = {}
    for node in tree("entrypoints/http_server.py", root).body:
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        calls = [
            n.value.value.func.attr for n in ast.walk(node) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Await)
            and isinstance(n.value.value, ast.Call) and isinstance(n.value.value.func, ast.Attribute)
            and ast.unparse(n.value.value.func.value) == "_global_state.tokenizer_manager"
        ]  # fmt: skip
        answered = any(
            isinstance(n, ast.Call) and ast.unparse(n.func) == "ORJSONResponse" and n.args
            and ast.unparse(n.args[0]) == "result" for n in ast.walk(node)
        )  # fmt: skip
        kind = (
            aliases.get(methods.get(calls[0], ""), methods.get(calls[0], "")) if calls and answered else None
        )
        if kind in classes:
            fields, stack = set(), [classes[kind]]
            while stack:
                cls = stack.pop()
                stack += [classes[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in classes]
                fields |= {(st.target.id,) for st in cls.body if isinstance(st, ast.AnnAssign)}
            for route in served_routes(node):
                answers[route] = fields
    return answers


def sglang_answers(root: Path = SRC) -> dict[str, set[tuple]]:
    """Route -> the paths of its answer (/generate's handler passes on what TokenizerManager builds; the
    LoRA routes answer with an io_struct output)."""
    return {**route_answers(root), **output_answers(root), "/generate": generate_answer(root)}


def weight_version_types(root: Path = SRC) -> set[str]:
    """The types of meta_info's weight_version: TokenizerManager gives it a ServerArgs field, typed there."""
    (cls,) = [
        n for n in tree("server_args.py", root).body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs"
    ]
    types = {
        s.target.id: ast.unparse(s.annotation)
        for s in cls.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
    }
    values = meta_info_fields(tree("managers/tokenizer_manager.py", root)).get("weight_version", set())
    return {types.get(v.removeprefix("self.server_args."), v) for v in values}


def contract_breaks(root: Path = SRC) -> set[str]:
    """What we read from SGLang's answers that the source at `root` does not produce, or not as we read it."""
    answers = sglang_answers(root)
    breaks = {
        f"{route} {'.'.join(map(str, path))}"
        for route, paths in all_reads().items()
        for path in paths - answers.get(route, set())
    }
    breaks |= {f"finish_reason type {t}" for t in FINISH_TYPES - set(sglang_finish_reasons(root))}
    # from_response takes an entry's first item for the logprob: (float logprob, int token id, text or None)
    breaks |= {f"output_token_logprobs entry {e}" for e in logprob_entries(root) if e[:2] != ("float", "int")}
    # A string: what the fake and built-in servers answer with, and version_of's "default" is one.
    breaks |= {f"weight_version typed {t}, not str" for t in weight_version_types(root) - {"str"}}
    return breaks


# --- answers that claim to be SGLang's ----------------------------------------------------------------------


def json_paths(value, path: tuple = ()) -> set[tuple]:
    """The paths of a JSON answer, as Probe records them."""
    paths = set()
    if isinstance(value, dict):
        for key, item in value.items():
            paths |= {(*path, key)} | json_paths(item, (*path, key))
    elif isinstance(value, list):
        for item in value:
            inner = {(*path, "*", i) for i in range(len(item))} if isinstance(item, list) else set()
            paths |= inner or json_paths(item, (*path, "*"))
    return paths


def unlike_sglang(answer: dict) -> set[str]:
    """How a /generate answer object differs from those SGLang builds: fields it has not, a finish reason of
    another shape, logprob entries not (float, int, text or None), a weight_version not a string."""
    meta, reasons = answer["meta_info"], sglang_finish_reasons()
    unlike = {f"field {p}" for p in json_paths(answer) - generate_answer()}
    reason = meta["finish_reason"]
    if not set(reason) <= reasons.get(reason["type"], set()):
        unlike.add(f"finish_reason {reason}, SGLang's: {reasons}")
    for entry in meta.get("output_token_logprobs", []):
        if not (
            isinstance(entry[0], float) and isinstance(entry[1], int) and isinstance(entry[2], str | None)
        ):
            unlike.add(f"output_token_logprobs entry {entry}")
    if not isinstance(meta["weight_version"], str):
        unlike.add(f"weight_version {meta['weight_version']!r}")
    return unlike


def builtin_replies() -> dict[str, set[tuple]]:
    """Route -> the paths of what the built-in server's handler (App's method of the route's name) returns."""
    module = ast.parse((REPO / "areal_hpc/gen/backends/builtin/server.py").read_text())
    replies = {}
    for route in ["/model_info", *(r for r in REPLIES if "weight" in r)]:
        returned = [
            r.value for r in ast.walk(function(module, route[1:])) if isinstance(r, ast.Return) and r.value
        ]
        replies[route] = set().union(*(dict_paths(d) for value in returned for d in outer_dicts(value)))
    return replies


def altered(tmp_path: Path, relative: str, old: str, new: str) -> Path:
    """A copy of the SGLang files the checks read, with `old` replaced by `new` in one of them."""
    for name in ANSWER_SOURCES:
        text = (SRC / name).read_text()
        if name == relative:
            assert old in text, (relative, old)
            text = text.replace(old, new)
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_every_field_we_read_from_sglang_answers_is_one_its_source_produces():
    reads = all_reads()
    # What the probe saw the client and from_response read (so that a read dropped by mistake shows here).
    assert {
        ("output_ids",),
        ("text",),
        ("meta_info", "finish_reason", "type"),
        ("meta_info", "weight_version"),
        ("meta_info", "cached_tokens"),
        ("meta_info", "output_token_logprobs"),
        ("meta_info", "output_token_logprobs", "*", 0),
    } <= reads["/generate"]
    assert reads["/update_weights_from_disk"] == {("success",), ("message",)}
    assert contract_breaks() == set()


def test_the_fake_server_answers_only_with_what_sglang_produces_there():
    answers = sglang_answers()
    for route, reply in REPLIES.items():
        assert json_paths(reply) <= answers[route], (route, json_paths(reply) - answers[route])
    assert unlike_sglang(GENERATE) == set()


def test_the_builtin_server_answers_as_sglang_does():
    out = SimpleNamespace(
        rid="r1", output_ids=[5, 2], logprobs=[-0.5, -0.25], finish_reason={"type": "stop", "matched": 2},
        prompt_tokens=3, cached_tokens=2, weight_version="0", latency=0.1, skip_special_tokens=True,
    )  # fmt: skip
    for return_text in (True, False):  # as it goes on the wire (the server's orjson)
        answer = orjson.loads(orjson.dumps(format_output(out, lambda ids, skip: "ab", True, return_text)))
        assert unlike_sglang(answer) == set()
        assert ("meta_info", "output_token_logprobs", "*", 2) in json_paths(answer)
    # Every finish reason the engine gives a row has a type SGLang has, and only keys SGLang's has.
    ours = finish_reasons(ast.parse((REPO / "areal_hpc/gen/backends/builtin/scheduler.py").read_text()))
    theirs = sglang_finish_reasons()
    assert set(ours) == FINISH_TYPES and all(ours[t] <= theirs[t] for t in ours), (ours, theirs)
    answers = sglang_answers()
    for route, paths in builtin_replies().items():
        own = {(key,) for key in BUILTIN_OWN.get(route, ())}
        assert paths and paths - own <= answers[route], (route, paths - own - answers[route])


TM, HTTP = "managers/tokenizer_manager.py", "entrypoints/http_server.py"


@pytest.mark.parametrize(
    "relative, old, new, broken",
    [
        # from_response would take every answer for version 0 (a missing weight_version), without a word
        pytest.param(TM, '"weight_version"', '"weights_version"', {"/generate meta_info.weight_version"},
                     id="weight_version renamed"),
        pytest.param("server_args.py", 'weight_version: str = "default"', "weight_version: int = 0",
                     {"weight_version typed int, not str"}, id="weight_version retyped"),
        # every behaviour logprob we train on would be a token id
        pytest.param(TM, "(logprob, token_id, None)", "(token_id, logprob, None)",
                     {"output_token_logprobs entry ('int', 'float', 'None')"}, id="logprob entry reordered"),
        pytest.param(TM, 'meta_info["output_token_logprobs"]', 'meta_info["output_logprobs"]',
                     {"/generate meta_info.output_token_logprobs",
                      "/generate meta_info.output_token_logprobs.*.0"},
                     id="output_token_logprobs renamed"),
        pytest.param(TM, '"output_ids": ', '"token_ids": ', {"/generate output_ids"},
                     id="output_ids renamed"),
        pytest.param("managers/schedule_batch.py", '"type": "length"', '"type": "max_tokens"',
                     {"finish_reason type length"}, id="finish type length renamed"),
        pytest.param(HTTP, 'content = {"success": success, "message": message}',
                     'content = {"ok": success, "message": message}',
                     {"/init_weights_update_group success", "/update_weights_from_distributed success",
                      "/update_weights_from_tensor success", "/destroy_weights_update_group success"},
                     id="success renamed in the group routes"),
        pytest.param("managers/io_struct.py", "    error_message: Optional[str] = None\n    loaded_adapters",
                     "    error: Optional[str] = None\n    loaded_adapters",
                     {"/load_lora_adapter error_message", "/unload_lora_adapter error_message"},
                     id="error_message renamed in the LoRA routes"),
    ],
)  # fmt: skip
def test_sglang_altered_where_it_builds_an_answer_fails_the_check(tmp_path, relative, old, new, broken):
    assert contract_breaks(altered(tmp_path, relative, old, new)) == broken
