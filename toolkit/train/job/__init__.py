"""The run around the engine: `dsmt train`'s CLI and launcher, run directories, a rank's run, reports, validation and pretraining."""
