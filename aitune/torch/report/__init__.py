"""Reports of a tune: candidate rows and tables (:mod:`.rows`), HTML pages (:mod:`.html`), terminal progress
(:mod:`.progress`) and the tuning data written while a tune runs (:mod:`.telemetry`)."""
