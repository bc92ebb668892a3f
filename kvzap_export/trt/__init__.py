"""TensorRT: whether it can be used here (``availability``) and the engine builder (``builder``).

TensorRT is imported lazily, only inside functions, and only where it is present.
"""
