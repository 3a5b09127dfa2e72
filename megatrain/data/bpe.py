"""A byte-level BPE tokenizer trained on local text (no hub), as a transformers fast tokenizer.

For examples, benchmarks and tests that need a real tokenizer directory (`save_pretrained`) without
downloading one; nothing in training depends on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# ChatML, as Qwen's tokenizers use it.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    specials: list[str] = CHATML_SPECIALS,
    chat_template: str = CHATML,
    pad: str | None = None,
) -> Any:
    """Train on `texts`; specials[0] is EOS, `pad` the padding token (default: EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials[0], pad_token=pad or specials[0])
    fast.chat_template = chat_template
    return fast
