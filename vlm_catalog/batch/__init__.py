"""The batch job behind `vlm-catalog extract`: a whole catalogue through the model, resumably.

- `output.py`   the results file: one line per record, flushed as it finishes; a lock
                against a second writer; resume (finished ids skipped, a torn last
                line repaired); every id exactly once.
- `selection.py` which records a run processes: `--shard I/N` by a stable hash of the
                record id, `--limit`, minus the ids already in the results file.
- `requests.py` a catalogue item to an engine request (per-record schema within the
                token budget), and an engine output to a result line with its failure kind.
- `progress.py` a tqdm bar on a terminal, periodic log lines otherwise; the counts.
- `local.py`    the single-process runner: a bounded window of requests in the engine.
- `ray_runner.py` the same over a Ray cluster with Ray Data (optional `[distributed]` extra).
- `job.py`      argument and output checks before any work, the run, the summary.
"""

from vlm_catalog.batch.job import BatchError, BatchSettings, BatchSummary, run_batch

__all__ = ["BatchError", "BatchSettings", "BatchSummary", "run_batch"]
