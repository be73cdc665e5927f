"""The family's shared byte-level BPE tokenizer, saved so that `AutoTokenizer.from_pretrained` loads it."""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 8192
EOS = "<|endoftext|>"  # also bos and pad: documents are separated by it in training
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]

# ChatML, the format the dialogue corpus is rendered in; generation stops at <|im_end|> or <|endoftext|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts_by_domain: dict[str, list[str]], out_dir: Path, seed: int = 0,
                    chars_per_domain: int = 2_000_000):
    """Train on an equal share of every domain so no domain is tokenised much worse than another."""
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    sample: list[str] = []
    for domain in sorted(texts_by_domain):
        texts = list(texts_by_domain[domain])
        rng.shuffle(texts)
        used = 0
        for t in texts:
            if used > chars_per_domain:
                break
            sample.append(t)
            used += len(t)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sample, trainer=trainer)

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS,
                                   unk_token=None, additional_special_tokens=[IM_START, IM_END])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 2048
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast
