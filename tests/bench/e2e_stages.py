"""The end-to-end benchmark's `--stages`: each stage of one step timed alone, in this
one process, on the case's data (client encode, server decode + validate, plan +
materialize + encode, client decode)."""

from __future__ import annotations

import time

from e2e_cases import CASES, WORLD_SIZE, Case, make_rows, writer_batches


def _best(function, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def run_stages(case: Case) -> None:
    """Seconds per MiB of ingest payload for each stage of one step, each timed alone."""
    from rlfeed.client.arrow_codec import (
        RolloutColumns,
        decode_step,
        encode_rollout_batch,
        parse_get_batch_response,
    )
    from rlfeed.service.codec.materialize import materialize_work
    from rlfeed.service.codec.messages import decode_rollout_batch, parse_rollout_batch
    from rlfeed.service.codec.rollout_batch import batch_meta
    from rlfeed.service.codec.validation import validate_rollout_batch
    from rlfeed.service.config import SidecarConfig, with_overrides
    from rlfeed.service.scheduler.state import Scheduler

    per_step = case.prompts_per_step * case.group_size
    step_case = Case(case.name, case.tokens, per_step, *CASES[case.name][2:])
    batches = writer_batches(case, make_rows(step_case, 0, 1))
    config = with_overrides(
        SidecarConfig(),
        batching={"token_budget": case.token_budget, "world_size": WORLD_SIZE},
        rollouts={"prompts_per_step": case.prompts_per_step, "group_size": case.group_size},
    )

    def encode_all() -> list[bytes]:  # what RolloutWriter sends, rows appended anew each time
        out = []
        for sequence, batch in enumerate(batches):
            columns = RolloutColumns.empty()
            for row in batch:
                columns.append(**row)
            out.append(encode_rollout_batch(columns, sequence))
        return out

    wire = encode_all()
    mib = sum(map(len, wire)) / (1 << 20)

    def decode_validate():
        out = []
        for request in wire:
            arrays = decode_rollout_batch(parse_rollout_batch(request).arrow_ipc)
            validate_rollout_batch(arrays, token_budget=case.token_budget)
            out.append((batch_meta(arrays), arrays.columns))
        return out

    decoded = decode_validate()

    def assemble() -> list[bytes]:
        scheduler = Scheduler(config)
        scheduler.register_tasks([f"task-{t}" for t in range(64)])
        for meta, columns in decoded:
            scheduler.ingest_batch(meta, columns)
        (work,) = scheduler.plan_ready_steps()
        return materialize_work(work, resolve=lambda columns: columns)

    responses = assemble()
    served_mib = sum(map(len, responses)) / (1 << 20)

    def client_decode():
        for payload in responses:
            decode_step(parse_get_batch_response(payload))  # what BatchLoader does

    timings = {
        "client: rollouts -> Arrow batches (RolloutColumns + encode)": _best(encode_all),
        "server: decode + validate + metadata": _best(decode_validate),
    }
    timings["server: plan + materialize + encode all ranks"] = _best(assemble)
    timings["client: parse GetBatchResponse in place + decode_step"] = _best(client_decode)
    print(
        f"  stages, one step ({per_step} rollouts, {mib:.1f} MiB in, {served_mib:.1f} MiB "
        "out), each alone, best of 3:"
    )
    for name, seconds in timings.items():
        print(f"    {name:<58} {seconds * 1e3:8.2f} ms  {mib / seconds:9.1f} MiB/s of ingest")
    total = sum(timings.values())
    print(f"    {'sum (one core, no overlap)':<58} {total * 1e3:8.2f} ms  {mib / total:9.1f} MiB/s")
