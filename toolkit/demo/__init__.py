"""`dsmt demo` (`run`), the files it leaves (`files`), what its fine-tune learns (`learning`), its plan (`plan`),
and the tiny random encoder checkpoint it and the tests build (`tiny_encoder`; the causal LM is toolkit/models/tiny.py)."""
