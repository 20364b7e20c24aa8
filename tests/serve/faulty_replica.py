"""An engine replica whose engine a test can break (pickled by value into Ray's workers,
with tests.helpers, which it reaches the engine's parts through)."""

from __future__ import annotations

from typing import Any

from inlinelm.serve.ray import EngineReplica
from tests.helpers import core_of


class FaultyReplica(EngineReplica):
    """:class:`EngineReplica` with :meth:`break_engine`, called through a Serve handle."""

    def break_engine(self) -> str:
        """Make the runner's next step raise (the engine then dies); returns this replica's id."""
        runner = core_of(self.engine).runner

        def fail(batch: Any) -> None:
            raise RuntimeError("injected: the device fell over")

        runner.submit = fail
        return self.replica_id
