"""The scheduler: one `Scheduler` (state.py) composed of a part per job, journaled
(journaled.py) and hosted in a Ray actor (actor.py). The state machines of a rollout and
of a step, and which module moves each: README.md."""
