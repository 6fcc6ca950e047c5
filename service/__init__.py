"""The sidecar: I/O around `rlfeed.sched`, one subpackage per part.

- `scheduler/`  the Scheduler state class, the records that cross the actor boundary, the
                named Ray actor hosting it, and the typed client front-ends call it with
- `frontend/`   one gRPC process: ingest, serving, the assembler thread, codec, validation,
                memory, start-up and shutdown (how a step's bytes move: frontend/README.md)
- `replicas/`   several front-ends on one actor: the peer service, hand-over, processes
- `metrics/`    Prometheus families and figures, the exporter, its HTTP endpoint, Figure 14.1
- `demo/`       `rlfeed demo`: a synthetic inference fleet and two trainer ranks
- `cli/`        the `rlfeed` command (each subcommand a module; `--help` imports no numpy)
- `config.py` the one typed config; `errors.py` reject reasons; `inprocess.py` the sidecar
  without gRPC or Ray; `testing.py` synthetic rollouts and checks shared by tests and benches
"""
