"""The base layer: helpers every stage uses (argument checks, dtype names, strict JSON, environment facts,
file digests and confinement, optional-package requirements, renamed names). It imports nothing else of aitune."""
