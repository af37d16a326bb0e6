"""The checks of a job, above everything they check: `dsmt check` (the spec's rules, its model, its data), the dry
run and pre-launch pass of `dsmt train`, `dsmt preflight`; what they return is a `CheckedJob`
(toolkit/spec/checked.py) that the runners below take."""
