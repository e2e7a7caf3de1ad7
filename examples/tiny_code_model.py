"""Write a tiny random model (printable-ASCII character tokenizer) and a toy stdin/stdout task file, to run the
code-RL pipeline end to end on a CPU with no download. A model this small, from scratch, writes no working
Python: every reward is 0. It exercises the loop (rollout -> sandboxed tests -> GRPO), not learning.

    python examples/tiny_code_model.py /tmp/tiny-code
    twinplane train examples/code_rl.yaml model.path=/tmp/tiny-code data.train_file=/tmp/tiny-code/toy.jsonl \\
        data.val_file=null data.template=plain train.steps=3 rollout.prompts_per_step=4 rollout.n=4 \\
        rollout.max_new_tokens=48 eval.before=false
"""

import json
import string
import sys
from pathlib import Path

import torch

from twinplane.model import ModelConfig, Transformer
from twinplane.run.prepare import save_hf_folder
from twinplane.tokenizer import build_char_tokenizer


def main(out: Path) -> None:
    tok = build_char_tokenizer(string.printable + "".join(map(chr, range(0xA0, 0x2800))))  # HumanEval has ≤ and ➞
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    save_hf_folder(Transformer(cfg), tok, out)
    rows = [{"prompt": f"# print {a} + {b}\n", "inputs": [""], "outputs": [str(a + b)]}
            for a in range(8) for b in range(8)]
    (out / "toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out} and {out / 'toy.jsonl'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
