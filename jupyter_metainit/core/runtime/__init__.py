"""Services every stage shares: Ctrl-C handling, the lock, events, swapping tensor objects,
running real code with interception off, the thread pool, formatting, reading users' devices and
dtypes, and free memory. Nothing here knows deferred tensors."""
