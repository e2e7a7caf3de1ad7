r"""Multi-turn tool rollouts: generate, run the tool the model called, append its output, generate again.

The call format is the Hermes / Qwen2.5 / Qwen3 function-calling one that real instruct models are trained on.
For example the response

    The sum is <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>
    <tool_response>5</tool_response>, so the answer is 5.<eos>

is three segments: the model's turn 1 (loss_mask 1, up to and including `</tool_call>`), the tool's output
(loss_mask 0; the line break above is only layout) and the model's turn 2 (loss_mask 1).

- Generation stops at the encoded `call_end` (an engine stop sequence: many tokens for a char tokenizer, the one
  special token `</tool_call>` for Qwen). The text between the last `call_start` of that turn and `call_end` is
  parsed as JSON `{"name": str, "arguments": object | str}`. A string `arguments` is the tool's input itself; an
  object gives it under the tool's `parameter` key ("expression", "code"), or as its only entry.
- Malformed JSON, an unknown tool, a missing argument or a failing tool all become an "error: ..." tool output
  the model sees, and count as tool errors. The output (or error) is put into `output_template` (default
  `<tool_response>{output}</tool_response>`; only the literal `{output}` is substituted, so a chat model can
  wrap it in its role tokens, e.g. "<|im_end|>\n<|im_start|>user\n<tool_response>\n{output}\n</tool_response>
  <|im_end|>\n<|im_start|>assistant\n"), encoded, and appended with loss_mask 0 and log-prob 0.0.
- Tokens in, tokens out: each continuation's prompt is exactly prompt_ids + every token so far. The model's own
  tokens are decoded only to parse a call, never re-encoded, so the trainer scores the very sequence sampled.
- Budget: `sampling.max_new_tokens` caps the whole response, tool tokens included. A model turn or tool output
  that would pass it is cut there and the sample finishes with "length".
- At most `max_turns` model turns. A call made in the last allowed turn is not run (the model could not read the
  result); that sample finishes with "max_turns". Otherwise finish_reason is the engine's ("stop" / "length").
- Per sample: `loss_mask` (1 = model token, 0 = tool token; log-probs are 0.0 at tool tokens), `num_turns` (model
  generations), `num_tool_calls` (calls that were run, error replies included) and `num_tool_errors` (of those,
  the ones answered with an error). `multi_turn_metrics` averages them over a batch.

Every turn sends all live samples to ONE `engine.generate` call (n=1 each; the first turn uses `sampling.n`, so
samples come back request by request like the engine's), each continuation capped at what is left of its own
budget (the engine's per-request `max_new_tokens`), so no sample decodes past it. The engine is seeded once, on
the first turn, so a seeded rollout is reproducible.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from twinplane.rollout.engine import Sample
from twinplane.rollout.sampling import SamplingParams
from twinplane.rollout.tools import Tool, ToolResult
from twinplane.tokenizer import Tokenizer

# The engine's Sample already carries loss_mask / num_turns / num_tool_calls / num_tool_errors (a plain generation
# is one all-model turn), so the controller reads one type whether tools are on or not.
MultiTurnSample = Sample


class MultiTurnRollout:
    """Drives an engine (anything with `generate(prompts, SamplingParams) -> list[Sample]` that honours
    `stop_sequences`) through tool-calling turns. Tools of one turn run concurrently on `tool_workers` threads
    (the python tool spends its time waiting on a subprocess); use tool_workers=1 for tools that are not
    thread-safe."""

    def __init__(self, engine, tokenizer: Tokenizer, tools: dict[str, Tool], max_turns: int,
                 call_start: str = "<tool_call>", call_end: str = "</tool_call>",
                 output_template: str = "<tool_response>{output}</tool_response>", tool_workers: int = 8):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if "{output}" not in output_template:
            raise ValueError(f"output_template must contain {{output}}, got {output_template!r}")
        self.engine, self.tokenizer, self.tools, self.max_turns = engine, tokenizer, tools, max_turns
        self.call_start, self.call_end, self.output_template = call_start, call_end, output_template
        self.tool_workers = tool_workers
        self.call_end_ids = tokenizer.encode(call_end)
        if not self.call_end_ids:
            raise ValueError(f"call_end {call_end!r} encodes to no tokens")
        self._char_ids: dict[str, list[int]] = {}

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[MultiTurnSample]:
        budget, end = sampling.max_new_tokens, self.call_end_ids
        stops = [*sampling.stop_sequences, end]
        outs = self.engine.generate(prompts, replace(sampling, stop_sequences=stops))
        samples = [Sample(o.request_index, list(o.prompt_ids), [], [], "", o.weight_version, loss_mask=[], num_turns=0)
                   for o in outs]
        live = list(range(len(samples)))
        while True:
            calls: list[tuple[int, list[int]]] = []  # (sample, tokens of the turn that ended in a call)
            for i, o in zip(live, outs, strict=True):
                s, room = samples[i], budget - len(samples[i].token_ids)
                toks = o.token_ids[:room]
                s.token_ids += toks
                s.logprobs += o.logprobs[:room]
                s.loss_mask += [1] * len(toks)
                s.num_turns += 1
                reason = o.finish_reason if len(o.token_ids) <= room else "length"
                if reason == "stop" and len(toks) >= len(end) and toks[-len(end):] == end:
                    if s.num_turns < self.max_turns:
                        calls.append((i, toks))
                    else:
                        s.finish_reason = "max_turns"
                else:
                    s.finish_reason = reason
            results = self.run_calls([toks for _, toks in calls])
            live = []
            for (i, _), result in zip(calls, results, strict=True):
                s = samples[i]
                s.num_tool_calls += 1
                s.num_tool_errors += int(result.error)
                ids = self.encode(self.output_template.replace("{output}", result.output))
                room = budget - len(s.token_ids)
                if len(ids) >= room:  # no room left for the model to read it and answer
                    ids, s.finish_reason = ids[:room], "length"
                else:
                    live.append(i)
                s.token_ids += ids
                s.logprobs += [0.0] * len(ids)
                s.loss_mask += [0] * len(ids)
            if not live:
                return samples
            rooms = [budget - len(samples[i].token_ids) for i in live]
            cont = replace(sampling, n=1, max_new_tokens=max(rooms), min_new_tokens=0, seed=None, stop_sequences=stops)
            outs = self.engine.generate([samples[i].prompt_ids + samples[i].token_ids for i in live], cont, rooms)

    def run_calls(self, turns: list[list[int]]) -> list[ToolResult]:
        if len(turns) <= 1 or self.tool_workers <= 1:
            return [self._run_call(t) for t in turns]
        with ThreadPoolExecutor(min(self.tool_workers, len(turns))) as pool:
            return list(pool.map(self._run_call, turns))

    def _run_call(self, turn: list[int]) -> ToolResult:
        """Parse the call that ends `turn` and run it; every failure is an error result for the model."""
        text = self.tokenizer.decode(turn, skip_special_tokens=False)  # to parse only; never re-encoded
        stop = text.rfind(self.call_end)
        stop = len(text) if stop < 0 else stop
        start = text.rfind(self.call_start, 0, stop)
        if start < 0:
            return ToolResult(f"error: {self.call_end} without a preceding {self.call_start}", True)
        try:
            call = json.loads(text[start + len(self.call_start):stop])
        except json.JSONDecodeError as e:
            return ToolResult(f"error: tool call is not valid JSON ({e.msg})", True)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
            return ToolResult('error: a tool call must be {"name": ..., "arguments": ...}', True)
        tool = self.tools.get(call["name"])
        if tool is None:
            return ToolResult(f"error: unknown tool {call['name']!r}; available: {sorted(self.tools)}", True)
        args, key = call["arguments"], getattr(tool, "parameter", "")
        if isinstance(args, dict):
            args = args.get(key, next(iter(args.values())) if len(args) == 1 else None)
        if not isinstance(args, str):
            return ToolResult(f"error: {call['name']} takes a string argument {key!r}", True)
        try:
            return tool(args)
        except Exception as e:  # a tool bug must not take the whole rollout down
            return ToolResult(f"error: {call['name']} failed: {type(e).__name__}: {e}", True)

    def encode(self, text: str) -> list[int]:
        """Encode tool text; a tokenizer without byte fallback (the char tokenizer) cannot encode every
        character, so on failure encode character by character and turn the unencodable ones into '?'."""
        try:
            return self.tokenizer.encode(text)
        except Exception:
            return [t for ch in text for t in self._char(ch)]

    def _char(self, ch: str) -> list[int]:
        if ch not in self._char_ids:
            try:
                self._char_ids[ch] = self.tokenizer.encode(ch)
            except Exception:
                self._char_ids[ch] = self._char("?") if ch != "?" else []
        return self._char_ids[ch]


def multi_turn_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Per-batch means of the per-sample turn/tool counters, and the share of response tokens that are tool
    output (tokens that cost context but carry no gradient)."""
    n = max(len(samples), 1)
    tokens = sum(len(s.loss_mask) for s in samples)
    return {
        "rollout/turns_mean": sum(s.num_turns for s in samples) / n,
        "rollout/tool_calls_mean": sum(s.num_tool_calls for s in samples) / n,
        "rollout/tool_errors_mean": sum(s.num_tool_errors for s in samples) / n,
        "rollout/max_turns_reached": sum(s.finish_reason == "max_turns" for s in samples) / n,
        "rollout/tool_token_frac": sum(len(s.loss_mask) - sum(s.loss_mask) for s in samples) / max(tokens, 1),
    }
