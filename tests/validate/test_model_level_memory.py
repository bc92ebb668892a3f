"""The model level runs side by side, on copies of the model that share its weights, only where two more runs fit in memory."""

import torch

from kvzap_export.validate.model_level import room_for_runs_beside


def test_a_small_model_runs_side_by_side_and_a_huge_one_does_not():
    assert room_for_runs_beside(torch.nn.Linear(4, 4), 2)
    huge = torch.nn.Linear(1 << 20, 1 << 20, device="meta")  # 4 TiB of float32 weights, none allocated
    assert not room_for_runs_beside(huge, 2)


def test_unknown_memory_means_one_run_at_a_time(monkeypatch):
    from kvzap_export import resources

    monkeypatch.setattr(resources, "available_memory", lambda: None)
    assert not room_for_runs_beside(torch.nn.Linear(4, 4), 2)


def test_the_runs_must_fit_in_half_of_what_the_process_can_still_get(monkeypatch):
    from kvzap_export import resources

    model = torch.nn.Linear(1000, 1000, bias=False)  # 4 MB of float32
    monkeypatch.setattr(resources, "available_memory", lambda: 16_000_000)  # e.g. a container's cgroup limit
    assert room_for_runs_beside(model, 2)  # 8 MB <= 8 MB
    monkeypatch.setattr(resources, "available_memory", lambda: 15_999_998)
    assert not room_for_runs_beside(model, 2)


def test_copies_share_the_parameters_and_nothing_else():
    from kvzap_export.validate.model_level import model_copies

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))  # parameters and buffers
    model[0].register_forward_hook(lambda *_: None)
    copies = model_copies(model, 2)
    assert len(copies) == 2 and all(c is not model and c[0] is not model[0] for c in copies)
    for copy in copies:
        assert len(list(copy.parameters())) == len(list(model.parameters())) == 4
        assert all(a is b for a, b in zip(copy.parameters(), model.parameters()))
        assert not any(a is b for a, b in zip(copy.buffers(), model.buffers()))  # a forward may write a buffer
    copies[0][0].register_forward_hook(lambda *_: None)  # a hook on a copy stays on that copy
    assert (len(model[0]._forward_hooks), len(copies[0][0]._forward_hooks), len(copies[1][0]._forward_hooks)) == (1, 2, 1)
