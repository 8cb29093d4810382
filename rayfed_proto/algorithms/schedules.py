"""The alignment curriculum (FedSAP Eq. 7 and appendix A.1-A.2) as a component any method uses.

lambda_t = lambda * g((t - start) / length), with g clipped to [0, 1], where t is the round the
update is trained for, counted from 1 as the paper counts rounds: the server version the client
trained against plus one (sync round r trains against version r - 1), so that FedSAP's "from 0 to
0.7 until round 100" puts the full weight on the 100th round, which trains against version 99.
``lambda`` is the method's own alignment weight (FedSAP's M); the schedule only shapes when it
arrives. Without a schedule a method keeps its paper's
constant weight (ALGORITHMS.md, **Decision**: a generic component, not FedSAP's private code).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import ConfigDict, Field

from rayfed_proto.numbers import StrictNumbers


class AlignmentSchedule(StrictNumbers):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    shape: Literal["linear", "cosine", "sigmoid", "step"] = Field(
        "linear", description="ramp shape g: linear (FedSAP Eq. 7), cosine, sigmoid, or step")
    start: int = Field(20, ge=0, description="r_start: the round where the ramp begins (0 up to it; round = version trained against + 1)")
    length: int = Field(80, ge=1, description="t_w: rounds from start to the full weight (reached at round start + length)")

    def at_version(self, version: int) -> float:
        """g for an update trained against server ``version``: the factor of round ``version + 1``
        (FedSAP Eq. 7 counts rounds from 1; round t trains against version t - 1)."""
        return self.factor(version + 1)

    def factor(self, round_: int) -> float:
        """g in [0, 1] at round ``round_`` (counted from 1)."""
        u = min(max((round_ - self.start) / self.length, 0.0), 1.0)
        if self.shape == "linear":
            return u  # FedSAP Eq. 7: min(t / t_w, 1), shifted to begin at r_start (appendix A.2)
        if self.shape == "cosine":
            return 0.5 * (1.0 - math.cos(math.pi * u))
        if self.shape == "sigmoid":
            # logistic centred mid-ramp, rescaled so that g(0) = 0 and g(1) = 1 exactly
            lo, hi = 1 / (1 + math.exp(5.0)), 1 / (1 + math.exp(-5.0))
            return (1 / (1 + math.exp(-10.0 * (u - 0.5))) - lo) / (hi - lo)
        # step (Decision): nothing until the ramp's end, then the full weight at once
        return 1.0 if u >= 1.0 else 0.0
