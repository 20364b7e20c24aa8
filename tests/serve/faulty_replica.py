"""An engine replica whose engine a test can break (pickled by value into Ray's workers)."""

from __future__ import annotations

from typing import Any

from inlinelm.serve.ray import EngineReplica


class FaultyReplica(EngineReplica):
    """:class:`EngineReplica` with :meth:`break_engine`, called through a Serve handle."""

    def break_engine(self) -> str:
        """Make the runner's next step raise (the engine then dies); returns this replica's id."""
        loaded = self.engine._loaded
        assert loaded is not None
        runner = loaded.core.runner

        def fail(batch: Any) -> None:
            raise RuntimeError("injected: the device fell over")

        runner.submit = fail
        return self.replica_id
