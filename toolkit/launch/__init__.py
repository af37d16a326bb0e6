"""Starting ranks: local workers (`local`: torchrun, or a plugged rank runner), who speaks (`rank_output`), run locks,
heartbeats and the job watch, the node-side probe of `dsmt preflight` (`preflight_probe`; the command itself is
toolkit/check/preflight.py) and `dsmt env`.

(The launch templates of `dsmt generate` are the repository's top-level launch/ folder.)"""
