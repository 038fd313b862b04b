"""What a rank hands torch.distributed, counted at the call (the real functions run): for tests of bytes per rank."""

from __future__ import annotations

import contextlib
import functools
import inspect
import pickle


@contextlib.contextmanager
def bytes_handed_to_torch_distributed(rank: int):
    """The bytes this rank hands torch.distributed to send while the block runs, as the sender of the call: tensors
    it sends (send, isend, the source of broadcast / scatter) and objects it sends (their pickles). Counted at the
    call, whatever the collective's algorithm then does on the wire; the real functions run."""
    import torch.distributed as dist

    handed: list[int] = []
    real = {name: getattr(dist, name) for name in ("send", "isend", "broadcast", "scatter", "scatter_object_list",
                                                    "broadcast_object_list")}

    def count(name, *args, **kwargs):
        bound = inspect.signature(real[name]).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if name in ("send", "isend"):
            handed.append(a["tensor"].numel() * a["tensor"].element_size())
        elif name == "broadcast" and a["src"] == rank:
            handed.append(a["tensor"].numel() * a["tensor"].element_size())
        elif name == "scatter" and a["src"] == rank:
            handed.extend(t.numel() * t.element_size() for t in a["scatter_list"])
        elif name == "scatter_object_list" and a["src"] == rank:
            handed.extend(len(pickle.dumps(o)) for o in a["scatter_object_input_list"])
        elif name == "broadcast_object_list" and a["src"] == rank:
            handed.extend(len(pickle.dumps(o)) for o in a["object_list"])
        return real[name](*args, **kwargs)

    for name in real:
        setattr(dist, name, functools.partial(count, name))
    try:
        yield handed
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
