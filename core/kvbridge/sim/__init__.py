"""Deterministic simulation testing of the agent protocol (FoundationDB / VOPR style).

Real ``TransferAgent``s of prefill and decode ranks run in one process, without threads or real time, over a
simulated link (:mod:`~kvbridge.sim.link`) and backend (:mod:`~kvbridge.sim.backend`); a seeded scheduler
(:mod:`~kvbridge.sim.scheduler`) interleaves progress steps, deliveries, engine actions and faults, and the
invariants (:mod:`~kvbridge.sim.invariants`) are checked after every step. ``python -m kvbridge.sim --seed N``.
"""

from kvbridge.sim.scheduler import Result, Simulation, run_seed
from kvbridge.sim.world import SimFailure

__all__ = ["Result", "SimFailure", "Simulation", "run_seed"]
