"""Starting ranks: local workers (`local`), warm rank servers, who speaks (`rank_output`), `dsmt preflight` and `dsmt env`.

(The launch templates of `dsmt generate` are the repository's top-level launch/ folder.)"""
