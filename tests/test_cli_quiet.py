"""Quiet mode hides transformers' per-load bars ("Loading weights") whichever HF library a caller imported before
dsmt's main, and leaves them on when the user set HF_HUB_DISABLE_PROGRESS_BARS=0. A fresh interpreter each:
the libraries read the variable once, at their import."""

import os
import subprocess
import sys

import pytest

PROBE = """
{first}
from toolkit.cli import _hide_hf_progress_bars
_hide_hf_progress_bars()
import transformers.utils.logging
print(transformers.utils.logging.is_progress_bar_enabled())
"""


def _bars_enabled(*, first: str, user_value: str | None = None) -> bool:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    if user_value is not None:
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = user_value
    done = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env=env, capture_output=True,
                          text=True, check=True)
    return done.stdout.strip().splitlines()[-1] == "True"


HUB_LOADED = "import huggingface_hub.utils; huggingface_hub.utils.are_progress_bars_disabled()"  # hub loads lazily


@pytest.mark.parametrize("first", ["import os", HUB_LOADED, "import transformers.utils.logging"])
def test_bars_hidden_whatever_was_imported_first(first):
    assert not _bars_enabled(first=first)


def test_the_users_own_setting_wins():
    assert _bars_enabled(first=HUB_LOADED, user_value="0")
