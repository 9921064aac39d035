"""The recorder's ATen level: every ATen call on a deferred tensor (and, inside ``meta_init``,
every factory call) becomes records of the storages it creates, reads and writes.

``triage.handle_op`` is the entry: it sends each op down one path, each a module named after its
job: ``views`` (aliasing), ``fills``, ``recipes`` (factory calls seen before), ``value_reads``
(ops that need exact values now), ``whole_calls`` (a torch-level call as one op) and
``record_op`` (every other op: ``metadata``, ``dtypes``, ``inputs``, ``random_ops``), with
``file_memory`` for memory-mapped files. The modules import each other directly: this package
has no face of its own.
"""
