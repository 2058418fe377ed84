"""The Expert protocol: what every expert the model routes to offers.

The forward pass (pipeline.py, reference.py) and residency read an expert only through
these fields, whatever its kind:

- model.weights.ModelExpert: the model's own, views into its mapped
  expert_{layer}_{index}.bin (made by load_model, so it stays with the weights: model/
  imports nothing of experts/);
- expertcache.CopyInExpert: a model expert read into a frame of the budget's cache;
- expertset.HotSlot: a hot-plugged expert (hotplug.HotExpert, itself made from a checked
  file, hotplug.LoadedExpert) placed in a router slot of a layer.

`ffn` holds INT4 weights our kernels run; when it is None the expert computes itself with
`forward(x, out)` (a hot-plugged .so's ffn_forward). `address` / `nbytes` locate its
weights in memory (traces, the expert_prefetch hook); 0 when there are none.
"""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

from ..model.weights import FFNWeights


@runtime_checkable
class Expert(Protocol):
    """What the model reads from an expert (the module docstring)."""

    layer: int          # global layer index
    index: int          # its router slot in that layer
    ffn: Optional[FFNWeights]

    @property
    def name(self) -> str: ...          # modelfile.expert_name(layer, index)

    @property
    def address(self) -> int: ...

    @property
    def nbytes(self) -> int: ...
