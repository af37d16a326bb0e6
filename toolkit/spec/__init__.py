"""What a job is: one YAML/JSON file, typed sections (`schema`, `data_schema`), loaded and validated (`load`, with
`--set` overrides and paths pinned by `paths`), its layout and batch arithmetic (`layout`), and `CheckedJob`
(`checked`), what every runner takes once the checks above (toolkit/check/) pass. Imports nothing above the model
floors it names (models, adapters).
"""
