"""The sidecar: I/O around `rlfeed.sched`, one subpackage per part.

- `config/`     the one typed config: a module per section, one field helper, TOML in and out
- `scheduler/`  the Scheduler state (split by job, README draws a rollout's and a step's
                life), the records that cross the actor boundary, the named Ray actor hosting
                it, and the typed client front-ends call it with
- `codec/`      bytes ↔ arrays with no gRPC or Ray: decode, validation, request checks, a
                step's response bytes (shared by the front-end and `inprocess.py`)
- `frontend/`   one gRPC front-end: ingest, serving, the assembler thread, memory, peers,
                hand-over, start-up and shutdown (how a step's bytes move: frontend/README.md)
- `scaleout/`   N front-ends on one actor: forked processes (`[server] replicas`) or Ray
                actors (`[frontends] count`), their placement and the driver's watch
- `journal/`    the durable, CRC-checked journal and snapshot store (README: format, recovery)
- `security/`   TLS, mutual TLS and bearer tokens of the public port (README)
- `metrics/`    Prometheus families and figures, the exporter, its HTTP endpoint, Figure 14.1
- `gym/`, `learning/`  verifiable tasks and a policy learning through the sidecar
- `demo/`       `rlfeed demo`: the learning run or a synthetic fleet, with trainer ranks
- `cli/`        the `rlfeed` command (each subcommand a module; `--help` imports no numpy)
- `errors.py` reject reasons; `inprocess.py` the sidecar without gRPC or Ray;
  `testing.py` synthetic rollouts and checks shared by tests and benches

No two folders import each other: `tests/service/test_layering.py` lists the arrows.
"""
