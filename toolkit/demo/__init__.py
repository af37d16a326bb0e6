"""`dsmt demo` (`run`), the files it leaves (`files`), and the tiny random checkpoints it and the tests build (`tiny`, `tiny_encoder`)."""
