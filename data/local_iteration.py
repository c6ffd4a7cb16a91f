"""StreamingDataset whose iteration skips streaming's download threads when there is nothing to
download.

Streaming iterates an epoch with two background threads per DataLoader worker: one downloads shards
ahead, one waits for them, and the sample loop polls both every 7 ms (streaming's TICK). When every
stream has no remote (`data.train.local` only: a set on local disk or a mounted file system), the
threads find every shard in place and only poll, which still costs the worker's one core the GIL
hand-overs: 0.37-0.39 ms of a 512x384 JPEG sample's 2.8-3.3 ms here (bench/loader.py's data, best of
5, in and out of a DataLoader worker; docs/benchmarks.md). Then the sample ids come from the same
call as streaming's own `__iter__` (`_get_work`: the same order, shuffle, elastic partition and
mid-epoch resume) and each sample is read directly. A shard that is missing or still compressed
goes through `get_item`'s own `prepare_shard` as before, in the loop instead of ahead of it.

Written against mosaicml-streaming 0.13.0 (pinned): `__iter__` mirrors its set-up steps;
tests/test_local_iteration.py checks the order against streaming's own iteration.
"""

from collections.abc import Iterator
from typing import Any

from streaming import StreamingDataset


class LocalFirstStreamingDataset(StreamingDataset):
    # False: always streaming's threaded iteration (the test compares the two).
    iterate_local_directly = True

    def _all_local(self) -> bool:
        return all(stream.remote in (None, stream.local) for stream in self.streams)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not (self.iterate_local_directly and self._all_local()):
            yield from super().__iter__()
            return
        if hasattr(self, "_iterator"):  # a threaded epoch before this one: stop its threads
            self._iterator.exit()
        # streaming 0.13's __iter__ up to its threads: workers, resume state or next epoch, ids.
        self._unique_worker_world = self._unique_rank_world.detect_workers()
        self._parallel_worker_world = self._parallel_rank_world.detect_workers()
        epoch, sample_in_epoch = self._resume_incr_epoch()
        for sample_id in self._get_work(epoch, sample_in_epoch):
            if sample_id != -1:  # streaming's padding where a partition is short
                yield self[sample_id]
