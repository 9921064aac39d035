"""Services every stage shares: interrupts, the lock, events, swapping, walking, formatting."""
