"""hypothesis stateful test: random arrivals (shared prefixes, prompts continuing one document
as in a multi-turn chat), output lengths (0, and a client's "no limit"), pools smaller than
the context, page and chunk sizes, policies, mixed mode, the prefill guard, deferral, priorities with preemption and aging, aborts
(also of in-flight requests), bad requests. Invariants hold after every rule; every run ends
within a step bound; every request ends exactly once; the pool is whole once the cache is
evicted; every output equals the greedy reference of an unconstrained run (or a prefix of it
for a length-limited request), so tiny and ample pools give the same tokens."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from helpers.scheduler_machine import SchedulerMachine

SchedulerMachine.TestCase.settings = settings(
    max_examples=75, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestScheduler = SchedulerMachine.TestCase
