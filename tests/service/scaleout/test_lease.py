"""The driver lease's rule (`service/scaleout/lease.py`), on the actor body with a clock
the test moves: the holder renews; another driver is refused while the lease is fresh and
takes it over once it lapsed, learning whose it was; the old holder then cannot renew."""

from __future__ import annotations

from rlfeed.service.scaleout.lease import DriverLeaseActor, LeaseHolder

TTL_S = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _holder(name: str, digest: str = "d1") -> LeaseHolder:
    return LeaseHolder(driver_id=name, host="h", pid=len(name), config_digest=digest)


def test_the_creator_holds_the_lease_and_each_renewal_counts() -> None:
    clock, owner = Clock(), _holder("owner")
    lease = DriverLeaseActor(owner, clock=clock)
    first = lease.take(owner, TTL_S)
    clock.now += 4.0
    second = lease.take(owner, TTL_S)
    assert (first.taken, first.previous, first.renewals) == (True, None, 1)
    assert (second.taken, second.previous, second.renewals, second.age_s) == (True, None, 2, 4.0)


def test_another_driver_is_refused_while_the_holder_renews() -> None:
    clock, owner, other = Clock(), _holder("owner"), _holder("other")
    lease = DriverLeaseActor(owner, clock=clock)
    clock.now += TTL_S  # not yet lapsed: exactly the TTL
    refused = lease.take(other, TTL_S)
    assert (refused.taken, refused.holder, refused.age_s) == (False, owner, TTL_S)
    renewed = lease.take(owner, TTL_S)
    again = lease.take(other, TTL_S)
    assert renewed.taken and not again.taken
    assert again.renewals == refused.renewals + 1  # how a waiting driver sees the owner live


def test_a_lapsed_lease_is_taken_over_and_the_old_holder_cannot_renew_it() -> None:
    clock, owner, other = Clock(), _holder("owner"), _holder("other", digest="d2")
    lease = DriverLeaseActor(owner, clock=clock)
    clock.now += TTL_S + 0.1
    taken = lease.take(other, TTL_S)
    assert (taken.taken, taken.holder, taken.previous) == (True, other, owner)
    assert taken.previous.config_digest == "d1"  # the new driver adopts only the same config
    late = lease.take(owner, TTL_S)  # the old one was only stalled: it has lost the lease
    assert (late.taken, late.holder) == (False, other)
