"""FLUX.1 Kontext: Flux with reference-image tokens: instruction edits."""

TITLE = "FLUX.1 Kontext"
