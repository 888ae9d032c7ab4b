"""The FakeTensorMode the profile and the simulated steps measure storages in.

FakeTensorMode's dispatch cache rebuilds each output of a cached op on a
storage of its own, where the kernel may return one tensor twice:
``mkldnn_rnn_layer_backward`` returns its bias gradient as both ``b_ih``'s
and ``b_hh``'s, so from the second profile in a process on (a cache hit), an
LSTM's backward held 512 B more per layer than the kernel allocates, and plans
of recurrent models depended on what ran before them. Here an op returning
several tensors runs uncached once per process; where its outputs share a
storage it is never cached, otherwise the cache serves it as before (the
cost of bypassing every such op: ResNet's profile 1.6x slower warm)."""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

#: Ops returning several tensors that ran uncached once, process-wide...
_CHECKED: set = set()
#: ... and of those, the ones whose outputs shared a storage.
_SHARING: set = set()


class StorageFaithfulFakeMode(FakeTensorMode):
    """A FakeTensorMode whose outputs share the storages the kernels' do."""

    def _cached_dispatch_impl(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func in _SHARING:
            return self._dispatch_impl(func, types, args, kwargs)
        if func not in _CHECKED and _returns_several(func):
            output = self._dispatch_impl(func, types, args, kwargs)
            _CHECKED.add(func)
            if _shares_a_storage(output):
                _SHARING.add(func)
            return output
        return super()._cached_dispatch_impl(func, types, args, kwargs)


def _returns_several(func: Any) -> bool:
    return isinstance(func, torch._ops.OpOverload) and len(func._schema.returns) > 1


def _shares_a_storage(output: Any) -> bool:
    storages = [StorageWeakRef(t.untyped_storage()) for t in pytree.tree_leaves(output)
                if isinstance(t, torch.Tensor)]
    return len(set(storages)) < len(storages)
