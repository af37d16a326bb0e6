"""Helpers shared by the data tests (imported by name, like tests/spec_helpers.py)."""

from pathlib import Path

EXAMPLES = Path(__file__).parents[2] / "examples" / "data"  # the shipped tiny datasets

# A jinja template small enough to check by eye: "<u>content</u>" per message (first letter of the role),
# "<a>" as the generation prompt.
# The tiny tokenizer splits every character, so each character of the rendering is one token.
SIMPLE_TEMPLATE = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}</{{ m['role'][0] }}>{% endfor %}"
                   "{% if add_generation_prompt %}<a>{% endif %}")


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]
