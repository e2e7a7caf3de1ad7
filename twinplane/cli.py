"""Command line: `twinplane train [CONFIG.yaml] [key.sub=value ...]`."""

from __future__ import annotations

import argparse
import sys

from twinplane.config import ConfigError, config_help, load_config

DESCRIPTION = "twinplane: RL post-training (GRPO) of LLMs on CUDA, ROCm and CPU with the same code."
TRAIN_HELP = """Run GRPO. With no arguments: the embedded demo (a tiny model learns multi-digit addition on CPU:
supervised warm start from an imperfect teacher, then GRPO with an exact-match verifier, evaluated on
held-out problems). Writes config.yaml, metrics.jsonl, summary.json and final/ (an HF model folder)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twinplane", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    tp = sub.add_parser("train", help="run RL training (no arguments: the CPU demo)", description=TRAIN_HELP,
                        epilog="config keys (set in YAML or as key.sub=value):\n" + config_help(),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    tp.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                    help="an optional YAML config file, then dotted overrides such as train.lr=1e-4")
    tp.add_argument("--run-dir", help="where to write the run (default runs/<timestamp>)")
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return 0
    args = list(ns.args)
    path = args.pop(0) if args and "=" not in args[0] else None
    if ns.run_dir:
        args.append(f"run_dir={ns.run_dir}")
    try:
        cfg = load_config(path, args)
    except ConfigError as e:
        print(f"twinplane: error: {e}", file=sys.stderr)
        return 2
    from twinplane.run import train

    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
