"""The model level copies the model for its side-by-side runs only where two more copies fit in memory."""

import torch

from kvzap_export.validate.model_level import room_for_copies


def test_a_small_model_is_copied_and_a_huge_one_is_not():
    assert room_for_copies(torch.nn.Linear(4, 4), 2)
    huge = torch.nn.Linear(1 << 20, 1 << 20, device="meta")  # 4 TiB of float32 weights, none allocated
    assert not room_for_copies(huge, 2)


def test_unknown_memory_means_no_copies(monkeypatch):
    import builtins

    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: (_ for _ in ()).throw(OSError("no /proc"))
                        if path == "/proc/meminfo" else real_open(path, *a, **k))
    assert not room_for_copies(torch.nn.Linear(4, 4), 2)
