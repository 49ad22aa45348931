"""The SGLang generation backend: a real SGLang server (`python -m sglang.launch_server`'s code) per server of
the generation layout, started as a child process of the gen_server role (one GPU group each).

The command is built from the ServerSpec (`server_command`, pinned by golden files): the model, tensor size,
the server's first GPU among those its step sees, the port, SGLang's memory and context options, its seed,
`--weight-version 0`, `--skip-tokenizer-init` (the client decodes; gen.client) and the run's secret as the API
key; `--ep-size` (sglang.ep_size) when not 1, and `--enable-return-routed-experts` under routing replay
(actor.router_replay rollout: gen.routing); `--enable-lora --max-lora-rank --lora-target-modules` for a LoRA
actor whose adapters are published (weight_update_mode adapter). The key is read from the run's secret file by `launch` in the child, so it never appears on a command
line that other users of the node can read in /proc.
"""

from areal_hpc.gen.backends.sglang.server import SGLangServer, server_command, start

__all__ = ["SGLangServer", "server_command", "start"]
