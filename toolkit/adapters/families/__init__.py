"""One file per model family; each registers itself on import (see toolkit/adapters/family.py)."""
