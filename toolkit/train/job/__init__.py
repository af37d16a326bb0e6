"""The run around the engine: `dsmt train`'s CLI and dry run, run directories, the per-rank main, reports, validation and pretraining."""
