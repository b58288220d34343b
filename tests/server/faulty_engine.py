"""Test-only faults for engine replicas: end a replica's engine thread as a failed engine restart would.

``FaultyEngine`` is the engine deployment with one more method, for tests that run Ray Serve in the
test process (``cloudpickle.register_pickle_by_value`` ships this module to the replicas)."""
from __future__ import annotations

from specdec.server.cluster.replica import Engine


def kill_engine_thread(scheduler) -> None:
    """Make ``scheduler``'s engine thread end with an error its loop does not catch (as when restarting a
    failed engine fails), and wake it."""
    def boom(_handles):
        raise SystemExit("test fault: the engine thread ends")
    scheduler._cancel = boom
    with scheduler._cond:
        scheduler._cancels.append(None)
        scheduler._cond.notify()


class FaultyEngine(Engine):
    def kill_engine_thread(self) -> str:
        """End this replica's engine thread; its replica id."""
        kill_engine_thread(self.scheduler)
        return self.name

    def slow_steps(self, seconds: float) -> str:
        """Make each engine step of this replica take ``seconds`` longer (a request stays in flight)."""
        import time  # noqa: PLC0415 (this module travels by value to the replicas)

        engine = self.scheduler.engine
        step = engine.step

        def slow():
            time.sleep(seconds)
            return step()
        engine.step = slow
        return self.name
