"""Thread counts follow the work: prefills on every core, decode steps on one."""

import torch

from kvzap_export.threads import SMALL_WORK, large_work_threads, prefill_threads, torch_threads


class _Recorder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, input_ids=None):
        self.seen.append(torch.get_num_threads())
        return input_ids


def test_prefill_forwards_use_every_core_and_decode_steps_one():
    model = _Recorder()
    with torch_threads(SMALL_WORK):
        with prefill_threads(model):
            model(input_ids=torch.zeros(2, 7, dtype=torch.long))  # a prefill of two sequences
            model(input_ids=torch.zeros(2, 1, dtype=torch.long))  # a decode step
            model(torch.zeros(1, 5, dtype=torch.long))  # positional input ids
        after = torch.get_num_threads()
        model(input_ids=torch.zeros(1, 9, dtype=torch.long))  # outside the block: the hook is gone
    assert model.seen == [large_work_threads(), SMALL_WORK, large_work_threads(), SMALL_WORK]
    assert after == SMALL_WORK
