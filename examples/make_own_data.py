"""Build a complete "your own data" example on a laptop, nothing downloaded:

  python examples/make_own_data.py runs/own-data
  megatrain-launch examples/own-data.yaml

writes runs/own-data/model/ (a small Llama saved with save_pretrained, with a byte-level BPE tokenizer
trained here and a ChatML chat template, exactly what a real checkpoint directory holds), and
runs/own-data/chat.jsonl and text.jsonl. The chat tasks are small word games (reverse, sort, repeat
the words) so that the loss on the assistant turns visibly falls within a few minutes on a CPU.
Point `model.pretrained` and `data.path` at your own model directory and JSONL file instead.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "maple",
    "ocean",
    "candle",
    "silver",
    "garden",
    "pepper",
    "rocket",
    "violet",
    "harbor",
    "falcon",
    "meadow",
    "copper",
    "lantern",
    "orange",
    "winter",
)
TASKS = {"reverse": lambda w: list(reversed(w)), "sort": sorted, "repeat": lambda w: w + w}


def conversation(rng: random.Random) -> dict:
    msgs = [{"role": "system", "content": "You play word games."}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):  # multi-turn: every assistant turn is learned
        task = rng.choice(sorted(TASKS))
        words = rng.sample(WORDS, rng.randint(2, 5))
        msgs += [
            {"role": "user", "content": f"{task}: {' '.join(words)}"},
            {"role": "assistant", "content": " ".join(TASKS[task](words))},
        ]
    return {"messages": msgs}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?", default="runs/own-data")
    p.add_argument("--conversations", type=int, default=4000)
    args = p.parse_args()
    out = Path(args.out)
    (out / "model").mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    chats = [conversation(rng) for _ in range(args.conversations)]
    (out / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    docs = [" ".join(m["content"] for m in c["messages"]) for c in chats]
    (out / "text.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatrain.data.bpe import CHATML, train_bpe

    tok = train_bpe(docs + [CHATML], 512)
    tok.save_pretrained(out / "model")
    conf = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(conf).save_pretrained(out / "model")
    print(
        f"wrote {out / 'model'} (model + tokenizer, {len(tok)} tokens), {out / 'chat.jsonl'} "
        f"({len(chats)} conversations) and {out / 'text.jsonl'}"
    )


if __name__ == "__main__":
    main()
