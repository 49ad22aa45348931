"""`areal-hpc`: the command-line entry point. Thin: it parses arguments and calls the stages."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from areal_hpc.config import ConfigError, dump_yaml, load_config
from areal_hpc.config.docs import render_markdown, render_options

DOCS_PATH = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """Config files and `key=value` overrides, in the order given."""
    overrides = [a for a in args if "=" in a]
    return [a for a in args if "=" not in a], overrides


def cmd_config_show(ns: argparse.Namespace) -> int:
    paths, overrides = split_args(ns.args)
    print(dump_yaml(load_config(paths, overrides)), end="")
    return 0


def cmd_config_docs(ns: argparse.Namespace) -> int:
    text = render_markdown()
    out = Path(ns.out)
    if ns.check:
        if not out.is_file() or out.read_text() != text:
            print(f"{out} is stale: run `areal-hpc config docs` to regenerate it", file=sys.stderr)
            return 1
        print(f"{out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    print(f"wrote {out}")
    return 0


def cmd_config_options(ns: argparse.Namespace) -> int:
    print(render_options())
    return 0


def cmd_run(ns: argparse.Namespace) -> int:
    from areal_hpc.launch.local import run_local
    from areal_hpc.launch.rundir import default_trial_name

    paths, overrides = split_args(ns.args)
    cfg = load_config(paths, overrides)
    if cfg.trial_name is None:
        cfg = dataclasses.replace(cfg, trial_name=default_trial_name())
    return run_local(cfg)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="areal-hpc", description="Asynchronous RL for LLM reasoning on Slurm clusters."
    )
    verbs = parser.add_subparsers(dest="verb", required=True)

    config = verbs.add_parser("config", help="inspect and document configurations")
    config_verbs = config.add_subparsers(dest="config_verb", required=True)
    show = config_verbs.add_parser("show", help="print the resolved config of YAML files and overrides")
    show.add_argument("args", nargs="*", metavar="CONFIG|key=value", help="YAML files, then overrides")
    show.set_defaults(func=cmd_config_show)
    docs = config_verbs.add_parser("docs", help="write the option reference (docs/config.md)")
    docs.add_argument("--out", default=str(DOCS_PATH), help="where to write it")
    docs.add_argument("--check", action="store_true", help="only check that the file is up to date")
    docs.set_defaults(func=cmd_config_docs)
    options = config_verbs.add_parser("options", help="list every option with its default and meaning")
    options.set_defaults(func=cmd_config_options)
    run = verbs.add_parser("run", help="run every role of a config as local processes (CPU or one node)")
    run.add_argument("args", nargs="*", metavar="CONFIG|key=value", help="YAML files, then overrides")
    run.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except ConfigError as e:
        print(f"areal-hpc: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
