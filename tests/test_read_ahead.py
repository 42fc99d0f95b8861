"""`ReadAhead` (items prepared in background threads, in order) and the batch runner's use of it."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from tests.batch.conftest import write_parquet
from vlm_catalog.read_ahead import ReadAhead


class CountingItems:
    """An iterator over 0, 1, ... (`stop`, or forever) that counts what was pulled and may raise at `fail_at`."""

    def __init__(self, stop: int | None = None, fail_at: int | None = None) -> None:
        self.stop, self.fail_at = stop, fail_at
        self.pulled = 0

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if self.pulled == self.fail_at:
            raise OSError(f"cannot read item {self.pulled}")
        if self.stop is not None and self.pulled >= self.stop:
            raise StopIteration
        self.pulled += 1
        return self.pulled - 1


def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def drain(read_ahead: ReadAhead) -> list:
    taken = []
    while (value := read_ahead.next()) is not None:
        taken.append(value)
    return taken


def test_items_come_back_prepared_in_their_order_whatever_the_threads_finish_first():
    rng = random.Random(0)
    delays = [rng.uniform(0, 0.004) for _ in range(60)]
    threads = set()

    def prepare(item: int) -> int:
        threads.add(threading.current_thread().name)
        time.sleep(delays[item])  # later items often finish first
        return item * 10

    with ReadAhead(range(60), prepare, depth=8, workers=3) as read_ahead:
        assert drain(read_ahead) == [item * 10 for item in range(60)]
        assert read_ahead.next() is None  # and stays so
    assert threading.current_thread().name not in threads  # prepared off the consumer's thread
    assert len(threads) > 1


def test_at_most_depth_items_are_read_and_not_yet_taken():
    items = CountingItems()  # endless: only the depth stops the reader
    with ReadAhead(items, lambda item: item, depth=3) as read_ahead:
        wait_until(lambda: items.pulled == 3)
        time.sleep(0.1)
        assert items.pulled == 3
        assert read_ahead.next() == 0
        wait_until(lambda: items.pulled == 4)
        time.sleep(0.1)
        assert items.pulled == 4
        assert [read_ahead.next() for _ in range(3)] == [1, 2, 3]


def test_a_reading_error_is_raised_where_its_item_would_be():
    with ReadAhead(CountingItems(stop=10, fail_at=4), lambda item: item, depth=2) as read_ahead:
        assert [read_ahead.next() for _ in range(4)] == [0, 1, 2, 3]
        with pytest.raises(OSError, match="cannot read item 4"):
            read_ahead.next()
        assert read_ahead.next() is None


def test_a_preparation_error_is_raised_for_its_item_alone():
    def prepare(item: int) -> int:
        if item == 2:
            raise ValueError("item 2 is broken")
        return item

    with ReadAhead(range(5), prepare, depth=2) as read_ahead:
        assert [read_ahead.next(), read_ahead.next()] == [0, 1]
        with pytest.raises(ValueError, match="item 2 is broken"):
            read_ahead.next()
        assert drain(read_ahead) == [3, 4]


def test_close_stops_a_reader_waiting_for_room_and_reads_nothing_more():
    items = CountingItems()
    read_ahead = ReadAhead(items, lambda item: item, depth=2)
    wait_until(lambda: items.pulled == 2)
    started = time.perf_counter()
    read_ahead.close()
    assert time.perf_counter() - started < 1.0
    assert not read_ahead._reader.is_alive()
    assert items.pulled == 2
    read_ahead.close()  # twice is harmless


def test_waiting_for_slow_preparation_is_counted():
    with ReadAhead(range(2), lambda item: time.sleep(0.05) or item, depth=1) as read_ahead:
        assert drain(read_ahead) == [0, 1]
        assert read_ahead.seconds_waiting >= 0.05


@pytest.mark.parametrize("depth, workers", [(0, 1), (1, 0)])
def test_sizes_below_one_are_refused(depth, workers):
    with pytest.raises(ValueError, match="must be at least 1"):
        ReadAhead([], lambda item: item, depth=depth, workers=workers)


@pytest.mark.parametrize("read_ahead", [2, 0])
def test_the_batch_runner_prepares_records_off_the_engine_thread(tmp_path: Path, read_ahead: int):
    """Prompts are processed in the read-ahead's threads (on the engine thread with read_ahead=0);
    the answers are the ones the engine gives to the same prompts added directly."""
    from tests.batch.conftest import sample_rows
    from vlm_catalog.batch.job import BatchSettings, build_engine, build_request_builder
    from vlm_catalog.batch.local import run_items
    from vlm_catalog.data.loader import load_catalogue

    dataset = write_parquet(tmp_path / "catalogue", sample_rows(6))
    settings = BatchSettings(dataset=dataset, out=tmp_path / "p.jsonl", max_tokens=80)
    engine = build_engine(settings)
    builder = build_request_builder(settings, engine.tokenizer)
    catalogue = load_catalogue(dataset)
    processing_threads = []
    process = engine.processor.process

    def recording_process(messages, *args, **kwargs):
        processing_threads.append(threading.current_thread())
        return process(messages, *args, **kwargs)

    engine.processor.process = recording_process
    lines = []
    try:
        stats = run_items(engine, builder, catalogue.items(), lines.append, window=2, read_ahead=read_ahead)
        assert len(processing_threads) == 6
        on_engine_thread = sum(thread is threading.current_thread() for thread in processing_threads)
        assert on_engine_thread == stats.records_prepared_on_engine_thread == (0 if read_ahead else 6)
        assert 0 < stats.seconds_waiting_before_first_step <= stats.seconds_waiting_for_records
        # the same records, prepared on this thread and added one window at a time, give the same answers
        direct = {}
        for item in catalogue.items():
            prompt = process(builder.messages(item.record))
            params, _ = builder.params(item.record, answer_room=engine.answer_room(prompt))
            direct[item.id] = engine.add_request(prompt, params, request_id=f"direct-{item.index}")
        texts = {}
        while engine.has_unfinished_requests():
            texts.update((output.request_id, output.text) for output in engine.step() if output.finished)
    finally:
        engine.close()
    assert sorted(line.id for line in lines) == sorted(direct)
    assert {line.id: line.response for line in lines} == {record_id: texts[direct[record_id]] for record_id in direct}


def test_records_join_at_most_read_ahead_per_step_and_failures_alone_do_not_end_the_run(tmp_path: Path):
    """With read_ahead=2 the engine gains at most 2 records per step while the window (8) fills;
    a run of unusable records longer than that (here the first 5) does not stop the rest."""
    from tests.batch.conftest import sample_rows
    from vlm_catalog.batch.job import BatchSettings, build_engine, build_request_builder
    from vlm_catalog.batch.local import run_items
    from vlm_catalog.data.loader import CatalogueItem, load_catalogue

    dataset = write_parquet(tmp_path / "catalogue", sample_rows(10))
    settings = BatchSettings(dataset=dataset, out=tmp_path / "p.jsonl", max_tokens=80)
    engine = build_engine(settings)
    builder = build_request_builder(settings, engine.tokenizer)
    broken = [CatalogueItem(100 + i, error=f"broken record {i}", kind="record") for i in range(5)]
    items = broken + list(load_catalogue(dataset).items())
    in_engine_before_step = []
    step = engine.step

    def watched_step():
        in_engine_before_step.append(len(engine.scheduler.running) + engine.num_waiting_requests)
        return step()

    engine.step = watched_step
    lines = []
    try:
        run_items(engine, builder, items, lines.append, window=8, read_ahead=2)
    finally:
        engine.close()
    assert len(lines) == 15
    assert sorted(line.error for line in lines if line.failure == "record") == [f"broken record {i}" for i in range(5)]
    assert sum(line.failure is None for line in lines) == 10
    gains = [after - before for before, after in zip([0, *in_engine_before_step], in_engine_before_step)]
    assert max(gains) <= 2
    # the first steps: the fifth broken record and the first good one, then two more each step
    assert in_engine_before_step[:4] == [1, 3, 5, 7]
