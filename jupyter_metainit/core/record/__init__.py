"""Recording: the ``meta_init`` block, and every call on deferred tensors turned into records."""
