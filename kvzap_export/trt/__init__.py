"""TensorRT: the engine builder (``builder``). TensorRT itself is imported lazily, only when present."""
