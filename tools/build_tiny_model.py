"""Build the tiny model, its tokenizer and the toy data, offline, in seconds, deterministically from a seed.

Output layout (``--out``, default ``.cache/tiny``)::

    OUT/model/config.json             tiny Qwen2ForCausalLM (random init from the seed), safetensors weights
    OUT/model/generation_config.json
    OUT/model/model.safetensors
    OUT/model/tokenizer.json          byte-level BPE trained here, Qwen2 pre-tokenization (one digit per token)
    OUT/model/tokenizer_config.json   PreTrainedTokenizerFast, Qwen chat template, eos <|im_end|>,
                                      pad <|endoftext|>
    OUT/moe/                          tiny Qwen3MoeForCausalLM (8 experts, top 2; random init from the seed) with
                                      the tokenizer and generation config of OUT/model; safetensors, experts
                                      per expert on disk (model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight)
    OUT/data/train.jsonl              toy arithmetic questions (tools/make_toy_data.py)
    OUT/data/test.jsonl               held-out questions, disjoint from train
    OUT/data/easy/{train,test}.jsonl  every single-digit question, split (the CPU demo's data)
    OUT/data/code/{train,test}.jsonl  toy code tasks that all ask for a sum (tools/make_toy_code_data.py;
                                      configs/toy-code.yaml)
    OUT/data/tools/{train,test}.jsonl products to compute with a calculator tool, with the tool-call transcript
                                      a warm-up learns (tools/make_toy_tool_data.py)
    OUT/MANIFEST.json                 seed, build parameters, builder fingerprint (hash of this code and
                                      the library versions), size and sha256 of every file above

``OUT/model`` and ``OUT/moe`` are ordinary Hugging Face directories: ``AutoTokenizer.from_pretrained`` and
``AutoModelForCausalLM.from_pretrained`` both load them.

Everything is built in a temporary sibling directory, the manifest is written last, and the directory is then
renamed to OUT, so a crash never leaves a half-built OUT. A build whose OUT already holds an intact build of
the same seed, parameters and fingerprint does nothing; any other build of ours there is replaced; a directory
without our manifest is never touched. The same seed gives a byte-identical tokenizer.json and equal weights.

Usage::

    python tools/build_tiny_model.py --out .cache/tiny --seed 1
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

if __package__ in (None, ""):  # run as a script: make the `tools` namespace importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.make_toy_code_data import write_code_data  # noqa: E402
from tools.make_toy_data import make_easy_splits, make_toy_splits, write_jsonl  # noqa: E402
from tools.make_toy_tool_data import write_tool_data  # noqa: E402

MANIFEST = "MANIFEST.json"
MODEL_DIRS = ("model", "moe")

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# Qwen2's pre-tokenizer split: contractions, words, ONE digit at a time, punctuation runs, newlines, spaces.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen's ChatML template without a default system prompt; the generation prompt opens the assistant turn.
# Tool use renders as Qwen2.5's and Qwen3's templates do: an assistant's calls follow its content, each a
# <tool_call> block of JSON (arguments given as a string are printed as they are); tool results come back in
# one user turn, a <tool_response> block each. Unlike Qwen's, the system header that `tools` adds only NAMES
# the tools: Qwen prints every JSON schema and a paragraph of instructions there, hundreds of tokens of text
# the 1,024-token BPE never saw, paid on every step of a CPU toy by a model that learns the calls from its
# warm-up transcripts anyway. Without tools and tool calls, a conversation renders byte for byte as the plain
# ChatML template did (the pinned stats depend on it).
# Unformatted: the formatter would requote the lines that hold JSON's double quotes.
# fmt: off
CHAT_TEMPLATE = (
    "{% set header = tools and messages and messages[0]['role'] == 'system' %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if header %}{{ messages[0]['content'] + '\\n' }}{% endif %}"
    "{{ 'Tools: ' }}"
    "{% for tool in tools %}"
    "{{ (', ' if not loop.first else '') + (tool.function.name if tool.function is defined else tool.name) }}"
    "{% endfor %}"
    "{{ '. Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and header %}"  # already in the tools header
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{% for call in message.tool_calls %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "{{ ('\\n' if message.content or not loop.first else '') + '<tool_call>\\n{\"name\": \"' + fn.name }}"
    "{{ '\", \"arguments\": ' + (fn.arguments if fn.arguments is string else fn.arguments | tojson) }}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# fmt: on

DEFAULT_PARAMS: dict = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "n_train": 1000,
    "n_test": 100,
    "n_easy_test": 50,
    "n_code_train": 256,
    "n_code_test": 32,
    "n_tool_train": 1000,
    "n_tool_test": 64,
}

# The tiny mixture of experts (OUT/moe): the dense model's vocabulary, attention and context; every layer sparse.
MOE_PARAMS: dict = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,  # of dense layers: none here (mlp_only_layers empty, decoder_sparse_step 1)
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "max_position_embeddings": 2048,
}


class TinyBuildError(ValueError):
    """The output directory cannot be used for a tiny build."""


@dataclass(frozen=True)
class TinyBuild:
    """Paths of one complete build."""

    root: Path

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def moe_dir(self) -> Path:
        return self.root / "moe"

    @property
    def train_path(self) -> Path:
        return self.root / "data" / "train.jsonl"

    @property
    def test_path(self) -> Path:
        return self.root / "data" / "test.jsonl"


# ---------------------------------------------------------------------------------------------------------
# Tokenizer corpus: toy questions and answers, English-ish sentences, LaTeX-ish snippets.

_WORD_TEXT = (
    "the a an of to and in is it that for on with as be this are by we at from or which can not if then so "
    "but all each one two three four five six seven eight nine ten number numbers sum difference product "
    "answer question problem step steps reason think let us first next finally therefore thus since because "
    "value values equal equals result total add subtract multiply divide times plus minus more less than "
    "find compute calculate solve check write put final within box boxed please careful simple example "
    "integer integers positive negative even odd prime square root fraction ratio percent area length "
    "triangle circle angle side point line function variable expression equation solution given known "
    "assume suppose notice note how many what when where who why now here there after before again also "
    "count carry digit digits left right top bottom half double triple twice once zero hundred thousand "
    "people water money time year day week hour minute apple apples book books student students teacher "
    "class school price cost buy sell paid spent left over remaining share shared among between every per "
    "average speed distance rate work together alone pattern sequence term terms series graph table list "
    "largest smallest greatest least maximum minimum probability chance random choose pick order ways "
    "coin coins dice card cards red blue green white black small large long short new old same different "
    "number line clock calendar measure meter meters kilogram liter degrees interest"
)
_WORDS = _WORD_TEXT.split()
_LATEX = (
    "\\boxed{",
    "\\frac{",
    "\\sqrt{",
    "\\cdot",
    "\\times",
    "\\div",
    "\\pm",
    "\\left(",
    "\\right)",
    "\\pi",
    "\\leq",
    "\\geq",
    "\\neq",
    "\\text{",
    "\\dfrac{",
    "^{2}",
    "_{n}",
    "$x$",
    "$$",
)
_PHRASES = (
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "Let's think step by step.",
    "The answer is",
    "The final answer is",
    "So the answer is",
    "Therefore, the final answer is",
    "user",
    "assistant",
    "system",
    "You are a helpful assistant.",
)


def _sentence(rng: random.Random) -> str:
    words = rng.choices(_WORDS, k=rng.randint(4, 14))
    if rng.random() < 0.5:
        words.insert(rng.randrange(len(words) + 1), rng.choice(_LATEX) + str(rng.randint(0, 999)) + "}")
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".?!:,")


def tokenizer_corpus(seed: int, toy_records: list[dict]) -> Iterator[str]:
    """Texts the BPE is trained on; a pure function of the seed and the toy records."""
    rng = random.Random(seed)
    for record in toy_records:
        yield record["prompt"]
        yield f"{rng.choice(_PHRASES[:6])} {record['solutions'][0]}"
    for _ in range(3000):
        yield _sentence(rng)
    for _ in range(20):
        yield from _PHRASES
        yield " ".join(_LATEX)


# ---------------------------------------------------------------------------------------------------------
# Build steps


def train_tokenizer(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with Qwen2 pre-tokenization; the special tokens get ids 0, 1, 2."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json, written by hand so it loads the same under transformers 4.x and 5.x."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tiny_model(
    model_dir: Path, seed: int, params: dict, vocab_size: int, eos_id: int, pad_id: int
) -> None:
    """Save a randomly initialised tiny Qwen2ForCausalLM; the global torch RNG is left untouched."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=params["hidden_size"],
        intermediate_size=params["intermediate_size"],
        num_hidden_layers=params["num_hidden_layers"],
        num_attention_heads=params["num_attention_heads"],
        num_key_value_heads=params["num_key_value_heads"],
        max_position_embeddings=params["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    _save_seeded(model_dir, model, eos_id, pad_id)


def save_tiny_moe(
    moe_dir: Path, model_dir: Path, seed: int, vocab_size: int, eos_id: int, pad_id: int
) -> None:
    """Save a randomly initialised tiny Qwen3MoeForCausalLM (MOE_PARAMS) beside the dense model, with copies of
    its tokenizer files; the global torch RNG is left untouched."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size, tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_id,
        pad_token_id=pad_id, dtype="float32", **MOE_PARAMS,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
    _save_seeded(moe_dir, model, eos_id, pad_id)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(model_dir / name, moe_dir / name)


def _save_seeded(out: Path, model, eos_id: int, pad_id: int) -> None:
    """Save ``model`` as safetensors with the generation config every tiny model shares."""
    import transformers
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id)
    transformers.logging.disable_progress_bar()  # the one-shard "Writing model shards" bar is only noise
    model.save_pretrained(out, safe_serialization=True)


def builder_fingerprint() -> str:
    """Hash of the code and library versions that make a build: change either and old builds are redone."""
    digest = hashlib.sha256()
    for name in ("build_tiny_model.py", "make_toy_data.py", "make_toy_code_data.py", "make_toy_tool_data.py"):
        digest.update((Path(__file__).resolve().parent / name).read_bytes())
    for package in ("tokenizers", "torch", "transformers"):
        digest.update(f"{package}=={importlib.metadata.version(package)};".encode())
    return digest.hexdigest()


def _file_digest(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def _manifest(root: Path, seed: int, params: dict) -> dict:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    return {
        "seed": seed,
        "params": params,
        "builder": builder_fingerprint(),
        "files": {p.relative_to(root).as_posix(): _file_digest(p) for p in files},
    }


def read_manifest(root: Path) -> dict | None:
    """The manifest of a build directory, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((Path(root) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def is_complete(root: Path, seed: int, params: dict | None = None) -> bool:
    """True when ``root`` holds an intact build of this seed, these parameters and this builder."""
    manifest = read_manifest(root)
    wanted = {"seed": seed, "params": params or DEFAULT_PARAMS, "builder": builder_fingerprint()}
    if manifest is None or any(manifest.get(key) != value for key, value in wanted.items()):
        return False
    files = manifest.get("files", {})
    # Every model directory must be listed: a manifest of a build without OUT/moe is no complete build.
    models = all(f"{folder}/config.json" in files for folder in MODEL_DIRS)
    return models and all(
        (root / name).is_file() and _file_digest(root / name) == digest for name, digest in files.items()
    )


def _build_into(root: Path, seed: int, params: dict) -> None:
    train, test = make_toy_splits(params["n_train"], params["n_test"], seed)
    write_jsonl(root / "data" / "train.jsonl", train)
    write_jsonl(root / "data" / "test.jsonl", test)
    easy_train, easy_test = make_easy_splits(params["n_easy_test"], seed)
    write_jsonl(root / "data" / "easy" / "train.jsonl", easy_train)
    write_jsonl(root / "data" / "easy" / "test.jsonl", easy_test)
    write_code_data(root / "data" / "code", params["n_code_train"], params["n_code_test"], seed, ops=("+",))
    # Not in the tokenizer corpus below: the tokenizer (and so the pinned stats) must not depend on them.
    write_tool_data(root / "data" / "tools", params["n_tool_train"], params["n_tool_test"], seed)

    model_dir = root / "model"
    model_dir.mkdir(parents=True)
    tokenizer = train_tokenizer(tokenizer_corpus(seed, train + test), params["vocab_size"])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = tokenizer_config(params["max_position_embeddings"])
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids = {
        "vocab_size": tokenizer.get_vocab_size(),
        "eos_id": tokenizer.token_to_id(IM_END),
        "pad_id": tokenizer.token_to_id(ENDOFTEXT),
    }
    save_tiny_model(model_dir, seed, params, **ids)
    save_tiny_moe(root / "moe", model_dir, seed, **ids)
    (root / MANIFEST).write_text(json.dumps(_manifest(root, seed, params), indent=2, sort_keys=True) + "\n")


def build(out: Path, seed: int = 1, params: dict | None = None, force: bool = False) -> TinyBuild:
    """Build into ``out`` unless it already holds this exact build; return its paths."""
    out, params = Path(out), params or DEFAULT_PARAMS
    if not force and is_complete(out, seed, params):
        return TinyBuild(out)
    if out.exists() and read_manifest(out) is None:
        raise TinyBuildError(f"refusing to overwrite {str(out)!r}: it exists and holds no {MANIFEST}")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    try:
        _build_into(tmp, seed, params)
        if out.exists():  # an outdated build of ours: set it aside, delete it once the new one is in place
            out.replace(trash / "build")
        try:
            tmp.replace(out)
        except OSError:
            if not is_complete(out, seed, params):  # else a concurrent builder won, which is just as good
                raise
    finally:
        for leftover in (tmp, trash):
            shutil.rmtree(leftover, ignore_errors=True)
    return TinyBuild(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/tiny"), help="output directory")
    parser.add_argument("--seed", type=int, default=1, help="seed of the data, tokenizer and weights")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    done = build(args.out, args.seed, force=args.force)
    print(done.model_dir)


if __name__ == "__main__":
    main()
