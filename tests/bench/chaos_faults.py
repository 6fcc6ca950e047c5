"""The faults `bench_chaos.py` does to its `World`, one at a time. Each returns the seconds
until the run recovered from it (the sidecar serving on every front-end again, or the
client's next ack or step), or raises TimeoutError.
"""

from __future__ import annotations

import time

from chaos_sidecar import ACTOR_NAME, FRONT_ENDS, NAMESPACE, World, until


def fault(world: World, kind: str, rng, timeout_s: float) -> float:
    """Do one fault of `kind`; the seconds until the run recovered from it."""
    import ray

    if kind == "driver":
        started = time.monotonic()
        world.kill_serve()
        world.start_serve(timeout_s)
        until(world.serving, timeout_s, "the sidecar not serving after its driver restarted")
        return time.monotonic() - started
    if kind == "scheduler":
        actor = ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
        before = ray.get(actor.incarnation.remote(), timeout=30)
        ray.kill(actor, no_restart=False)

        def restarted() -> bool:
            try:
                now = ray.get(actor.incarnation.remote(), timeout=5)
            except ray.exceptions.RayError:
                return False
            return now != before and world.serving()

        return until(restarted, timeout_s, "the scheduler actor not back")
    if kind == "frontend":
        slot = f"frontend-{rng.randrange(FRONT_ENDS)}"
        old = {slot: world.front_ends()[slot].id}
        ray.kill(ray.get_actor(f"{ACTOR_NAME}-{slot}", namespace=NAMESPACE), no_restart=False)
        return until(lambda: world.serving(old), timeout_s, f"{slot} not back")
    if kind == "node":
        return node_loss(world, rng, timeout_s)
    role = "producer" if kind == "producer" else "rank"
    count = world.args.producers if kind == "producer" else world.world_size
    name = f"{role}-{rng.randrange(count)}"
    log = f"{name}.acked" if kind == "producer" else f"{name}.served"
    started = time.monotonic()
    world.kill_client(name)
    lines = world.log_lines(log)  # once it is dead: what comes next is the new process's
    world.start_client(name)
    until(lambda: world.log_lines(log) > lines, timeout_s, f"{name} not going on")
    return time.monotonic() - started


def node_loss(world: World, rng, timeout_s: float) -> float:
    """The worker node of a front-end lost (its processes SIGKILLed); recovered once the
    front-end serves from another node. A new worker then replaces the lost one."""
    front_ends = world.front_ends()
    slot = f"frontend-{rng.randrange(FRONT_ENDS)}"
    lost = front_ends[slot].node_id
    (node,) = [worker for worker in world.workers if worker.node_id == lost]
    started = time.monotonic()
    world.cluster.remove_node(node, allow_graceful=False)
    world.workers.remove(node)

    def moved() -> bool:
        now = world.front_ends().get(slot)
        return now is not None and now.node_id != lost and world.serving()

    until(moved, timeout_s, f"{slot} not back on another node")
    seconds = time.monotonic() - started
    world.workers.append(world.add_worker())  # the replacement machine, for the next loss
    world.cluster.wait_for_nodes()
    return seconds
