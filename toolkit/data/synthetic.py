"""Token sequences for `data.synthetic: true`: no files, no tokenizer, still learnable.

Each example counts up from a random start with a random stride of 1, 2 or 3 (mod `vocab_size`), so after two
tokens the next one is determined: a tiny model's loss falls well below log(vocab_size) within a few dozen steps,
which shows a training loop works; random tokens would leave it flat.
"""

from __future__ import annotations

import torch

from toolkit.data.examples import Examples
from toolkit.errors import DsmtError

STRIDES = (1, 2, 3)


def synthetic_examples(*, vocab_size: int, seq_length: int, num_examples: int, seed: int) -> Examples:
    """`num_examples` arithmetic sequences of `seq_length + 1` ids in `[0, vocab_size)`, every label counted."""
    problems = [f"{name}={value} must be >= {low}" for name, value, low in
                (("vocab_size", vocab_size, 4), ("seq_length", seq_length, 1), ("num_examples", num_examples, 1))
                if value < low]
    if problems:
        raise DsmtError("synthetic data: " + "; ".join(problems))
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab_size, (num_examples, 1), generator=generator)
    strides = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (num_examples, 1), generator=generator)]
    token_ids = (starts + strides * torch.arange(seq_length + 1)) % vocab_size
    return Examples(token_ids=token_ids.to(torch.int64), loss_mask=torch.ones(num_examples, seq_length),
                    kind="synthetic")
