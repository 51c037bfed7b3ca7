"""The concrete cases strategies draw and ranks receive: small, picklable, readable reprs.

A case holds only plain values (tuples, ints, strings and the torch-free placements of
``specs.placements``). Every rank derives its tensors from ``seed``, so every rank sees the
same global input without drawing anything itself. One module per strategies module;
``call()`` spells the case as the call it stands for (the reproduction in failure messages).
"""
