"""Search: one candidate's path (build, check, measure), and what the search remembers across runs
(rankings, the build cache, crashing candidates)."""
