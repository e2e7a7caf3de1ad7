"""GRPO step time: twinplane vs TRL's `GRPOTrainer`, on the same weights, prompts and per-step work.

Both frameworks load one random Llama (saved to a temp dir with the arithmetic char tokenizer) and run GRPO on
identical batches of `--prompts` arithmetic prompts x `--samples` samples, each exactly `--new-tokens` tokens
(min = max new tokens), temperature 1, KL to a frozen reference (k3, beta 0.04), PPO clip 0.2/0.2, token-mean
loss over the whole batch (TRL `loss_type="dapo"`), group-std advantages, AdamW lr 1e-5 (constant), grad clip 1,
one optimizer step per generation batch, fp32 on CPU. Reported: median step wall time over `--steps` steps after
`--warmup-steps`, per-phase medians (rollout, reward, reference scoring, train, other), completion tokens/s, and
the ratio twinplane/TRL (< 1 means twinplane is faster).

TRL phases come from timers wrapped around its `_generate`, `_calculate_rewards`, the reference-model call of
`_get_per_token_logps_and_entropies` and `_generate_and_score_completions` ("train" = the rest of the step:
loss forward/backward, clipping, optimizer step). TRL's step is timed from `on_step_begin` to `on_step_end`.

    python benchmarks/grpo_vs_trl.py                 # defaults: 4 layers, hidden 256, 8 x 8 x 16 tokens
    python benchmarks/grpo_vs_trl.py --only twinplane --json out.json
    python benchmarks/grpo_vs_trl.py --rounds 3      # both 3 times, alternating; medians of per-round ratios
    python benchmarks/grpo_vs_trl.py --only twinplane --share-prompts 0   # one prompt copy per sample (as TRL)

TRL is the optional `bench` extra: `pip install -e .[bench]`; without it only twinplane runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
import warnings
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach the hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402

import twinplane  # noqa: E402
from twinplane.cluster import LocalPlanes  # noqa: E402
from twinplane.config import AlgoSection, TrainSection  # noqa: E402
from twinplane.controller import Controller  # noqa: E402
from twinplane.data.prompts import Prompt  # noqa: E402
from twinplane.data.tasks import ALPHABET, ArithmeticTask, PromptStream  # noqa: E402
from twinplane.platform import hardware, runtime  # noqa: E402
from twinplane.rewards import exact_int  # noqa: E402
from twinplane.rewards.runner import RewardRunner  # noqa: E402
from twinplane.rollout import RolloutEngine, SamplingParams  # noqa: E402
from twinplane.train import Reference, Trainer  # noqa: E402

PHASES = ("rollout", "reward", "ref", "train", "other")
LR, BETA, CLIP, TEMPERATURE, SEED = 1e-5, 0.04, 0.2, 1.0, 0


def build_checkpoint(args, out: str) -> None:
    tok = twinplane.build_char_tokenizer(ALPHABET)
    tok.save(out)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(SEED)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)


def summarize(steps: list[dict]) -> dict:
    """Median of the step time and of each phase over the measured steps."""
    out = {k: statistics.median(s[k] for s in steps) for k in ("step", *PHASES, "rollout_gflops") if k in steps[0]}
    out["step_times"] = [s["step"] for s in steps]
    return out


def run_twinplane(args, ckpt: str, batches) -> dict:
    model, tok = twinplane.load_model(ckpt), twinplane.load_tokenizer(ckpt)
    total = args.warmup_steps + args.steps
    engine = RolloutEngine(copy.deepcopy(model), tok.eos_token_id, tok.pad_token_id, max_num_seqs=512, seed=SEED)
    train = TrainSection(lr=LR, micro_batch_size=args.prompts * args.samples, grad_clip=1.0,
                         share_prompts=bool(args.share_prompts))
    trainer = Trainer(model, train, AlgoSection(kl_coef=BETA, kl_estimator="k3", clip_low=CLIP, clip_high=CLIP),
                      temperature=TEMPERATURE, total_steps=total)
    reference = Reference(copy.deepcopy(model), TEMPERATURE, micro_batch_size=args.prompts * args.samples,
                          train=train)
    sampling = SamplingParams(temperature=TEMPERATURE, max_new_tokens=args.new_tokens,
                              min_new_tokens=args.new_tokens, n=args.samples)
    controller = Controller(LocalPlanes(engine, trainer, reference), RewardRunner("exact_int"), tok, sampling,
                            mini_batches=1, recompute_old_logprobs=False)
    steps = []
    for i, problems in enumerate(batches):
        t0 = time.perf_counter()
        m = controller.step([Prompt(tok.encode(p.prompt), p.answer, p.prompt) for p in problems])
        if m["rollout/response_length_mean"] != args.new_tokens or m["rollout/response_length_max"] != args.new_tokens:
            raise RuntimeError(f"twinplane responses were not all {args.new_tokens} tokens")
        s = {"step": time.perf_counter() - t0, "rollout": m["time/rollout"], "reward": m["time/reward"],
             "ref": m["time/ref_logprob"], "train": m["time/train"], "rollout_gflops": m["perf/tflops_rollout"] * 1e3}
        s["other"] = s["step"] - sum(s[k] for k in ("rollout", "reward", "ref", "train"))  # weight sync, collate
        if i >= args.warmup_steps:
            steps.append(s)
    return summarize(steps)


def run_trl(args, ckpt: str, batches, workdir: str) -> dict:
    import datasets
    import trl

    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecations inside TRL/transformers
    datasets.disable_progress_bars()
    problems = [p for b in batches for p in b]
    dataset = datasets.Dataset.from_dict({"prompt": [p.prompt for p in problems],
                                          "answer": [p.answer for p in problems]})

    def exact_int_reward(prompts, completions, answer, completion_ids, **kwargs) -> list[float]:
        if any(len(c) != args.new_tokens for c in completion_ids):  # same work as twinplane, or no comparison
            raise RuntimeError(f"TRL lengths {sorted({len(c) for c in completion_ids})} != {args.new_tokens}")
        return exact_int(completions, answer)

    per_step = args.prompts * args.samples
    fields = trl.GRPOConfig.__dataclass_fields__  # transformers 5 renamed gradient_ to activation_checkpointing
    no_checkpointing = {"activation_checkpointing" if "activation_checkpointing" in fields
                        else "gradient_checkpointing": False}  # TRL defaults it on; twinplane never recomputes
    config = trl.GRPOConfig(
        output_dir=workdir, per_device_train_batch_size=per_step, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=args.samples, num_iterations=1,
        max_completion_length=args.new_tokens, generation_kwargs={"min_new_tokens": args.new_tokens},
        temperature=TEMPERATURE, top_p=1.0, top_k=0, beta=BETA, epsilon=CLIP, epsilon_high=CLIP,
        loss_type="dapo", scale_rewards="group", learning_rate=LR, lr_scheduler_type="constant",
        optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0, **no_checkpointing,
        use_vllm=False, use_cpu=True, bf16=False, fp16=False, report_to=[], logging_steps=1,
        save_strategy="no", max_steps=args.warmup_steps + args.steps, shuffle_dataset=False, seed=SEED,
        dataloader_num_workers=0, disable_tqdm=True, model_init_kwargs={"dtype": torch.float32})
    trainer = trl.GRPOTrainer(model=ckpt, reward_funcs=exact_int_reward, args=config, train_dataset=dataset,
                              processing_class=transformers.AutoTokenizer.from_pretrained(ckpt))
    trainer.remove_callback(transformers.PrinterCallback)  # no per-step log dicts on stdout
    torch.set_num_threads(args.threads)

    acc = defaultdict(float)  # seconds per phase within the current step

    def timed(name: str, phase: str, when=lambda a: True) -> None:
        fn = getattr(trainer, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if when(a):
                    acc[phase] += time.perf_counter() - t0

        setattr(trainer, name, wrapper)

    timed("_generate", "rollout")
    timed("_calculate_rewards", "reward")
    timed("_get_per_token_logps_and_entropies", "ref", lambda a: a[0] is trainer.ref_model)
    timed("_generate_and_score_completions", "prepare")
    steps, ends = [], []  # ends: on_step_end times, whose gaps add data loading and logging to the step

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            acc.clear()
            acc["t0"] = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            s = {"step": time.perf_counter() - acc["t0"], **{k: acc[k] for k in ("rollout", "reward", "ref")}}
            s["train"] = s["step"] - acc["prepare"]
            s["other"] = acc["prepare"] - s["rollout"] - s["reward"] - s["ref"]  # tokenize, advantages, metrics
            if state.global_step > args.warmup_steps:
                steps.append(s)
            ends.append(time.perf_counter())

    trainer.add_callback(StepTimer())
    trainer.train()
    if len(steps) != args.steps:
        raise RuntimeError(f"TRL ran {len(steps)} measured steps, expected {args.steps}")
    gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)][max(args.warmup_steps - 1, 0):]
    return summarize(steps) | {"step_end_to_end": statistics.median(gaps) if gaps else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in [("layers", 4), ("hidden", 256), ("heads", 4), ("intermediate", 1024), ("prompts", 8),
                          ("samples", 8), ("new-tokens", 16), ("steps", 20), ("warmup-steps", 3), ("threads", 2),
                          ("rounds", 1), ("share-prompts", 1)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--only", choices=("both", "trl", "twinplane"), default="both")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    # What `twinplane train` does on CPU (glibc keeps freed memory); process-wide, so TRL runs with it too.
    runtime.tune_host_allocator()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    try:
        import trl
        trl_version = trl.__version__
    except ImportError:
        trl_version = None
        if args.only != "twinplane":
            print("TRL is not installed (pip install -e .[bench]): running twinplane only")
    stream = PromptStream(ArithmeticTask(digits=2, heldout_size=100, seed=SEED).train_problems(), seed=SEED)
    batches = [stream.next_batch(args.prompts) for _ in range(args.warmup_steps + args.steps)]

    rounds = []  # per round {framework: summary}; the order alternates so that a drifting machine load hits both
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "model")
        build_checkpoint(args, ckpt)
        runners = {"twinplane": lambda: run_twinplane(args, ckpt, batches),
                   "TRL": lambda: run_trl(args, ckpt, batches, os.path.join(tmp, "trl"))}
        chosen = [n for n in runners if args.only in ("both", n.lower()) and (n != "TRL" or trl_version)]
        for r in range(args.rounds):
            rounds.append({n: runners[n]() for n in (chosen if r % 2 == 0 else chosen[::-1])})
    results = {n: {k: statistics.median(rd[n][k] for rd in rounds) if isinstance(rounds[0][n][k], float)
                   else rounds[-1][n][k] for k in rounds[0][n] if rounds[0][n][k] is not None}
               for n in chosen}

    tokens = args.prompts * args.samples * args.new_tokens
    info = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl_version,
                         "twinplane": twinplane.__version__},
            "threads": torch.get_num_threads(), "shapes": {k: v for k, v in vars(args).items() if k != "json"},
            "completion_tokens_per_step": tokens, "trl_loss_type": "dapo"}
    print(" ".join(f"{k}={v}" for k, v in info["versions"].items()), f"threads={info['threads']}")
    print(f"Llama {args.layers}L h{args.hidden} heads{args.heads} ffn{args.intermediate}; {args.prompts} prompts x "
          f"{args.samples} samples x {args.new_tokens} tokens/step; {args.steps} steps after {args.warmup_steps} "
          f"warmup; beta={BETA} lr={LR} fp32; TRL loss_type=dapo, scale_rewards=group")
    print(f"{'framework':<10} {'step s':>8} " + " ".join(f"{k:>8}" for k in PHASES) + f" {'tok/s':>8}")
    for name, r in results.items():
        r["completion_tokens_per_s"] = tokens / r["step"]
        print(f"{name:<10} {r['step']:8.3f} " + " ".join(f"{r[k]:8.3f}" for k in PHASES)
              + f" {r['completion_tokens_per_s']:8.0f}")
    if results.get("TRL", {}).get("step_end_to_end"):
        print(f"(TRL on_step_end-to-on_step_end median, incl. data loading + logging: "
              f"{results['TRL']['step_end_to_end']:.3f} s)")
    if len(results) == 2:  # per round (side by side), then their median
        step = [rd["twinplane"]["step"] / rd["TRL"]["step"] for rd in rounds]
        rollout = [rd["TRL"]["rollout"] / rd["twinplane"]["rollout"] for rd in rounds]
        info |= {"ratio_twinplane_over_trl": statistics.median(step), "ratio_per_round": step,
                 "rollout_speedup_over_trl": statistics.median(rollout), "rollout_speedup_per_round": rollout}
        print(f"ratio twinplane/TRL = {info['ratio_twinplane_over_trl']:.2f}; rollout phase "
              f"{info['rollout_speedup_over_trl']:.2f}x faster than TRL's"
              + (f" (medians of {len(rounds)} rounds: step ratios {' '.join(f'{x:.2f}' for x in step)}, rollout "
                 f"{' '.join(f'{x:.2f}x' for x in rollout)})" if len(rounds) > 1 else ""))
    if "twinplane" in results:  # the rollout phase against this machine's GEMM rate (what `twinplane doctor` shows)
        gemm = hardware.measure_cpu_flops() / 1e9 if not torch.cuda.is_available() else None
        info["gemm_gflops"], rate = gemm, results["twinplane"]["rollout_gflops"]
        if gemm:
            print(f"twinplane rollout phase: {rate:.1f} GFLOP/s = {rate / gemm:.0%} of the fp32 GEMM rate "
                  f"({gemm:.0f} GFLOP/s, best of 5 1024^3)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info | {"results": results, "rounds": rounds}, f, indent=2)


if __name__ == "__main__":
    main()
