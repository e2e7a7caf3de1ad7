"""Command line: `twinplane train [CONFIG.yaml] [key.sub=value ...]`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from twinplane.cluster import WorkerError, build_rollout
from twinplane.config import ConfigError, config_help, load_config
from twinplane.rollout import RolloutEngine

DESCRIPTION = "twinplane: RL post-training (GRPO) of LLMs on CUDA, ROCm and CPU with the same code."
TRAIN_HELP = """Run GRPO. With no arguments: the embedded demo (a tiny model learns multi-digit addition on CPU:
supervised warm start from an imperfect teacher, then GRPO with an exact-match verifier, evaluated on
held-out problems). Writes config.yaml, metrics.jsonl, summary.json and final/ (an HF model folder)."""
TOOLS = {"report": "PNG charts and report.md of a finished or running run (twinplane report RUN_DIR)",
         "doctor": "one-screen report of this machine: torch build, devices, backends, measured GEMM/bandwidth",
         "plan": "memory, layouts and cost for a model on N GPUs (twinplane plan --model DIR --gpu mi300x --gpus 8)"}
EVAL_HELP = """Evaluate a model folder: greedy accuracy, and with --n K also pass@k (unbiased estimator) and mean@k
over K samples per prompt; mean response length and truncation rate. Prints and writes JSON."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twinplane", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    tp = sub.add_parser("train", help="run RL training (no arguments: the CPU demo)", description=TRAIN_HELP,
                        epilog="config keys (set in YAML or as key.sub=value):\n" + config_help(),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    tp.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                    help="an optional YAML config file, then dotted overrides such as train.lr=1e-4")
    tp.add_argument("--run-dir", help="where to write the run (default runs/<timestamp>)")
    tp.add_argument("--resume", metavar="auto|PATH",
                    help="continue from the newest complete checkpoint in --run-dir (auto) or from PATH")
    tp.add_argument("--max-restarts", type=int, default=0, metavar="K",
                    help="relaunch after a crash or preemption up to K times, resuming (twinplane supervise)")
    xp = sub.add_parser("export", help="write a run's or checkpoint's policy as a Hugging Face model folder")
    xp.add_argument("source", help="a run dir (its newest complete checkpoint, else final/) or a checkpoint folder")
    xp.add_argument("--out", required=True, help="output folder")
    xp.add_argument("--format", default="merged", choices=["merged", "peft"],
                    help="merged: a full HF model (LoRA adapters folded in; the default); peft: LoRA adapters only "
                         "(adapter_config.json + adapter_model.safetensors)")
    sp = sub.add_parser("supervise", help="run a command, relaunching it with --resume auto after crashes",
                        description="twinplane supervise [--max-restarts K] [--backoff S] -- twinplane train ...")
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    for name, text in TOOLS.items():
        sub.add_parser(name, help=text, add_help=False)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["supervise"] or (argv and argv[0] in TOOLS):
        # These own their argument parsing (supervise's options precede `--`, which sub-parsers can't express).
        import importlib

        return importlib.import_module(f"twinplane.{argv[0]}").main(argv[1:])
    ep = sub.add_parser("eval", help="evaluate a model folder on a prompt file", description=EVAL_HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ep.add_argument("--model", required=True, help="HF model folder (config.json, safetensors, tokenizer)")
    ep.add_argument("--data", required=True, help="JSONL / Parquet / saved datasets folder (data.* keys apply)")
    ep.add_argument("--reward", required=True, help="gsm8k | math | exact_match | exact_int | module:function")
    ep.add_argument("--n", type=int, default=1, help="samples per prompt for pass@k and mean@k (default 1)")
    ep.add_argument("--temperature", type=float, default=1.0, help="sampling temperature when --n > 1")
    ep.add_argument("--out", default="eval.json", help="where to write the JSON results (default eval.json)")
    ep.add_argument("args", nargs="*", metavar="key=value", help="config overrides, e.g. data.template=plain")
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return 0
    if ns.command == "export":
        from twinplane.export import export

        try:
            out = export(Path(ns.source), Path(ns.out), ns.format)
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            print(f"twinplane: error: {e}", file=sys.stderr)
            return 2
        print(f"exported {out}")
        return 0
    if ns.command == "train" and ns.max_restarts > 0:
        from twinplane.supervise import supervise

        child = [a for i, a in enumerate(argv) if not a.startswith("--max-restarts")
                 and not (i > 0 and argv[i - 1] == "--max-restarts")]
        return supervise([sys.executable, "-m", "twinplane.cli", *child], ns.max_restarts)
    from twinplane import run

    args = list(ns.args)
    path = None
    if ns.command == "train":
        path = args.pop(0) if args and "=" not in args[0] else None
        if ns.run_dir:
            args.append(f"run_dir={ns.run_dir}")
    else:
        args = [f"model.path={ns.model}", f"data.train_file={ns.data}", f"data.val_file={ns.data}",
                f"reward.name={ns.reward}", f"eval.n={ns.n}", f"eval.temperature={ns.temperature}", *args]
    try:
        cfg = load_config(path, args)
        setup = run.prepare(cfg, ns.resume if ns.command == "train" else None)
    except (ConfigError, ValueError, FileNotFoundError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"twinplane: error: {msg}", file=sys.stderr)
        return 2
    if ns.command == "train":
        try:
            run.train(setup)
        except run.Preempted as e:
            print(f"twinplane: {e}", file=sys.stderr)
            return run.PREEMPTED
        except WorkerError as e:  # a crash, not bad input: exit 1 lets `supervise` resume from the checkpoint
            print(f"twinplane: error: {e}", file=sys.stderr)
            return 1
        except ConfigError as e:  # found only when the planes start (e.g. an unreachable cluster.address)
            print(f"twinplane: error: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        engine = RolloutEngine(setup.model, setup.tokenizer.eos_token_id, setup.tokenizer.pad_token_id,
                               cfg.rollout.max_num_seqs, seed=cfg.seed)
        result = run.run_eval(setup, build_rollout(cfg, engine, setup.tokenizer), ns.n, ns.temperature)
    finally:
        setup.scorer.close()
    result = {"model": ns.model, "data": ns.data, "reward": ns.reward, "prompts": len(setup.val_prompts), **result}
    Path(ns.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
