"""A sweep's autoscaler request, narrowed as its trials finish.

Before ``Tuner.fit`` a sweep on an autoscaling cluster asks for the placement groups of
``max_concurrent_trials`` trials at once (``plan.request_for_trials``). A request stands until
it is replaced, so without narrowing the nodes for all concurrent trials would stay up until the
last trial ends. :class:`NarrowRequest`, a Tune callback, replaces it each time a trial
completes or errors for good with the groups of the trials that can still run at once
(``min(max_concurrent_trials, trials not finished)``), and withdraws it with the last one. It
only ever narrows a request this process made (``autoscale.narrow_request``), so a sweep that
asked for nothing (the cluster had the nodes) asks for nothing later either.
"""

from __future__ import annotations

from ray.tune import Callback

from rayfed_proto.runtime import autoscale

_FINISHED = ("TERMINATED", "ERROR")


class NarrowRequest(Callback):
    """``trial_bundles``: one trial's placement-group bundles; at most ``concurrent`` trials at
    once out of ``num_trials``. Holds no state of its own (Tune pickles it with the experiment,
    and a resumed sweep gets it back): what stands is ``autoscale``'s."""

    def __init__(self, trial_bundles: list[dict[str, float]], concurrent: int, num_trials: int):
        self.trial_bundles = [dict(b) for b in trial_bundles]
        self.concurrent = max(1, int(concurrent))
        self.num_trials = int(num_trials)

    def wanted_trials(self, trials, trial) -> int:
        """Trials that can still run at once: the unfinished ones, at most ``concurrent``."""
        done = {t.trial_id for t in trials if str(getattr(t, "status", "")) in _FINISHED} | {trial.trial_id}
        return max(0, min(self.concurrent, self.num_trials - len(done)))

    def _narrow(self, trials, trial) -> None:
        autoscale.narrow_request(self.trial_bundles * self.wanted_trials(trials, trial))

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._narrow(trials, trial)

    def on_trial_error(self, iteration, trials, trial, **info):  # failed for good (a retry is on_trial_recover)
        self._narrow(trials, trial)
