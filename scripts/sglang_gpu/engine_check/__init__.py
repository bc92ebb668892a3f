"""The pieces of ``scripts/sglang_gpu/prepare_engine_check.py``, which prepares ``.gpu/engine-check/`` (what the SGLang
steps of ``scripts/gpu_check.sh`` run on a GPU machine without network): the folder's layout, the Llama-3.1-8B-shaped
config, the plugin's entry point for a checkout on PYTHONPATH and the size check (``layout``, pure), and the models and
bundles (``build``: the tiny models with kvpress's reference tokens, the dummy-weights bundle).

A maintenance tool of this repository (issue 57), not part of the ``kvzap_export`` package.
"""
