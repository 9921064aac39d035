"""Random numbers: where each recorded random op sits in its generator's stream, and exact fills."""
