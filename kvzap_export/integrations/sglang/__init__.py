"""KVzap in SGLang 0.5.23 (``sglang.srt``), attached through SGLang's own extension points.

- ``api``: every SGLang name the glue relies on (checked against the real 0.5.23 source in CI);
- ``plugin``: the ``sglang.srt.plugins`` entry point, the hooks, and this process's runtime;
- ``server_setup``: the server flags each mode needs, checked when the scheduler is built;
- ``runtime``: scores by KV slot, one ``core.RequestState`` per request, the step end (evict / mask modes);
- ``masking``: mask mode's attention backends (``kvzap_native`` on any device, ``kvzap_flex`` on GPUs);
- ``stats``: allocator readings per request (``KVZAP_STATS``), what ``validate --engine sglang`` reports;
- ``driver``: runs prompts through a real ``sglang.Engine`` with the plugin (used by ``validate --engine sglang``).

Usage and the flags each mode needs: docs/integrations.md. Importing this package does not import SGLang.
"""
