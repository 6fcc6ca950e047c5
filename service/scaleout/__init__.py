"""Running N front-ends on one scheduler actor, two ways (mutually exclusive):

- `processes.py`  `[server] replicas`: forked front-end processes on this machine,
                  restarted when they die (`rlfeed serve` watches them)
- `actor.py`, `placement.py`, `driver.py`  `[frontends] count`: front-ends as Ray actors
                  placed across the cluster, each serving the gRPC port of its node; the
                  driver watches them until told to stop. On a cluster of its own they
                  outlive it, and `lease.py` says which driver owns (or adopts) them

One front-end (server, handlers, peers, hand-over) is `service/frontend/`.
"""
