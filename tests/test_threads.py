"""Thread counts follow the work: prefills on every core, decode steps on one; independent runs side by side."""

import os
import signal
import threading
import time

import pytest
import torch

from kvzap_export import threads
from kvzap_export.threads import SMALL_WORK, Stopped, large_work_threads, prefill_threads, side_by_side, stop_point, torch_threads


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


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)  # the threaded path even on a 1-CPU runner


def test_side_by_side_jobs_run_in_their_own_threads_on_their_share_of_the_cores(two_cores):
    seen, caller = [], torch.get_num_threads()

    def job(number):
        def run(stop):
            seen.append((threading.current_thread() is not threading.main_thread(), large_work_threads(),
                         torch.get_num_threads()))
            return number * 10
        return run

    with torch_threads(2):
        assert side_by_side([job(1), job(2), job(3)]) == [10, 20, 30]  # results in the jobs' order
        after = torch.get_num_threads()
    assert seen == [(True, 1, SMALL_WORK)] * 3  # 2 cores // 3 jobs -> one each, torch on one thread
    assert after == 2 and torch.get_num_threads() == caller  # the caller's thread count is its own
    assert large_work_threads() == 2  # outside a job: every core


def test_side_by_side_prefills_use_the_jobs_share(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    model = _Recorder()

    def run(stop):
        with prefill_threads(model):
            model(input_ids=torch.zeros(1, 7, dtype=torch.long))
            model(input_ids=torch.zeros(1, 1, dtype=torch.long))
        return model.seen[-2:]

    assert side_by_side([run, lambda stop: None]) == [[2, SMALL_WORK], None]  # 4 cores, 2 jobs: a prefill on 2


def test_a_failing_job_stops_the_others_and_its_own_error_is_raised(two_cores):
    ended = []

    def failing(stop):
        time.sleep(0.05)
        raise ValueError("bad input")

    def long_running(stop):
        try:
            for _ in range(1000):  # 10 s unless stopped
                stop_point(stop)
                time.sleep(0.01)
        finally:
            ended.append(threading.current_thread().name)

    start = time.monotonic()
    with pytest.raises(ValueError, match="bad input"):  # not the Stopped it caused in the other job
        side_by_side([long_running, failing])
    assert len(ended) == 1 and time.monotonic() - start < 5  # the other job stopped, and had ended before the raise
    assert not [t for t in threading.enumerate() if t.name.startswith("kvzap-side-by-side")]


def test_an_interrupt_stops_every_job_before_it_propagates(two_cores):
    stopped = []

    def job(stop):
        try:
            for _ in range(1000):
                stop_point(stop)
                time.sleep(0.01)
        except Stopped:
            stopped.append(1)
            raise

    def interrupting(stop):
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the caller waits for the jobs
        return job(stop)

    # Python turns SIGINT into KeyboardInterrupt only where it was not ignored at start (a background job of a
    # non-interactive shell starts with it ignored): install that handler for this test.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            side_by_side([job, interrupting])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stopped == [1, 1]


def test_every_failure_is_told_the_first_jobs_raised_the_others_noted(two_cores):
    def failing(message, delay):
        def run(stop):
            time.sleep(delay)
            raise ValueError(message)
        return run

    with pytest.raises(ValueError, match="first job") as raised:  # job order, though the second failed earlier
        side_by_side([failing("first job", 0.05), failing("second job", 0.0)])
    assert "ValueError: second job" in "\n".join(getattr(raised.value, "__notes__", []))


def test_a_thread_that_starts_torch_after_the_jobs_gets_the_callers_thread_count(two_cores):
    """torch seeds a thread's first thread count from the last one any thread set (process-wide): the jobs set 1,
    the caller sets its own back."""
    seen = []
    with torch_threads(2):
        side_by_side([lambda stop: None] * 2)
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join()
    assert seen == [2]


def test_on_one_core_jobs_run_one_after_the_other_in_the_callers_thread(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 1)
    assert side_by_side([lambda stop: threading.current_thread() is threading.main_thread()] * 2) == [True, True]


def test_not_together_runs_one_after_the_other_in_the_callers_thread(two_cores):
    order = []

    def job(number):
        def run(stop):
            order.append((number, threading.current_thread() is threading.main_thread()))
            return number
        return run

    assert side_by_side([job(1), job(2)], together=False) == [1, 2]
    assert order == [(1, True), (2, True)]
