"""Bytes ↔ arrays, with no gRPC or Ray: what the front-end and the in-process transport
both run between a wire message and the scheduler.

- `messages.py`        rollout batches decoded to arrays, microbatches and status encoded
- `validation.py`      what the contract refuses in a batch, vectorized
- `request_checks.py`  the small requests' checks (task ids, trainer reports)
- `rollout_batch.py`   one batch: decode → validate → metadata → ack
- `materialize.py`, `response_pieces.py`  a planned step's per-rank response bytes
"""
