"""The job spec: one YAML/JSON file, typed sections, loaded and checked before anything is generated or launched.

`load_spec` turns a file (plus `--set` overrides) into a `JobSpec`; `run_checks` collects every cross-section
problem into one `Report`; `derive_layout` resolves the numbers every artifact is generated from.
"""
