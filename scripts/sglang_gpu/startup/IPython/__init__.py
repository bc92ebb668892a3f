"""kvzap-export's stand-in for IPython on the GPU machines (not IPython): SGLang 0.5.23's ``sglang/utils.py:25`` imports
``IPython.display.HTML`` and ``display`` at start, for notebook output only. ``display.py`` holds those two names."""
