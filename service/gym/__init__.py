"""A verifiable task gym for the learning demo: `tasks` (families, vocabulary, verifier,
episode layout) and `splits` (train / held-out / warm-start tasks, disjoint by content)."""
