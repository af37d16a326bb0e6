"""Artifacts generated from a checked job spec: pure functions of (spec, layout), plus one atomic writer."""
