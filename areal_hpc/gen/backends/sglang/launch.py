"""The child process of an SGLang server: SGLang's own launch with its API key read from the run's secret.

python -m areal_hpc.gen.backends.sglang.launch --token-file RUN/secret <sglang.launch_server flags>
"""

from __future__ import annotations

import argparse
import os
import sys

from areal_hpc.gen.backends.builtin.server import read_token  # the same check: a private, non-empty file


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m areal_hpc.gen.backends.sglang.launch")
    parser.add_argument("--token-file", required=True, help="the run's secret (0600): SGLang's --api-key")
    ns, sglang_argv = parser.parse_known_args(argv)
    from sglang.launch_server import run_server  # as `python -m sglang.launch_server` runs (sglang 0.5.10)
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    server_args = prepare_server_args(sglang_argv)
    server_args.api_key = read_token(ns.token_file)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)  # its scheduler and detokenizer processes


if __name__ == "__main__":
    main(sys.argv[1:])
