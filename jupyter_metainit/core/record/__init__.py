"""Recording: the ``meta_init`` block, and every call on deferred tensors turned into records.

Where to look:

* ``context`` — the ``meta_init`` block (the dispatch mode, what is patched while it runs);
* ``torch_functions`` — torch-function level: device arguments, whole calls, reads of data;
* ``dispatch/`` — ATen level: every op on a deferred tensor (``dispatch/triage.handle_op``
  states the rules replay relies on);
* ``graph`` — the records (``StorageRecord``, ``TensorRecord``, ``OpRecord``);
* ``tensor`` — ``DeferredTensor``; ``state`` — per-thread recording state;
* ``value_reader`` — the seam through which recording gets values (installed by replay).

The wiring below is the one place where ``DeferredTensor`` (defined in ``tensor``, which
imports nothing of the recorder) gets the handlers its ``__torch_dispatch__``,
``__torch_function__`` and ``.data`` setter call: this package imports both sides, so the
call from the tensor into the recorder shows in the import graph here, not hidden in a lower
module.
"""

from __future__ import annotations

from jupyter_metainit.core.record.dispatch.triage import handle_op
from jupyter_metainit.core.record.dispatch.views import set_data
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.record.torch_functions import handle_function

DeferredTensor.handle_op = staticmethod(handle_op)
DeferredTensor.handle_function = staticmethod(handle_function)
DeferredTensor.set_data = staticmethod(set_data)
