"""The torch custom ops: CPU falls back to the reference, fake kernels serve torch.compile, errors are typed."""

import pytest
import torch

from kvzap_export.errors import InputError
from kvzap_export.kernels.torch_ops import kv_compaction, threshold_compaction
from kvzap_export.ops import compaction as reference
from tests.helpers import HostReads


def _inputs():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 50, generator=gen)
    scores[0, 1, 7] = float("nan")
    return scores, torch.tensor([50, 31])


def test_cpu_fallback_equals_reference():
    scores, lengths = _inputs()
    ref = reference.threshold_compaction(scores, lengths, 0.1, 8, 2)
    got = threshold_compaction(scores, lengths, 0.1, 8, 2)
    assert all(torch.equal(g, r) for g, r in zip(got, ref))
    keys, values = torch.randn(2, 3, 50, 16), torch.randn(2, 3, 50, 16)
    assert all(torch.equal(g, r) for g, r in zip(kv_compaction(keys, values, ref.indices),
                                                  reference.kv_compaction(keys, values, ref.indices)))


def test_ops_pass_torch_library_checks_and_compile():
    scores, lengths = _inputs()
    torch.library.opcheck(torch.ops.kvzap.threshold_compaction.default, (scores, lengths, 0.1, 8, 2))
    indices = reference.threshold_compaction(scores, lengths, 0.1, 8).indices
    torch.library.opcheck(torch.ops.kvzap.kv_compaction.default, (torch.randn(2, 3, 50, 4), torch.randn(2, 3, 50, 4), indices))
    compiled = torch.compile(lambda s, n: torch.ops.kvzap.threshold_compaction(s, n, 0.1, 8, 2), backend="eager", fullgraph=True)
    ref = reference.threshold_compaction(scores, lengths, 0.1, 8, 2)
    assert all(torch.equal(g, r) for g, r in zip(compiled(scores, lengths), ref))


def test_bad_input_is_a_typed_error():
    with pytest.raises(InputError, match="window must be in"):
        threshold_compaction(torch.zeros(1, 1, 4), torch.tensor([4]), 0.0, -1)
    with pytest.raises(InputError, match="keys and values"):
        kv_compaction(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 3), torch.zeros(1, 1, 4, dtype=torch.int32))


def test_lengths_are_not_read_back_when_known_valid():
    """check_lengths=False reads no value of lengths: meta tensors, which have none, go through to the fake kernel."""
    scores, lengths = torch.empty(2, 3, 50, device="meta"), torch.empty(2, dtype=torch.int32, device="meta")
    keep, counts, indices = threshold_compaction(scores, lengths, 0.1, 8, 2, check_lengths=False)
    assert keep.device.type == "meta" and keep.shape == (2, 3, 50) and counts.shape == (2, 3)
    with pytest.raises((RuntimeError, NotImplementedError)):  # the default validates, which needs the values
        threshold_compaction(scores, lengths, 0.1, 8, 2)
    scores, lengths = _inputs()
    with HostReads() as reads:
        got = threshold_compaction(scores, lengths, 0.1, 8, 2, check_lengths=False)
    assert reads.count == 0
    assert all(torch.equal(g, r) for g, r in zip(got, reference.threshold_compaction(scores, lengths, 0.1, 8, 2)))
