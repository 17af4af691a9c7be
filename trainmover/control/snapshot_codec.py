"""The controller's snapshot codec: the classes a snapshot in the store may hold (and a
resumed controller or ``trainmover status`` may rebuild), nothing else (``core/codec.py``).
Apart from the coordinator, so a reader of snapshots needs no controller."""
from __future__ import annotations

from trainmover.control.health import Failure
from trainmover.control.migrations import ActiveMigration, MigrationRequest
from trainmover.control.processes import AgentClient, ProcView
from trainmover.control.recovery import ActiveRecovery
from trainmover.core import decisions as C
from trainmover.core import protocol as P
from trainmover.core.codec import Codec
from trainmover.core.faults import Inject
from trainmover.core.topology import Layout, Role

SNAPSHOT_CODEC = Codec(
    C.Membership, C.StandbyState, C.MigrationState, C.MigrationPlan, C.RecoveryPlan, C.Pair,
    Role, Layout, MigrationRequest, ActiveMigration, ActiveRecovery, Failure, Inject,
    AgentClient, ProcView, P.AgentSpawn, P.FailureReport)
