"""Training checkpoints (`checkpoints`) and the layout-free copy that resumes at another layout (`reshard`)."""
