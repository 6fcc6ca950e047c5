"""The end-to-end benchmark's client processes (spawned): producers that submit with
`RolloutWriter` and trainer ranks that iterate `BatchLoader`.

Spawned processes unpickle these targets by module name: tests/bench, the entry script's
folder, is on their `sys.path` (spawn passes the parent's on)."""

from __future__ import annotations

import time

from e2e_cases import RANK_RETAINED_FREE_MIB, WORLD_SIZE, Case, Options, make_rows, warm_up_rows


def producer_main(
    case: Case,
    address: str,
    producer: int,
    options: Options,
    go,
    results,
    finished,
) -> None:
    from rlfeed.client.producer import RolloutWriter

    rows = make_rows(case, producer, options.producers)
    # Room for every row: a full writer buffer would seal a partial batch early, and the
    # raw stream could no longer carry the same batches (`writer_batches`). The writer
    # requires room for at least one full batch too (fewer rows than that: `--rollouts`).
    limits = case.writer_limits()
    writer = RolloutWriter(
        address,
        **limits,
        max_buffered_rollouts=max(len(rows), limits["max_batch_rollouts"]),
        max_in_flight=options.in_flight,
    )
    if options.warm_up:
        for row in warm_up_rows(rows):
            writer.write(**row)
        writer.flush()  # the timed rows then start a batch, as `writer_batches` splits them
    results.put(("ready", producer, None))
    go.wait()
    started = time.perf_counter()
    for row in rows:
        writer.write(**row)
    writer.close()
    results.put(("producer", producer, time.perf_counter() - started))
    # An inference server does not exit after its rollouts: stay up until the window ends,
    # so this process's teardown (a full GC of the interpreter) is not timed.
    finished.wait(timeout=600)


def trainer_main(case: Case, address: str, rank: int, options: Options, go, results) -> None:
    import torch
    from rlfeed.client.loader import BatchLoader

    # A trainer has torch loaded long before its first step: the import (seconds here) is
    # not the loader's cost. Counting the mask stands in for a model that runs elsewhere (a
    # GPU): one thread, so OpenMP workers spinning after each count do not take the cores the
    # sidecar, the producers and the other rank share on a small machine.
    torch.set_num_threads(1)

    first_timed = options.first_timed_step(case)
    loader = BatchLoader(
        address,
        rank,
        WORLD_SIZE,
        stop_step=first_timed + case.steps,
        timeout_s=300,
        retained_free_mib=RANK_RETAINED_FREE_MIB,
    )
    steps = iter(loader)
    for _ in range(first_timed):  # the warm-up pass: the same work, untimed
        sum(mb.policy_tokens for mb in next(steps))
    policy_tokens = 0
    results.put(("ready", rank, 0))
    go.wait()
    for step in steps:
        for mb in step:
            policy_tokens += mb.policy_tokens
    loader.close()
    results.put(("trainer", rank, (time.perf_counter(), policy_tokens)))
