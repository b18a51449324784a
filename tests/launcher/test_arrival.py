"""When a member says ``arrived``: only where forming a generation takes a while."""

from __future__ import annotations

import math

from launcher.client import PendingArrival


def test_an_arrival_goes_when_due_and_only_once():
    arrival = PendingArrival()
    assert arrival.take_due(0.0) is None and arrival.due_t == math.inf
    arrival.schedule(3, due_t=2.5)
    assert arrival.take_due(2.4) is None  # forming for less than the delay: nothing said yet
    assert arrival.take_due(2.5) == 3
    assert arrival.take_due(9.0) is None and arrival.due_t == math.inf


def test_a_generation_acknowledged_before_the_delay_needs_no_arrival():
    arrival = PendingArrival()
    arrival.schedule(3, due_t=2.5)
    arrival.acknowledged(2)  # an older generation's acknowledgement changes nothing
    assert arrival.due_t == 2.5
    arrival.acknowledged(3)
    assert arrival.take_due(10.0) is None


def test_a_newer_generation_replaces_the_pending_arrival():
    arrival = PendingArrival()
    arrival.schedule(3, due_t=2.5)
    arrival.schedule(4, due_t=5.0)  # generation 3 was superseded while forming
    assert arrival.take_due(3.0) is None
    assert arrival.take_due(5.0) == 4
