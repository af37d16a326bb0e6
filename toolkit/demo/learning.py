"""What the demo's fine-tune teaches the tiny model, and how the demo shows that it learned: two sentences it can
memorise in a few dozen steps, and greedy samples from the HF checkpoints before and after the fine-tune
(transformers' `generate` on the files dsmt wrote: the random start, and the exported `train/final-hf`)."""

from __future__ import annotations

import json
from pathlib import Path

# Two sentences that differ from their 5th character on, so the prompt "the cat" or "the dog" decides the rest, and
# whose every character follows from the two before it ('k' is followed by 's' in "drinks" and by '.' in
# "milk."): the 4-layer, 64-wide character model of toolkit/models/tiny.py writes both after about 25 steps of
# `dsmt train` at lr 1e-2 with a quarter of them warm-up (the demo's 30 steps, seeds 0-3: loss 5.48 -> 0.19-0.25,
# both written; 40 steps: 0.06-0.08).
# A sentence with "the" twice ("the cat sat on the mat.") is learned more slowly: after "the " only the words
# further back tell "cat" from "mat".
SENTENCES = ("the cat drinks milk.", "the dog eats bones.")
PROMPTS = tuple(sentence[:len("the cat")] for sentence in SENTENCES)
RECORDS = 64  # written to the file; the loader cycles through them (30 steps x 8 rows x 65 tokens read ~750)
MAX_NEW_TOKENS = 24  # longer than any continuation (13 characters and EOS), so a model that has not learned rambles


def write_data(path: Path) -> Path:
    """The fine-tune's records, {"text": SENTENCE} per line, the sentences alternating."""
    lines = [json.dumps({"text": SENTENCES[i % len(SENTENCES)]}) for i in range(RECORDS)]
    path.write_text("\n".join(lines) + "\n")
    return path


def samples(model_dir: Path) -> list[str]:
    """Each prompt continued greedily by the HF checkpoint in `model_dir` (special tokens dropped: generation stops
    at EOS, which ends every training record)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=False).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    texts = []
    for prompt in PROMPTS:
        encoded = tokenizer(prompt, return_tensors="pt")
        generated = model.generate(**encoded, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                   pad_token_id=tokenizer.eos_token_id)
        texts.append(tokenizer.decode(generated[0], skip_special_tokens=True))
    return texts


def writes_sentences(texts: list[str]) -> bool:
    """Whether each sample is its prompt's training sentence, and nothing after it."""
    return [text.strip() for text in texts] == list(SENTENCES)


def comparison_lines(*, before: list[str], after: list[str]) -> list[str]:
    """Per prompt, what the model wrote before the fine-tune and, on the line below, after it."""
    return [f"  {prompt!r:9s} before: {old!r}\n  {'':9s} after:  {new!r}" for prompt, old, new in
            zip(PROMPTS, before, after)]
