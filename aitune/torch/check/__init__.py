"""Check: a candidate's outputs against eager by value — the comparator, eager's references, probes beyond
the recorded samples, and the run-time guard after tuning."""
