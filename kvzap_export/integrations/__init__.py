"""KVzap inside serving engines.

- ``core``: the engine-independent per-request state (pure torch, runs on the CPU): prefill, chunked
  prefill and decode transitions with kvpress's decisions, uniform-per-request selections, logical vs
  physical length. Everything an engine needs to decide lives here and is tested against kvpress.
- ``trtllm``: TensorRT-LLM PyTorch backend glue (scorer hook, KV-cache compression manager,
  1.2.x ``sparse_kv_predict`` variant).
- ``sglang``: SGLang 0.5.23 glue (plugin hooks, step-end eviction, flex-attention masking backend).

The engine modules import without their engine; using an engine-bound piece without the engine raises
``MissingDependencyError`` with one line. See docs/integrations.md.
"""
