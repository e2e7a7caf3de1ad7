"""Command line: `twinplane train [CONFIG.yaml] [key.sub=value ...]`, eval, export, supervise and the tools.

One handler around every command decides the exit code (see `twinplane.errors`): 0 done, 2 bad input, 75
preempted, 130 interrupted, 1 a bug (with its traceback and a line saying so). Signal handlers are installed
before anything heavy is imported, so a stop request is handled from the first second: twinplane's modules (and
with them torch) are imported inside the command that needs them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback
from pathlib import Path

from twinplane import __version__
from twinplane.errors import EXIT_BUG, EXIT_INPUT, EXIT_INTERRUPTED, EXIT_PREEMPTED, InputError, Preempted
from twinplane.run.signals import StopRequests

DESCRIPTION = "twinplane: RL post-training (GRPO, PPO, RLOO, REINFORCE++, GSPO, DAPO) of LLMs on CUDA, ROCm and CPU."
EXIT_CODES = """exit codes: 0 done · 2 bad input (config, data, model folder, checkpoint, reward function, arguments;
never retried) · 75 preempted by SIGTERM/SIGINT, state saved: --resume auto continues · 130 interrupted (not
train) · 1 a bug in twinplane or a crashed worker (traceback printed; supervise/--max-restarts retry it)."""
RUN_FILES = """files written to --run-dir: config.yaml (resolved config), metrics.jsonl (one JSON object per step),
checkpoints/ (step_N/ full-state checkpoints; quarantine/ holds damaged ones), final/ (HF model folder),
summary.json (the result), tensorboard/ and wandb/ (with those log.backends). A run dir holds one run: reusing it
needs --resume auto (continue) or --overwrite (the earlier run is moved to RUN_DIR.replaced-<time>)."""
TRAIN_HELP = """Run RL (GRPO unless algo.name says otherwise). With no arguments: the embedded demo (a tiny model
learns {digits}-digit addition, a+b= with a and b below {limit}, on CPU: supervised warm start from an imperfect
teacher, then GRPO with an exact-match verifier, evaluated on held-out problems).

""" + RUN_FILES + "\n\n" + EXIT_CODES
TOOLS = {"report": "PNG charts and report.md of a finished or running run (twinplane report RUN_DIR)",
         "doctor": "one-screen report of this machine: torch build, devices, backends, measured GEMM/bandwidth",
         "plan": "memory, layouts and cost for a model on N GPUs (twinplane plan --model DIR --gpu mi300x --gpus 8)",
         "serve": "an OpenAI-compatible server over the engine (twinplane serve MODEL_DIR [--port 8000])"}
EVAL_HELP = """Evaluate a model folder: greedy accuracy, and with --n K also pass@k (unbiased estimator) and mean@k
over K samples per prompt; mean response length and truncation rate. Prints and writes JSON. Without --data,
the built-in task's held-out problems (task.* keys and seed as in training: the demo's own evaluation)."""


def _error(msg: object) -> None:
    print(f"twinplane: error: {msg}", file=sys.stderr, flush=True)


def algorithms_help() -> str:
    """The `algo.name` presets, one line each with the paper (from the algorithm modules' registrations)."""
    from twinplane.algos import PRESETS  # (a command's import: see the module docstring)

    order = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "dapo", "ppo")
    names = [n for n in order if n in PRESETS] + [n for n in PRESETS if n not in order]
    return "algorithms (algo.name=...; each sets algo.* defaults that any key overrides):\n" + "\n".join(
        f"  {n:<22} {PRESETS[n].summary} [{PRESETS[n].paper}]" for n in names)


def main(argv: list[str] | None = None) -> int:
    """Every command, behind one handler that turns what went wrong into an exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    stop = StopRequests()
    if argv[:1] == ["train"]:
        stop.install()  # before torch is imported: a Ctrl-C during start-up is a clean stop, not a traceback
    try:
        return _main(argv, stop)
    except InputError as e:
        _error(e)
        return EXIT_INPUT
    except Preempted as e:
        print(f"twinplane: {e}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print("twinplane: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception as e:
        from twinplane.cluster.planes import WorkerError  # (a command's import: see the module docstring)

        if isinstance(e, WorkerError):  # a crash, not bad input: exit 1 lets `supervise` resume
            _error(e)
            return EXIT_BUG
        traceback.print_exc()
        _error(f"this is a bug in twinplane ({type(e).__name__}), not a problem with your input; please report it "
               "with the traceback above")
        return EXIT_BUG
    finally:
        stop.restore()


def _parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    from twinplane.config import TaskSection, config_help  # (imports torch: after the signal handlers, see `main`)

    parser = argparse.ArgumentParser(prog="twinplane", description=DESCRIPTION, epilog=EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"twinplane {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = TRAIN_HELP.format(digits=TaskSection.digits, limit=10 ** TaskSection.digits)
    tp = sub.add_parser("train", help="run RL training (no arguments: the CPU demo)", description=demo,
                        epilog=algorithms_help() + "\n\nconfig keys (set in YAML or as key.sub=value):\n"
                        + config_help(),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    tp.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                    help="an optional YAML config file, then dotted overrides such as train.lr=1e-4")
    tp.add_argument("--run-dir", help="where to write the run (default runs/<timestamp>)")
    tp.add_argument("--resume", metavar="auto|PATH",
                    help="continue from the newest complete checkpoint in --run-dir (auto) or from PATH")
    tp.add_argument("--overwrite", action="store_true",
                    help="start a new run in a --run-dir that holds one: the earlier run is moved aside")
    tp.add_argument("--delete-old", action="store_true", help="with --overwrite: delete the earlier run instead")
    tp.add_argument("--max-restarts", type=int, default=0, metavar="K",
                    help="relaunch after a crash or preemption up to K times, resuming (twinplane supervise)")
    xp = sub.add_parser("export", help="write a run's or checkpoint's policy as a Hugging Face model folder")
    xp.add_argument("source", help="a run dir (its newest complete checkpoint, else final/) or a checkpoint folder")
    xp.add_argument("--out", required=True, help="output folder (new or empty)")
    xp.add_argument("--format", default="merged", choices=["merged", "peft"],
                    help="merged: a full HF model (LoRA adapters folded in; the default); peft: LoRA adapters only "
                         "(adapter_config.json + adapter_model.safetensors)")
    sp = sub.add_parser("supervise", help="run a command, relaunching it with --resume auto after crashes",
                        description="twinplane supervise [--max-restarts K] [--backoff S] -- twinplane train ...")
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    for name, text in TOOLS.items():
        sub.add_parser(name, help=text, add_help=False)
    ep = sub.add_parser("eval", help="evaluate a model folder on a prompt file", description=EVAL_HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ep.add_argument("--model", required=True, help="HF model folder (config.json, safetensors, tokenizer)")
    ep.add_argument("--data", help="JSONL / Parquet / saved datasets folder (data.* keys apply); default: the "
                                   "built-in task's held-out problems")
    ep.add_argument("--reward", default="exact_int", help="gsm8k | math | exact_match | exact_int (default) | "
                                                          "module:function")
    ep.add_argument("--n", type=int, default=1, help="samples per prompt for pass@k and mean@k (default 1)")
    ep.add_argument("--temperature", type=float, default=1.0, help="sampling temperature when --n > 1")
    ep.add_argument("--out", default="eval.json", help="where to write the JSON results (default eval.json)")
    ep.add_argument("args", nargs="*", metavar="key=value", help="config overrides, e.g. data.template=plain")
    return parser, sub


def _main(argv: list[str], stop: StopRequests) -> int:
    from twinplane.config import ConfigError, load_config  # (a command's import: see the module docstring)

    parser, _ = _parser()
    if argv[:1] == ["supervise"] or (argv and argv[0] in TOOLS):
        # These own their argument parsing (supervise's options precede `--`, which sub-parsers can't express).
        import importlib

        return importlib.import_module(f"twinplane.tools.{argv[0]}").main(argv[1:])
    ns, extra = parser.parse_known_args(argv)
    if extra and ns.command in ("train", "eval") and not any(a.startswith("-") for a in extra):
        ns.args += extra  # key=value after an option (argparse takes one run of positionals: CONFIG --run-dir R k=v)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if ns.command is None:
        parser.print_help()
        return 0
    if ns.command == "export":
        return _export(Path(ns.source), Path(ns.out), ns.format)
    if ns.command == "train" and ns.max_restarts != 0:
        if ns.max_restarts < 0:
            raise ConfigError(f"--max-restarts: must be >= 0, got {ns.max_restarts}")
        from twinplane.tools.supervise import supervise  # (a command's import: see the module docstring)

        child = [a for i, a in enumerate(argv) if not a.startswith("--max-restarts")
                 and not (i > 0 and argv[i - 1] == "--max-restarts")]
        stop.restore()  # the supervisor forwards signals to the child; one received until now is handed over
        return supervise([sys.executable, "-m", "twinplane.cli", *child], ns.max_restarts,
                         received=(stop.signum,) if stop.requested else ())
    args = list(ns.args)
    path, saved = None, False
    if ns.command == "train":
        if ns.delete_old and not ns.overwrite:
            raise ConfigError("--delete-old: only with --overwrite")
        path = args.pop(0) if args and "=" not in args[0] else None
        if path and not Path(path).exists() and re.fullmatch(r"[a-z_]+\.[a-z_.]+", path):  # `train.steps 10`
            value = args[0] if args and "=" not in args[0] else "VALUE"
            raise ConfigError(f"config file {path} not found (a key is set as key=value: did you mean "
                              f"{path}={value}?)")
        if ns.run_dir is not None:
            args.append(f"run_dir={ns.run_dir}")
        own = Path(ns.run_dir or "", "config.yaml")
        if ns.resume and path is None and ns.run_dir and own.is_file():  # the run's own settings, not the defaults
            path, saved = str(own), True
            print(f"twinplane: resuming with the run's own settings ({own})"
                  + (f" and {len(args) - 1} given here" if len(args) > 1 else ""), flush=True)
    else:
        if ns.n < 1 or ns.temperature < 0:
            raise ConfigError(f"--n must be >= 1 and --temperature >= 0, got {ns.n} and {ns.temperature}")
        if ns.data and not Path(ns.data).exists():
            raise InputError(f"--data {ns.data}: no such file or directory")
        _check_writable(Path(ns.out))
        data = [f"data.train_file={ns.data}", f"data.val_file={ns.data}"] if ns.data else []
        args = [f"model.path={ns.model}", *data, f"reward.name={ns.reward}", f"eval.n={ns.n}",
                f"eval.temperature={ns.temperature}", *args]
    cfg = load_config(path, args, saved=saved)
    # (a command's imports: see the module docstring)
    from twinplane.run import loop
    from twinplane.run.prepare import prepare
    from twinplane.run.run_dir import RunFinished

    try:
        setup = prepare(cfg, ns.resume if ns.command == "train" else None, own_run_dir=ns.command == "train",
                        overwrite=getattr(ns, "overwrite", False), delete_old=getattr(ns, "delete_old", False),
                        stop=stop)
    except RunFinished as e:
        print(f"twinplane: {e}")
        return 0
    except (ValueError, FileNotFoundError, NotADirectoryError, KeyError, PermissionError) as e:
        # Found while opening the user's files (model folder, data, reward function): bad input, exit 2.
        if isinstance(e, InputError):
            raise
        raise InputError(e.args[0] if isinstance(e, KeyError) and e.args else e) from None
    if ns.command == "train":
        loop.train(setup)
        return 0
    return _eval(loop, setup, cfg, ns)


def _eval(loop, setup, cfg, ns) -> int:
    from twinplane.cluster import build_engine, build_rollout  # (a command's import: see the module docstring)

    try:
        engine = build_engine(cfg, setup.model, setup.tokenizer)
        result = loop.run_eval(setup, build_rollout(cfg, engine, setup.tokenizer), ns.n, ns.temperature)
    finally:
        setup.scorer.close()
    data = ns.data or f"built-in task {cfg.task.name} (held-out, seed {cfg.seed})"
    result = {"model": ns.model, "data": data, "reward": ns.reward, "prompts": len(setup.val_prompts), **result}
    print(json.dumps(result, indent=2))  # (first: the results are on screen whatever happens to the file)
    Path(ns.out).write_text(json.dumps(result, indent=2))
    print(f"twinplane: wrote {Path(ns.out).absolute()}", file=sys.stderr)  # (stdout: the JSON alone)
    return 0


def _check_writable(out: Path) -> None:
    """Before any work: `out` can be written (opened for appending, as the user running this; a file this made
    is removed again), so a bad --out costs a one-line error, not an evaluation."""
    if out.is_dir():
        raise InputError(f"--out {out}: is a folder")
    existed = out.exists()
    try:
        os.close(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    except OSError as e:
        raise InputError(f"--out {out}: cannot be written ({e.strerror})") from None
    if not existed:
        out.unlink()


def _export(source: Path, out: Path, fmt: str) -> int:
    from twinplane.tools.export import export  # (a command's import: see the module docstring)

    try:
        out, what = export(source, out, fmt)
    except FileNotFoundError as e:
        raise InputError(e) from None
    print(f"exported {what} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
