"""The model level copies the model for its side-by-side runs only where two more copies fit in memory."""

import torch

from kvzap_export.validate.model_level import room_for_copies


def test_a_small_model_is_copied_and_a_huge_one_is_not():
    assert room_for_copies(torch.nn.Linear(4, 4), 2)
    huge = torch.nn.Linear(1 << 20, 1 << 20, device="meta")  # 4 TiB of float32 weights, none allocated
    assert not room_for_copies(huge, 2)


def test_unknown_memory_means_no_copies(monkeypatch):
    from kvzap_export import resources

    monkeypatch.setattr(resources, "available_memory", lambda: None)
    assert not room_for_copies(torch.nn.Linear(4, 4), 2)


def test_copies_must_fit_in_half_of_what_the_process_can_still_get(monkeypatch):
    from kvzap_export import resources

    model = torch.nn.Linear(1000, 1000, bias=False)  # 4 MB of float32
    monkeypatch.setattr(resources, "available_memory", lambda: 16_000_000)  # e.g. a container's cgroup limit
    assert room_for_copies(model, 2)  # 8 MB <= 8 MB
    monkeypatch.setattr(resources, "available_memory", lambda: 15_999_998)
    assert not room_for_copies(model, 2)
