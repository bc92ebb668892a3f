"""The pieces of ``scripts/sglang_gpu/build_engine.py``, which packs SGLang 0.5.23 for the GPU machines that have no
network (see that script's docstring): the requirement closure against the GPU image (``closure``), the trimmed
SGLang tree (``trim``), and the bundle's files, manifest and installer (``layout``).

A maintenance tool of this repository, not part of the ``kvzap_export`` package.
"""
