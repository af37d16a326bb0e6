"""`dsmt demo` (`run`), the files it leaves (`files`), what its fine-tune learns (`learning`), its plan (`plan`),
and the tiny random checkpoints it and the tests build (`tiny`, `tiny_encoder`)."""
