"""The reference system's ``aitune.torch.task`` package: :mod:`.profiling` (profiling configuration)."""
