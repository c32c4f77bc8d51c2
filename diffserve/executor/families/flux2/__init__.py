"""FLUX.2: FLUX.2 [dev] and [klein]: edits with reference images."""

TITLE = "FLUX.2"
