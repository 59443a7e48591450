"""Stage 1, record: calls bound to ``forward``, flattened, grouped into graphs, with their dynamic axes."""
