"""A policy learning through rlfeed (what `rlfeed demo` runs by default), one module a job:

`policy` (the Hugging Face model and its cached warm start), `generation` (KV-cached group
sampling with tool turns), `weights` (the hand-off from trainer rank 0 to producers),
`pacing` (how far ahead producers sample), `producer` and `trainer` (the processes),
`evaluation` (exact pass rates), `run_spec` (what the processes share), `run_records` (per-step
figures joined from their logs).
"""
