"""`areal-hpc`: the command-line entry point. Thin: it parses arguments and calls the stages."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from areal_hpc.config import ConfigError, dump_yaml, load_config, render_markdown, render_options

# Errors that end a launch verb with a message, not a traceback: a plan or allocation that cannot work
# (ValueError, exit code 2), Slurm or a run directory that refuse (exit code 1).
LAUNCH_ERRORS = (ValueError, LookupError, FileExistsError, RuntimeError, TimeoutError)
CHECKOUT = Path(__file__).resolve().parents[1]  # the repository root, when running from a checkout
DOCS_PATH = CHECKOUT / "docs" / "config.md"


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """Config files and `key=value` overrides, in the order given."""
    overrides = [a for a in args if "=" in a]
    return [a for a in args if "=" not in a], overrides


def cmd_config_show(ns: argparse.Namespace) -> int:
    paths, overrides = split_args(ns.args)
    print(dump_yaml(load_config(paths, overrides)), end="")
    return 0


def default_docs_path() -> Path:
    """docs/config.md of the checkout the package runs from, else (an installed package) config.md here."""
    in_checkout = (CHECKOUT / "pyproject.toml").is_file() and DOCS_PATH.parent.is_dir()
    return DOCS_PATH if in_checkout else Path("config.md")


def cmd_config_docs(ns: argparse.Namespace) -> int:
    text = render_markdown()
    out = Path(ns.out) if ns.out else default_docs_path()
    if out != DOCS_PATH and not ns.out:
        print(
            f"an installed package, not a checkout: using {out} in the current folder (--out names another)"
        )
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
    from areal_hpc.control import default_trial_name
    from areal_hpc.launch import run_local

    paths, overrides = split_args(ns.args)
    cfg = load_config(paths, overrides)
    if cfg.trial_name is None:
        cfg = dataclasses.replace(cfg, trial_name=default_trial_name())
    return run_local(cfg)


def cmd_submit(ns: argparse.Namespace) -> int:
    from areal_hpc.launch import runs, submit

    if ns.recover and ns.args:
        print("areal-hpc submit: --recover takes no configs or overrides: a run resumes with its own "
              "config.yaml", file=sys.stderr)  # fmt: skip
        return 2
    if ns.recover:
        sub = submit.prepare_recover(runs.find_run(ns.recover, ns.fileroot or runs.DEFAULT_FILEROOT))
    else:
        paths, overrides = split_args(ns.args)
        sub = submit.prepare(load_config(paths, overrides))
    if ns.dry_run:
        print(submit.dry_run_text(sub), end="")
        return 0
    job_ids = submit.submit(sub)
    print(submit.describe(sub))
    done = "requeued" if sub.requeue else "resubmitted" if sub.recover else "submitted"
    print(f"{done} Slurm job(s) {', '.join(job_ids)}")
    print(f"follow it: areal-hpc status {sub.run.root}   areal-hpc logs {sub.run.root} -f")
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    from areal_hpc.eval import EvalOptions, evaluate, results_table

    opts = EvalOptions(
        ns.model_path, ns.output_path, tuple(n for n in ns.data_names.split(",") if n), ns.data_dir,
        ns.max_gen_tokens, ns.n_sampling, ns.temperature, ns.top_p, ns.top_k, ns.n_servers, seed=ns.seed,
    )  # fmt: skip
    if ns.submit is not None:
        return submit_eval(opts, ns.submit)
    print(results_table(evaluate(opts)))
    print(f"results: {Path(ns.output_path) / 'results.json'}")
    return 0


def submit_eval(opts, config_args: list[str]) -> int:
    """`eval --submit`: the same evaluation as a Slurm job on the generation partition of the config's
    cluster.slurm (account, QoS, setup commands), one GPU per server; returns once it is queued."""
    from areal_hpc.eval import evaluate, make_executor, outside_this_job

    opts.load_sets()  # a bad set is refused here, not in the queue
    cfg = load_config([a for a in config_args if "=" not in a], [a for a in config_args if "=" in a])
    executor = make_executor(cfg, Path(opts.output_path) / "slurm", local=False, n_gpus=opts.n_servers)
    with outside_this_job():
        job = executor.submit(evaluate, opts)
    print(f"submitted Slurm job {job.job_id} (partition {cfg.cluster.slurm.gen_partition})")
    print(f"results: {Path(opts.output_path) / 'results.json'} once it ends; its log: {job.paths.stdout}")
    return 0


def one_run(ns: argparse.Namespace):
    """The run the arguments name (the newest of a config's runs)."""
    from areal_hpc.launch import runs

    found = runs.select_runs(ns.run, ns.fileroot) if ns.run else []
    if not found:
        what = f"no run of {' '.join(ns.run)}" if ns.run else "no run named"
        raise runs.RunNotFound(
            f"{what}: give a run directory, experiment/trial, or the run's config and overrides"
        )
    return found[-1]


def cmd_status(ns: argparse.Namespace) -> int:
    from areal_hpc.launch import run_status, runs

    selected = runs.select_runs(ns.run, ns.fileroot)[-1:]
    if not selected:
        print(no_runs(ns))
    for run in selected:
        if ns.watch:
            run_status.watch(run, ns.interval)
        else:
            print("\n".join(run_status.status_lines(run)))
    return 0


def cmd_stop(ns: argparse.Namespace) -> int:
    from areal_hpc.launch import runs

    run = one_run(ns)
    if not runs.job_ids(run):  # a local run: its `areal-hpc run` stops it
        print(runs.stop_local(run, ns.timeout))
        return 0
    states = runs.stop(run, ns.timeout)
    print("\n".join(f"slurm job {jid}: {state}" for jid, state in sorted(states.items())))
    return 0


def cmd_logs(ns: argparse.Namespace) -> int:
    from areal_hpc.control import get_status
    from areal_hpc.launch import runs

    run = one_run(ns)
    find = lambda: runs.log_files(run, ns.role)  # noqa: E731
    if ns.follow:
        ended = lambda: (s := get_status(run)) is not None and s.final  # noqa: E731
        runs.follow(find, sys.stdout, ended)
        return 0
    if not find():
        print(f"no role logs yet in {run.logs}", file=sys.stderr)
        return 1
    for path in find():
        print(f"==> {path} <==")
        print(path.read_text(errors="replace"), end="")
    return 0


def cmd_plot(ns: argparse.Namespace) -> int:
    from areal_hpc.monitor import plot_run, read_stats

    run = one_run(ns)
    paths = plot_run(read_stats(run.stats), Path(ns.out) if ns.out else run.plots)
    if not paths:
        print(f"no statistics to plot yet in {run.stats}", file=sys.stderr)
        return 1
    print("\n".join(map(str, paths)))
    return 0


def cmd_trace(ns: argparse.Namespace) -> int:
    from areal_hpc.monitor import write_trace

    try:
        out, table = write_trace(one_run(ns), Path(ns.out) if ns.out else None, ns.steps, ns.cuda)
    except (FileNotFoundError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1
    print(table)
    print(f"trace: {out} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from areal_hpc.weights import is_adapter_dir, write_merged

    run = one_run(ns)
    saved = run.saved_checkpoints("actor")
    step = max(saved, default=None) if ns.step is None else ns.step
    if step not in saved:
        steps = ", ".join(map(str, sorted(saved))) or "none"
        print(f"no actor checkpoint of global step {step} in {run.checkpoints / 'actor'} (saved: {steps})", file=sys.stderr)  # fmt: skip
        return 1
    path = saved[step]
    if not is_adapter_dir(path):
        print(
            f"{path} holds full weights already (an HF model): there are no adapters to merge",
            file=sys.stderr,
        )
        return 1
    print(write_merged(path, Path(ns.out) if ns.out else path.with_name(f"{path.name}-merged")))
    return 0


def cmd_episodes(ns: argparse.Namespace) -> int:
    from areal_hpc.monitor import show_episodes

    return show_episodes(one_run(ns), ns.step, ns.prompt, ns.json)


def cmd_list(ns: argparse.Namespace) -> int:
    from areal_hpc.control import get_status
    from areal_hpc.launch import runs

    found = runs.select_runs(ns.run, ns.fileroot)
    if not found:
        print(no_runs(ns))
    for run in found:
        status = get_status(run)
        jobs = ",".join(runs.job_ids(run)) or "local"
        print(f"{run.root}  {status.state if status else 'NOT STARTED'}  jobs {jobs}")
    return 0


def no_runs(ns: argparse.Namespace) -> str:
    """What `status` and `list` say when they find no run: where they looked."""
    from areal_hpc.launch import runs

    return f"no run of {' '.join(ns.run)}" if ns.run else f"no runs under {runs.searched(ns.fileroot)}"


def add_run_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run", nargs="*", metavar="RUN | CONFIG [key=value ...]",
        help="a run directory, experiment/trial under the fileroot, or the run's config files and overrides "
        "(their cluster.fileroot and experiment; their trial_name if set, else the newest run)",
    )  # fmt: skip
    parser.add_argument(
        "--fileroot",
        help="cluster.fileroot of the runs (default: the config's; else ~/areal_hpc and the shipped configs', "
        "such as the toys' runs/ under the working directory)",
    )


def add_eval_parser(verbs) -> None:
    from areal_hpc.config import EvalConfig

    d = EvalConfig()  # the defaults of evaluation during training: one place
    ev = verbs.add_parser(
        "eval",
        help="evaluate a checkpoint on math sets: greedy_acc, sample_pass@1, pass@k, maj@k (the original's)",
    )
    ev.add_argument(
        "--model_path", required=True,
        help="Hugging Face model directory (a saved checkpoint; a LoRA run's adapter folder evaluates on its base)",
    )  # fmt: skip
    ev.add_argument(
        "--output_path", required=True, help="folder of the answers (<set>.jsonl) and results.json"
    )
    ev.add_argument("--data_names", default=",".join(d.data_names), help="comma-separated sets: <name>.jsonl")
    ev.add_argument(
        "--data_dir", default=os.environ.get("AREAL_EVAL_DATA", ""),
        help="folder of the sets, JSONL with problem and answer (default: $AREAL_EVAL_DATA)",
    )  # fmt: skip
    ev.add_argument("--max_gen_tokens", type=int, default=d.max_gen_tokens, help="longest answer, in tokens")
    ev.add_argument(
        "--n_sampling", type=int, default=d.n_sampling, help="samples per question (0: greedy only)"
    )
    ev.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature")
    ev.add_argument("--top_p", type=float, default=d.top_p, help="nucleus sampling threshold")
    ev.add_argument(
        "--top_k", type=int, default=d.top_k, help="sample among the k most likely tokens (-1: all)"
    )
    ev.add_argument(
        "--n_servers", type=int, default=1, help="generation servers, one per GPU (questions spread)"
    )
    ev.add_argument("--seed", type=int, default=0, help="seed of the samples")
    ev.add_argument(
        "--submit", nargs="*", metavar="CONFIG|key=value",
        help="run it as a Slurm job instead, with the cluster.slurm settings of these config files and "
        "overrides (partition: cluster.slurm.gen_partition; time limit: eval.time_limit_mins)",
    )  # fmt: skip
    ev.set_defaults(func=cmd_eval)


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
    docs.add_argument(
        "--out", help="where to write it (default: docs/config.md of a checkout, else config.md here)"
    )
    docs.add_argument("--check", action="store_true", help="only check that the file is up to date")
    docs.set_defaults(func=cmd_config_docs)
    options = config_verbs.add_parser("options", help="list every option with its default and meaning")
    options.set_defaults(func=cmd_config_options)
    run = verbs.add_parser("run", help="run every role of a config as local processes (CPU or one node)")
    run.add_argument("args", nargs="*", metavar="CONFIG|key=value", help="YAML files, then overrides")
    run.set_defaults(func=cmd_run)

    submit = verbs.add_parser(
        "submit", help="submit a config as a Slurm job (heterogeneous: generation + training)"
    )
    submit.add_argument("args", nargs="*", metavar="CONFIG|key=value", help="YAML files, then overrides")
    submit.add_argument(
        "--dry-run", action="store_true", help="print the plan and sbatch text; write nothing"
    )
    submit.add_argument(
        "--recover",
        metavar="RUN",
        help="submit an existing run again (its directory, or experiment/trial under the fileroot); "
        "it resumes from its newest recover checkpoint as its recover_mode says",
    )
    submit.add_argument("--fileroot", help="cluster.fileroot of the run to recover (default: ~/areal_hpc)")
    submit.set_defaults(func=cmd_submit)
    add_eval_parser(verbs)
    status = verbs.add_parser(
        "status",
        help="Slurm state, roles, step, reward, ETA, rollouts, staleness, checkpoints of a run "
        "(default: the latest)",
    )
    add_run_arg(status)
    status.add_argument("-w", "--watch", action="store_true", help="a live table, redrawn until the run ends")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between redraws of --watch")
    status.set_defaults(func=cmd_status)
    stop = verbs.add_parser(
        "stop", help="cancel a run's Slurm jobs, or stop its `areal-hpc run`; returns once all has ended"
    )
    add_run_arg(stop)
    stop.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the jobs to end")
    stop.set_defaults(func=cmd_stop)
    logs = verbs.add_parser("logs", help="print the role logs of a run's latest attempt")
    add_run_arg(logs)
    logs.add_argument("--role", help="only this role: controller, gen_server, trainer, or e.g. trainer1")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
    logs.set_defaults(func=cmd_logs)
    plot = verbs.add_parser(
        "plot", help="PNGs of a run's curves: reward, lengths, off-policyness, weights, time, evaluations"
    )
    add_run_arg(plot)
    plot.add_argument("--out", help="folder of the PNGs (default: the run's logs/plots)")
    plot.set_defaults(func=cmd_plot)
    trace = verbs.add_parser(
        "trace", help="where a run's time went: a Perfetto trace of every role and a per-step table"
    )
    add_run_arg(trace)
    trace.add_argument("--steps", metavar="A:B", help="only global steps A to B (A:, :B, N too)")
    trace.add_argument("--out", help="the trace file (default: the run's logs/trace.json)")
    trace.add_argument(
        "--cuda", action="store_true",
        help="add the trainers' torch.profiler traces of logging.profile_step (CUDA kernels on a GPU)",
    )  # fmt: skip
    trace.set_defaults(func=cmd_trace)
    export = verbs.add_parser(
        "export", help="a LoRA run's saved adapters folded into their base: an HF model (--merge)"
    )
    add_run_arg(export)
    export.add_argument(
        "--merge", action="store_true", required=True,
        help="write the base model with the adapters merged into its weights (W + alpha/r B A)",
    )  # fmt: skip
    export.add_argument("--step", type=int, help="the checkpoint of this global step (default: the newest)")
    export.add_argument("--out", help="the model's folder (default: beside the checkpoint, <name>-merged)")
    export.set_defaults(func=cmd_export)
    episodes = verbs.add_parser(
        "episodes", help="print the transcripts of a run's episodes (rollout.transcript_groups groups a step)"
    )
    add_run_arg(episodes)
    episodes.add_argument("--step", type=int, help="the step's episodes (default: the newest step's)")
    episodes.add_argument("--prompt", metavar="ID", help="only the episodes of this prompt (its query id)")
    episodes.add_argument("--json", action="store_true", help="as JSON lines, one an episode, as stored")
    episodes.set_defaults(func=cmd_episodes)
    listing = verbs.add_parser("list", help="list runs under the fileroot with their state and Slurm jobs")
    add_run_arg(listing)
    listing.set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except BrokenPipeError:  # `areal-hpc config options | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141  # as a shell reports a process ended by SIGPIPE
    except ConfigError as e:
        print(f"areal-hpc: {e}", file=sys.stderr)
        return 2
    except LAUNCH_ERRORS as e:
        print(f"areal-hpc {ns.verb}: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1


if __name__ == "__main__":
    sys.exit(main())
