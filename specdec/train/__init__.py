"""Training drafters: data, hidden-state extraction, training loops, speculators-format export."""
